"""The jitted train step: one program for train.py and analyze.py.

A step reads a Batch (grad_accum, rows, seq_len), runs every micro-batch's forward
and backward, and applies one optimizer update. The loss is the sum of per-token
losses over every micro-batch divided by the total count of target tokens.

Two ways to place the collectives (`parallel.collectives`, docs/parallelism.md):
- explicit: forward and backward run per device in one `shard_map` over every mesh
  axis of size > 1; each collective is written where the playbook puts it (ZeRO in
  parallel/zero.py, data reductions in parallel/data.py and ultrajax/weights.py,
  tensor/sequence boundaries in parallel/tensor.py);
- gspmd: the model's logical annotations drive XLA's partitioner (sharding
  constraints, parallel/partitioned.py). Only the reductions that gradient
  accumulation defers (ZeRO-0/1) run in a `shard_map` manual over the data axes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from ultrajax.batch import Batch
from ultrajax.batch import sharding as batch_sharding
from ultrajax.config import Config
from ultrajax.loss import loss_sum
from ultrajax.mesh import AXES, Rules, make_mesh, only_axes, tree_shardings
from ultrajax.mesh import rules as mesh_rules
from ultrajax.model import init_params, logical_axes
from ultrajax.parallel.data import DATA_AXES, Gradients, vary
from ultrajax.parallel.partitioned import Partitioned
from ultrajax.parallel.tensor import TensorParallel
from ultrajax.parallel.zero import Zero
from ultrajax.weights import vma


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


def unsupported(cfg: Config, backend: str) -> str | None:
    """Why this step cannot compile on `backend`, or None."""
    p = cfg.parallel
    if backend == "cpu" and p.collectives == "gspmd" and p.grad_reduce_dtype == "bfloat16":
        return (
            "parallel.grad_reduce_dtype=bfloat16 with parallel.collectives=gspmd aborts XLA's "
            "CPU compiler (a bf16 all-reduce in a partly manual shard_map); on a CPU use "
            "parallel.collectives=explicit or grad_reduce_dtype=float32"
        )
    return None


def _is_names(x) -> bool:
    return isinstance(x, tuple)


class Plan:
    """Everything the step needs to know about the layout, decided once."""

    def __init__(self, cfg: Config, mesh, rules: Rules, *, grads: bool = True):
        self.cfg, self.mesh, self.rules = cfg, mesh, rules
        self.names = logical_axes(cfg.model)
        self.zero = Zero(cfg.parallel.zero, mesh.shape["fsdp"])
        self.gspmd = cfg.parallel.collectives == "gspmd"
        big = frozenset(a for a in AXES if mesh.shape[a] > 1)
        # gspmd: manual only where accumulation defers a data reduction (ZeRO-0/1)
        defer = grads and self.zero.active <= 1
        self.manual = (big & frozenset(DATA_AXES) if defer else frozenset()) if self.gspmd else big
        # explicit: manual over every axis, the one-wide ones too (their specs name none of
        # them, so nothing varies over them): a partially manual shard_map puts sharding
        # annotations into collectives' reducers, and XLA:CPU aborts on a bf16 all-reduce
        # of such (AllReducePromotion)
        self.axis_names = self.manual if self.gspmd else frozenset(AXES)
        self.specs = {k: self._specs(k) for k in ("stored", "compute")}
        self.gathered = self._specs("compute", drop="fsdp")
        inner = (
            rules.inside_batch_shard_map()
            if "data" in self.manual or ("fsdp" in self.manual)
            else rules
        )
        self.layout = (
            Partitioned(inner)
            if self.gspmd
            else TensorParallel(mesh.shape["tensor"], cfg.parallel.sequence_parallel)
        )
        grad_kind = "stored" if self.zero.shards_state else "compute"
        auto_specs = None
        if self.gspmd:  # the partitioner gives each reduced gradient its final layout
            auto = frozenset(AXES) - self.manual
            flat = _flat_specs(self.specs[grad_kind])
            auto_specs = {
                k: only_axes(PartitionSpec(*s[1:]) if k.startswith("layers/") else s, auto)
                for k, s in flat.items()
            }
        self.grads = Gradients(
            self.zero,
            self.manual,
            self.names,
            cfg.parallel.grad_reduce_dtype,
            auto_specs,
            cfg.train.grad_accum,
        )

    def _specs(self, kind, drop=None):
        specs = jax.tree.map(lambda n: self.rules.spec(n, kind), self.names, is_leaf=_is_names)
        if drop:
            specs = jax.tree.map(
                lambda s: PartitionSpec(*(None if e == drop else e for e in s)),
                specs,
                is_leaf=lambda x: isinstance(x, PartitionSpec),
            )
        return specs

    def manual_specs(self, specs):
        return jax.tree.map(
            lambda s: only_axes(s, self.manual),
            specs,
            is_leaf=lambda x: isinstance(x, PartitionSpec),
        )

    def shard_map(self, fn, in_specs, out_specs):
        """fn per device over the manual axes, with JAX's varying-axes check on."""
        if not self.manual:
            return fn
        return jax.shard_map(
            fn,
            mesh=self.mesh,
            in_specs=self.manual_specs(in_specs),
            out_specs=self.manual_specs(out_specs),
            axis_names=self.axis_names,
            check_vma=True,
        )

    def psum(self, x):
        axes = tuple(a for a in DATA_AXES if a in self.manual)
        return jax.lax.psum(x, axes) if axes else x

    # ---------------------------------------------------------------- compute copy

    def compute_copy(self, params):
        """The compute-dtype weights the forward reads, from the master weights.

        Cast first, so every weight all-gather moves the compute dtype. explicit: the
        ZeRO-1/2 gather is written out here (once a step); ZeRO-3 gathers the layers
        inside the layer scan (`gather_layer`) and the rest here. gspmd: a sharding
        constraint asks the partitioner for the compute layout."""
        dtype = jnp.dtype(self.cfg.model.dtype)
        cast = jax.tree.map(lambda p: p.astype(dtype), params)
        if self.gspmd:
            sh = jax.tree.map(
                lambda s: NamedSharding(self.mesh, s),
                self.specs["compute"],
                is_leaf=lambda x: isinstance(x, PartitionSpec),
            )
            # the barrier keeps the cast on the shards: without it the partitioner
            # gathers the fp32 masters and casts after (twice the bytes)
            return jax.lax.with_sharding_constraint(jax.lax.optimization_barrier(cast), sh)
        if not self.zero.active:
            return cast
        out = {}
        for k, w in cast.items():
            if k == "layers" and self.zero.shards_params:
                out[k] = w
            else:
                out[k] = jax.tree.map(self.zero.gather, w, self.names[k], is_leaf=_is_names)
        return out

    def gather_layer(self):
        """ZeRO-3: one layer's whole weights inside the layer scan, or None."""
        if not self.zero.shards_params or not self.zero.active:
            return None
        layer_names = {k: n[1:] for k, n in self.names["layers"].items()}
        if self.gspmd:
            specs = {k: PartitionSpec(*s[1:]) for k, s in self.gathered["layers"].items()}

            def gather(w, k):
                w = jax.lax.with_sharding_constraint(w, specs[k])
                return jax.ad_checkpoint.checkpoint_name(w, "weights")

            return gather

        def gather(w, k):
            return jax.ad_checkpoint.checkpoint_name(self.zero.gather(w, layer_names[k]), "weights")

        return gather


