"""The jitted train step: one program for train.py and analyze.py.

A step takes a global batch shaped (grad_accum, micro_batch x dp, seq_len + 1),
scans over the micro-batches accumulating fp32 gradients, and applies one
optimizer update. The loss is the sum of per-token losses over every
micro-batch divided by the total count of target tokens, so grad_accum=4 and
grad_accum=1 on the same global batch give the same loss and gradients even
when micro-batches hold different numbers of valid tokens.

Forward and backward run per device inside one `shard_map` over the whole mesh,
with every collective written out where the playbook puts it (data and ZeRO
reductions here, tensor/sequence parallel boundaries in parallel/tensor.py).
XLA's partitioner handles what is outside: the optimizer update on sharded
state and the ZeRO-1/2 gather of the compute-dtype parameters. Why explicit:
the partitioner cannot carry un-reduced gradients across micro-batches (so it
would all-reduce once per micro-batch), and on the CPU backend it leaves every
reduce-scatter as all-reduce + slice.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from ultrajax.config import Config
from ultrajax.mesh import AXES, Rules, make_mesh, tree_shardings
from ultrajax.mesh import rules as mesh_rules
from ultrajax.model import forward, init_params, logical_axes
from ultrajax.parallel.tensor import TensorParallel, cross_entropy

DP_AXES = ("data", "fsdp")  # the batch is split over these; gradients are reduced over them


def init_state(cfg: Config, tx: optax.GradientTransformation, key) -> dict:
    params = init_params(cfg.model, key)
    return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params)}


def state_shardings(cfg: Config, mesh, rules: Rules, tx) -> dict:
    """Where every leaf of the train state lives (ZeRO >= 1 shards it over fsdp)."""
    abstract = jax.eval_shape(functools.partial(init_state, cfg, tx), jax.random.key(0))
    params = tree_shardings(mesh, logical_axes(cfg.model), rules, "stored")
    replicated = NamedSharding(mesh, PartitionSpec())
    opt = optax.tree_map_params(
        tx, lambda _, s: s, abstract["opt_state"], params, transform_non_params=lambda _: replicated
    )
    return {"step": replicated, "params": params, "opt_state": opt}


def target_mask(segment_ids, cross_doc_mask: bool):
    """Which next-token targets count: not padding (segment 0) and, with cross-document
    masking, not the first token of the next document."""
    seg_in, seg_tgt = segment_ids[..., :-1], segment_ids[..., 1:]
    valid = seg_tgt > 0
    if cross_doc_mask:
        valid &= seg_tgt == seg_in
    return valid


def loss_sum(cfg: Config, params, batch, tp: TensorParallel | None = None, layer_weights=None):
    """(sum of token NLLs, count of target tokens) for one micro-batch (batch, seq_len + 1)."""
    tokens, seg, pos = batch["tokens"], batch["segment_ids"], batch["positions"]
    cross_doc = cfg.data.cross_doc_mask
    logits = forward(
        cfg.model,
        params,
        tokens[:, :-1],
        pos[:, :-1],
        seg[:, :-1] if cross_doc else None,
        tp=tp,
        layer_weights=layer_weights,
    )
    mask = target_mask(seg, cross_doc)
    nll = cross_entropy(logits, tokens[:, 1:], tp) * mask
    return nll.sum(), mask.sum()


def _embed_dim(names) -> int:
    return names.index("embed")


def _shard_zeros(z, names):
    shape = list(z.shape)
    shape[_embed_dim(names)] //= jax.lax.axis_size("fsdp")
    return jnp.zeros(shape, z.dtype)


def _specs(axes, rules: Rules, kind: str):
    return jax.tree.map(lambda n: rules.spec(n, kind), axes, is_leaf=lambda x: isinstance(x, tuple))


class _PerDevice:
    """The pieces of per-device code shared by the train and eval steps."""

    def __init__(self, cfg: Config, mesh, rules: Rules):
        self.cfg, self.mesh = cfg, mesh
        self.zero = cfg.parallel.zero
        self.axes = logical_axes(cfg.model)
        self.layer_axes = {k: v[1:] for k, v in self.axes["layers"].items()}
        self.tp = TensorParallel(mesh.shape["tensor"], cfg.parallel.sequence_parallel)
        self.specs = {kind: _specs(self.axes, rules, kind) for kind in ("stored", "compute")}
        self.batch_spec = PartitionSpec(None, DP_AXES, None)

    def psum(self, x, names):
        """psum over the named axes of size > 1 (no trivial collectives in the HLO)."""
        names = tuple(a for a in names if self.mesh.shape[a] > 1)
        return jax.lax.psum(x, names) if names else x

    def gather(self, w, names):  # ZeRO-3: whole weights from the fsdp shards
        if self.mesh.shape["fsdp"] == 1:
            return w
        return jax.lax.all_gather(w, "fsdp", axis=_embed_dim(names), tiled=True)

    def scatter(self, g, names):  # sum over fsdp and keep this rank's shard
        if self.mesh.shape["fsdp"] == 1:
            return g
        return jax.lax.psum_scatter(g, "fsdp", scatter_dimension=_embed_dim(names), tiled=True)

    def loss(self, cparams, mb, layer_gather: bool):
        hook = None
        if layer_gather:
            cparams = dict(cparams)
            for k in cparams:
                if k != "layers":
                    cparams[k] = self.gather(cparams[k], self.axes[k])
            hook = lambda p: {k: self.gather(w, self.layer_axes[k]) for k, w in p.items()}  # noqa: E731
        return loss_sum(self.cfg, cparams, mb, self.tp, layer_weights=hook)

    def n_targets(self, batch):
        return self.psum(
            target_mask(batch["segment_ids"], self.cfg.data.cross_doc_mask).sum(), DP_AXES
        )

    def shard_map(self, fn, in_specs, out_specs):
        return jax.shard_map(
            fn,
            mesh=self.mesh,
            in_specs=in_specs,
            out_specs=out_specs,
            axis_names=frozenset(AXES),
            check_vma=False,  # every reduction is placed by hand (see the module docstring)
        )


def make_train_step(cfg: Config, tx, schedule, mesh=None, rules: Rules | None = None):
    """Build train_step(state, batch) -> (state, metrics). Jit it with `jit_train_step`.

    Where the gradients are reduced, per ZeRO stage (fsdp axis; the data axis of
    pure replicas always reduces once per step):
    - ZeRO-0: accumulate full gradients locally, one all-reduce per step.
    - ZeRO-1: accumulate full gradients locally, one reduce-scatter per step; each
      rank updates its shard of master weights and optimizer state; the next step
      all-gathers the compute-dtype parameters.
    - ZeRO-2: reduce-scatter every micro-batch into a sharded accumulator (gradient
      memory / N_d, communication x grad_accum: this stage cannot reduce once).
    - ZeRO-3: parameters stay sharded; each layer's weights are all-gathered inside
      the layer scan, forward and again (recomputed) backward; autodiff turns the
      gather into a reduce-scatter of that layer's gradient, every micro-batch.
    With sequence parallelism the norm scales see 1/tp of the tokens on each rank,
    so their gradients are also summed over `tensor`.
    """
    if mesh is None:  # one device, every mesh size 1
        mesh, rules = make_mesh(cfg, jax.devices()[:1]), mesh_rules(cfg)
    dtype = jnp.dtype(cfg.model.dtype)
    dev = _PerDevice(cfg, mesh, rules)
    zero, axes = dev.zero, dev.axes
    sp_sum = cfg.parallel.sequence_parallel and mesh.shape["tensor"] > 1

    def shard_grads(cparams, batch):
        n_targets = dev.n_targets(batch)
        scale = 1.0 / jnp.maximum(n_targets, 1).astype(jnp.float32)

        def micro(carry, mb):
            grads, loss = carry
            part, g = jax.value_and_grad(lambda p: dev.loss(p, mb, zero >= 3)[0] * scale)(cparams)
            if zero == 2:
                g = jax.tree.map(dev.scatter, g, axes)
            grads = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), grads, g)
            return (grads, loss + part), None

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), cparams)
        if zero == 2 and mesh.shape["fsdp"] > 1:  # the accumulator holds this rank's shard
            zeros = jax.tree.map(_shard_zeros, zeros, axes)
        (grads, loss), _ = jax.lax.scan(micro, (zeros, jnp.zeros((), jnp.float32)), batch)
        if zero == 0:
            grads = dev.psum(grads, DP_AXES)
        else:
            if zero == 1:
                grads = jax.tree.map(dev.scatter, grads, axes)
            grads = dev.psum(grads, ("data",))
        if sp_sum:
            grads = jax.tree.map(
                lambda g, n: g if "tensor" in _flat(n) else jax.lax.psum(g, "tensor"),
                grads,
                dev.specs["compute"],
            )
        return grads, dev.psum(loss, DP_AXES), n_targets

    grads_spec = dev.specs["stored" if zero >= 1 else "compute"]
    sharded_grads = dev.shard_map(
        shard_grads,
        in_specs=(dev.specs["compute"], dev.batch_spec),
        out_specs=(grads_spec, PartitionSpec(), PartitionSpec()),
    )
    compute_sh = tree_shardings(mesh, axes, rules, "compute")

    def train_step(state, batch):
        params = state["params"]
        # compute copy, cast once per step (ZeRO-1/2: the parameter all-gather happens here)
        cparams = jax.lax.with_sharding_constraint(
            jax.tree.map(lambda p: p.astype(dtype), params), compute_sh
        )
        grads, loss, n_targets = sharded_grads(cparams, batch)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = tx.update(grads, state["opt_state"], params)
        new = {
            "step": state["step"] + 1,
            "params": optax.apply_updates(params, updates),
            "opt_state": opt_state,
        }
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": schedule(state["step"]),
            "n_targets": n_targets,
        }
        return new, metrics

    return train_step


def _flat(spec: PartitionSpec) -> tuple:
    out = []
    for entry in spec:
        if entry is not None:
            out.extend((entry,) if isinstance(entry, str) else entry)
    return tuple(out)


def make_eval_step(cfg: Config, mesh=None, rules: Rules | None = None):
    """eval_step(params, batch) -> (sum of NLL, count) over all micro-batches."""
    if mesh is None:
        mesh, rules = make_mesh(cfg, jax.devices()[:1]), mesh_rules(cfg)
    dtype = jnp.dtype(cfg.model.dtype)
    dev = _PerDevice(cfg, mesh, rules)
    compute_sh = tree_shardings(mesh, dev.axes, rules, "compute")

    def per_device(cparams, batch):
        def micro(carry, mb):
            s, _ = dev.loss(cparams, mb, dev.zero >= 3)
            return carry + s, None

        total, _ = jax.lax.scan(micro, jnp.zeros((), jnp.float32), batch)
        return dev.psum(total, DP_AXES), dev.n_targets(batch)

    sharded = dev.shard_map(
        per_device,
        in_specs=(dev.specs["compute"], dev.batch_spec),
        out_specs=(PartitionSpec(), PartitionSpec()),
    )

    def eval_step(params, batch):
        cparams = jax.lax.with_sharding_constraint(
            jax.tree.map(lambda p: p.astype(dtype), params), compute_sh
        )
        return sharded(cparams, batch)

    return eval_step


def jit_train_step(cfg: Config, mesh, rules: Rules, tx, schedule, shardings: dict, batch_sh):
    """The jitted step with donated state: what train.py runs and analyze.py compiles."""
    step = make_train_step(cfg, tx, schedule, mesh, rules)
    return jax.jit(
        step,
        in_shardings=(shardings, batch_sh),
        out_shardings=(shardings, None),
        donate_argnums=0,
    )
