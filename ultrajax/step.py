"""The jitted train step: one program for train.py and analyze.py.

A step takes a global batch shaped (grad_accum, micro_batch x dp, seq_len + 1),
scans over the micro-batches accumulating fp32 gradients, and applies one
optimizer update. The loss is the sum of per-token losses over every
micro-batch divided by the total count of target tokens, so grad_accum=4 and
grad_accum=1 on the same global batch give the same loss and gradients even
when micro-batches hold different numbers of valid tokens. Accumulating inside
one jitted step is also our `no_sync`: gradients are reduced once per step,
not once per micro-batch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from ultrajax.config import Config
from ultrajax.mesh import Rules, make_mesh, only_axes, tree_shardings
from ultrajax.mesh import rules as mesh_rules
from ultrajax.model import forward, init_params, logical_axes


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


def loss_sum(cfg: Config, params, batch, rules=None, layer_weights=None):
    """(sum of token NLLs, count of target tokens) for one micro-batch (batch, seq_len + 1)."""
    tokens, seg, pos = batch["tokens"], batch["segment_ids"], batch["positions"]
    cross_doc = cfg.data.cross_doc_mask
    logits = forward(
        cfg.model,
        params,
        tokens[:, :-1],
        pos[:, :-1],
        seg[:, :-1] if cross_doc else None,
        rules=rules,
        layer_weights=layer_weights,
    )
    targets = tokens[:, 1:]
    mask = target_mask(seg, cross_doc)
    # one-hot dot instead of a gather: with vocabulary-parallel logits the partitioner
    # turns both reductions into partial sums + all-reduce, never gathering the vocab.
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.sum(logits * jax.nn.one_hot(targets, logits.shape[-1]), axis=-1)
    nll = (log_z - target_logit) * mask
    return nll.sum(), mask.sum()


DP_AXES = ("data", "fsdp")  # the batch is split over these; gradients are reduced over them


def _embed_dim(names) -> int:
    return names.index("embed")


def _shard_zeros(z, names):
    shape = list(z.shape)
    shape[_embed_dim(names)] //= jax.lax.axis_size("fsdp")
    return jnp.zeros(shape, z.dtype)


def make_train_step(cfg: Config, tx, schedule, mesh=None, rules: Rules | None = None):
    """Build train_step(state, batch) -> (state, metrics). Jit it with `jit_train_step`.

    The data-parallel part is explicit: the micro-batch loop runs per batch shard
    inside `shard_map` over (data, fsdp), so we choose when gradients are reduced
    (the tensor axis stays with the partitioner, which places the TP collectives):

    - ZeRO-0: accumulate full gradients locally, one all-reduce per step.
    - ZeRO-1: accumulate full gradients locally, one reduce-scatter per step over
      fsdp; each rank updates its shard of master weights and optimizer state; the
      next step all-gathers the (compute-dtype) parameters.
    - ZeRO-2: reduce-scatter every micro-batch into a sharded accumulator (gradient
      memory / N_d, communication x grad_accum: the stage cannot reduce once).
    - ZeRO-3: parameters stay sharded; each layer's weights are all-gathered inside
      the layer scan, forward and again (recomputed) backward; autodiff turns the
      gather into a reduce-scatter of that layer's gradient.
    The data axis (pure replicas) always reduces once per step.
    """
    if mesh is None:  # one device, every mesh size 1
        mesh, rules = make_mesh(cfg, jax.devices()[:1]), mesh_rules(cfg)
    dtype = jnp.dtype(cfg.model.dtype)
    zero = cfg.parallel.zero
    axes = logical_axes(cfg.model)
    is_names = lambda x: isinstance(x, tuple)  # noqa: E731
    spec = lambda kind: jax.tree.map(lambda n: rules.spec(n, kind), axes, is_leaf=is_names)  # noqa: E731
    manual = lambda tree: jax.tree.map(  # noqa: E731
        lambda sp: only_axes(sp, DP_AXES), tree, is_leaf=lambda x: isinstance(x, PartitionSpec)
    )
    stored_specs, compute_specs = spec("stored"), spec("compute")
    inner = rules.inside_batch_shard_map()

    def psum(x, names):  # skip size-1 axes: no trivial collectives in the HLO we count
        names = tuple(a for a in names if mesh.shape[a] > 1)
        return jax.lax.psum(x, names) if names else x

    def gather(w, names):  # ZeRO-3: whole weights from fsdp shards
        return jax.lax.all_gather(w, "fsdp", axis=_embed_dim(names), tiled=True)

    def scatter(g, names):  # sum over fsdp, keep this rank's shard
        return jax.lax.psum_scatter(g, "fsdp", scatter_dimension=_embed_dim(names), tiled=True)

    layer_axes = {k: v[1:] for k, v in axes["layers"].items()}
    top_keys = [k for k in axes if k != "layers"]

    def loss_fn(cparams, mb, scale):
        if zero >= 3:
            cparams = dict(cparams)
            for k in top_keys:
                cparams[k] = gather(cparams[k], axes[k])
            hook = lambda p: {k: gather(w, layer_axes[k]) for k, w in p.items()}  # noqa: E731
        else:
            hook = None
        total, _ = loss_sum(cfg, cparams, mb, inner, layer_weights=hook)
        return total * scale

    def shard_grads(cparams, batch):
        """Per data-parallel shard: local micro-batches -> (gradients, loss) reduced as the
        ZeRO stage says."""
        n_targets = psum(target_mask(batch["segment_ids"], cfg.data.cross_doc_mask).sum(), DP_AXES)
        scale = 1.0 / jnp.maximum(n_targets, 1).astype(jnp.float32)

        def micro(carry, mb):
            grads, loss = carry
            part, g = jax.value_and_grad(loss_fn)(cparams, mb, scale)
            if zero == 2:
                g = jax.tree.map(scatter, g, axes, is_leaf=is_names)
            grads = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), grads, g)
            return (grads, loss + part), None

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), cparams)
        if zero == 2:  # the accumulator holds only this rank's shard
            zeros = jax.tree.map(_shard_zeros, zeros, axes)
        (grads, loss), _ = jax.lax.scan(micro, (zeros, jnp.zeros((), jnp.float32)), batch)
        if zero == 0:
            grads = psum(grads, DP_AXES)
        else:
            if zero == 1:
                grads = jax.tree.map(scatter, grads, axes, is_leaf=is_names)
            grads = psum(grads, ("data",))
        return grads, psum(loss, DP_AXES), n_targets

    batch_spec = PartitionSpec(None, DP_AXES, None)
    grads_spec = manual(stored_specs) if zero >= 1 else manual(compute_specs)
    sharded_grads = jax.shard_map(
        shard_grads,
        mesh=mesh,
        in_specs=(manual(compute_specs), batch_spec),
        out_specs=(grads_spec, PartitionSpec(), PartitionSpec()),
        axis_names=frozenset(DP_AXES),
        check_vma=False,  # we place every reduction ourselves (see the docstring)
    )
    compute_sh = tree_shardings(mesh, axes, rules, "compute")

    def train_step(state, batch):
        params = state["params"]
        # compute copy, cast once per step (ZeRO-1/2: the parameter all-gather happens here)
        cparams = jax.lax.with_sharding_constraint(
            jax.tree.map(lambda p: p.astype(dtype), params), compute_sh
        )
        grads, loss, n_targets = sharded_grads(cparams, batch)
        grad_norm = optax.global_norm(grads)
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


def make_eval_step(cfg: Config, rules: Rules | None = None):
    """eval_step(params, batch) -> (sum of NLL, count) over all micro-batches."""
    dtype = jnp.dtype(cfg.model.dtype)

    def eval_step(params, batch):
        cparams = jax.tree.map(lambda p: p.astype(dtype), params)

        def micro(carry, mb):
            s, n = loss_sum(cfg, cparams, mb, rules)
            return (carry[0] + s, carry[1] + n), None

        (s, n), _ = jax.lax.scan(micro, (jnp.zeros(()), jnp.zeros((), jnp.int32)), batch)
        return s, n

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