def _flat_specs(specs: dict) -> dict:
    out = {}
    for k, v in specs.items():
        if isinstance(v, dict):
            out.update({f"{k}/{kk}": vv for kk, vv in v.items()})
        else:
            out[k] = v
    return out


def make_train_step(cfg: Config, tx, schedule, mesh=None, rules: Rules | None = None):
    """Build train_step(state, batch) -> (state, metrics). Jit it with `jit_train_step`."""
    if mesh is None:  # one device, every mesh size 1
        mesh, rules = make_mesh(cfg, jax.devices()[:1]), mesh_rules(cfg)
    plan = Plan(cfg, mesh, rules)
    grads_plan, gather = plan.grads, plan.gather_layer()

    def per_device(params, cparams, batch: Batch):
        if cparams is None:  # explicit: the compute copy is made per device
            cparams = plan.compute_copy(params)
        n_targets = plan.psum(batch.loss_mask.sum())
        scale = 1.0 / jnp.maximum(n_targets, 1).astype(jnp.float32)

        def micro(acc, mb, last):
            sinks = grads_plan.sinks(params, cparams, last)
            inside = acc if grads_plan.adds_inside(last) else None

            def loss_fn(wrt):
                w, prepare = grads_plan.attach(cparams, wrt, inside, last, gather)
                total, _ = loss_sum(
                    cfg, w, mb, tp=plan.layout, prepare=prepare, gathers=gather is not None
                )
                return total * scale, total * scale

            g, part = jax.grad(loss_fn, has_aux=True)(grads_plan.wrt(sinks, cparams))
            held = None if inside is None else inside["embed"]
            g["embed"] = grads_plan.finish_embedding(g["embed"], held, sinks["embed"], last)
            if inside is None:
                g = jax.tree.map(jnp.add, acc, g)
            return g, part

        acc0 = grads_plan.sinks(params, cparams, last=not grads_plan.splits_last)
        grads, loss = grads_plan.accumulate(micro, acc0, batch)
        return grads, plan.psum(loss), n_targets

    grad_kind = "stored" if plan.zero.shards_state else "compute"
    batch_spec = Batch(*(PartitionSpec(None, DATA_AXES, None) for _ in Batch._fields))
    explicit = not plan.gspmd
    sharded = plan.shard_map(
        per_device if not explicit else (lambda p, b: per_device(p, None, b)),
        in_specs=(plan.specs["stored"], plan.specs["compute"], batch_spec)
        if not explicit
        else (plan.specs["stored"], batch_spec),
        out_specs=(plan.specs[grad_kind], PartitionSpec(), PartitionSpec()),
    )

    def train_step(state, batch):
        params = state["params"]
        if explicit:
            grads, loss, n_targets = sharded(params, batch)
        else:
            grads, loss, n_targets = sharded(params, plan.compute_copy(params), batch)
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


def make_eval_step(cfg: Config, mesh=None, rules: Rules | None = None):
    """eval_step(params, batch) -> (sum of NLL, count) over all micro-batches."""
    if mesh is None:
        mesh, rules = make_mesh(cfg, jax.devices()[:1]), mesh_rules(cfg)
    plan = Plan(cfg, mesh, rules, grads=False)
    gather = plan.gather_layer()

    def per_device(params, batch: Batch):
        cparams = plan.compute_copy(params)
        prepare = None
        if gather is not None:
            prepare = lambda p: {k: gather(w, k) for k, w in p.items()}  # noqa: E731

        def micro(carry, mb):
            s, _ = loss_sum(
                cfg, cparams, mb, tp=plan.layout, prepare=prepare, gathers=gather is not None
            )
            return carry + s, None

        zero = vary(jnp.zeros((), jnp.float32), tuple(sorted(vma(batch.inputs))))
        total, _ = jax.lax.scan(micro, zero, batch)
        return plan.psum(total), plan.psum(batch.loss_mask.sum())

    batch_spec = Batch(*(PartitionSpec(None, DATA_AXES, None) for _ in Batch._fields))
    return plan.shard_map(
        per_device,
        in_specs=(plan.specs["stored"], batch_spec),
        out_specs=(PartitionSpec(), PartitionSpec()),
    )


def jit_train_step(cfg: Config, mesh, rules: Rules, tx, schedule, shardings: dict, batch_sh):
    """The jitted step with donated state: what train.py runs and analyze.py compiles."""
    step = make_train_step(cfg, tx, schedule, mesh, rules)
    return jax.jit(
        step,
        in_shardings=(shardings, batch_sh),
        out_shardings=(shardings, None),
        donate_argnums=0,
    )


__all__ = [
    "batch_sharding",
    "init_state",
    "jit_train_step",
    "make_eval_step",
    "make_train_step",
    "state_shardings",
]
