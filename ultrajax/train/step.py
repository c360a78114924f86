"""The jitted train step: one program for the train loop and the analyzer.

A step reads a Batch (grad_accum, rows, seq_len), runs every micro-batch's forward
and backward, and applies one optimizer update. The loss is the sum of per-token
losses over every micro-batch divided by the total count of target tokens.

Two ways to place the collectives (`parallel.collectives`, docs/parallelism.md):
- explicit: forward and backward run per device in one `shard_map` over the whole
  mesh; each collective is written where the playbook puts it (ZeRO in
  parallel/zero.py, data reductions in parallel/grads.py and ultrajax/model/ops.py,
  tensor/sequence boundaries in parallel/tensor.py);
- gspmd: the model's logical annotations drive XLA's partitioner (sharding
  constraints, parallel/partitioned.py). Only the reductions that gradient
  accumulation defers (ZeRO-0/1) run in a `shard_map` manual over the data axes.
Which one, and everything else about the layout, is decided once in parallel/layout.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from ultrajax.config.schema import Config
from ultrajax.kernels.varying import vma, zeros
from ultrajax.model import fp8, moe
from ultrajax.model.llama import fp8_history, init_params, logical_axes
from ultrajax.model.loss import loss_and_stats, loss_sum
from ultrajax.parallel import diloco
from ultrajax.parallel.axes import DATA
from ultrajax.parallel.grads import FP8, LAYER_FP8
from ultrajax.parallel.layout import Layout, unsupported
from ultrajax.parallel.mesh import Rules, make_mesh, tree_shardings
from ultrajax.parallel.mesh import rules as mesh_rules
from ultrajax.parallel.pipeline import executor as pipeline
from ultrajax.parallel.pipeline import plan as plan_lib
from ultrajax.train import optim
from ultrajax.train.batch import Batch
from ultrajax.train.batch import sharding as batch_sharding
from ultrajax.train.batch import specs as batch_specs


def init_state(cfg: Config, tx: optax.GradientTransformation, key) -> dict:
    """{step, params, opt_state} and, with model.fp8=delayed, "fp8": each FP8 weight's
    amax history (model/fp8.py), which the step rolls and the optimizer never sees."""
    params = init_params(cfg.model, key)
    opt = diloco.init(cfg, tx, params) if diloco.active(cfg) else tx.init(params)
    state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": opt}
    history = _empty_history(cfg)
    return dict(state, **{FP8: history}) if history else state


def _empty_history(cfg: Config) -> dict:
    """model.fp8=delayed's histories before any step ({} otherwise); DiLoCo: per replica."""
    history = fp8_history(cfg.model)
    return diloco.own(cfg, history) if history and diloco.active(cfg) else history


def state_shardings(cfg: Config, mesh, rules: Rules, tx) -> dict:
    """Where every leaf of the train state lives (ZeRO >= 1 shards it over fsdp; DiLoCo's
    replicas over `data`)."""
    abstract = jax.eval_shape(functools.partial(init_state, cfg, tx), jax.random.key(0))
    params = tree_shardings(mesh, logical_axes(cfg.model), rules, "stored")
    replicated = NamedSharding(mesh, PartitionSpec())

    def place(opt_state, param_shardings, other):
        """Each leaf of the optimizer state as its parameter's; counters as `other`."""
        return optax.tree_map_params(
            tx, lambda _, s: s, opt_state, param_shardings, transform_non_params=lambda _: other
        )

    if diloco.active(cfg):
        opt = diloco.shardings(mesh, params, abstract["opt_state"], place)
    else:
        opt = place(abstract["opt_state"], params, replicated)
    out = {"step": replicated, "params": params, "opt_state": opt}
    if FP8 in abstract:  # a few numbers a layer, on every device (DiLoCo: of a replica)
        own = NamedSharding(mesh, PartitionSpec(DATA)) if diloco.active(cfg) else replicated
        out[FP8] = jax.tree.map(lambda _: own, abstract[FP8])
    return out


def _mesh_rules(cfg: Config, mesh, rules):
    """(mesh, rules), one device's when none is given (every mesh size 1)."""
    if mesh is None:
        return make_mesh(cfg, jax.devices()[:1]), mesh_rules(cfg)
    return mesh, rules


def make_gradients(cfg: Config, mesh=None, rules: Rules | None = None):
    """gradients(params, batch[, seen]) -> (grads, loss, n_targets, stats): the
    mean-per-target gradient of the batch, reduced as the layout says; the train step's
    first half. With model.fp8=delayed, `seen` holds each FP8 weight's amaxes to scale by
    (fp8.seen of the history) and grads["fp8"] this batch's amaxes, max-reduced."""
    layout = Layout(cfg, *_mesh_rules(cfg, mesh, rules))
    grad_plan, gather = layout.grads, layout.gather_layer()

    def per_device(params, cparams, batch: Batch, seen=None):
        n_targets = layout.psum(batch.loss_mask.sum())
        scale = 1.0 / jnp.maximum(n_targets, 1).astype(jnp.float32)

        def micro(acc, mb, last, cparams):  # the micro-batch loop's carried cparams
            def loss_fn(wrt, inside):
                w, prepare = grad_plan.attach(cparams, wrt, inside, last, gather, seen)
                total, _, stats = loss_and_stats(
                    cfg, w, mb, tp=layout.tp, cp=layout.cp, ep=layout.ep, prepare=prepare,
                    gathered_over=layout.gathered_over,
                )  # fmt: skip
                return total * scale, (total * scale, stats)

            sinks = grad_plan.sinks(params, cparams, last)
            return grad_plan.backward(loss_fn, sinks, cparams, acc, last)

        acc0 = grad_plan.sinks(params, cparams, last=not grad_plan.splits_last)
        axes = vma(batch.inputs)
        zero = (zeros((), jnp.float32, axes), moe.zero_stats(cfg.model, axes))
        grads, (loss, stats) = grad_plan.accumulate(micro, acc0, batch, zero, cparams)
        grads, amaxes = grad_plan.amaxes(grads)
        if amaxes is not None:
            grads = dict(grads, **{FP8: amaxes})
        return grads, layout.psum(loss), n_targets, layout.psum(stats)

    if layout.pipeline > 1:
        per_device = _pipelined(cfg, layout)
    # the gradients leave in the state's layout (ZeRO: this rank's shard; a pipeline's
    # embedding and head: this stage's vocabulary split, reduce-scattered there)
    stored = layout.specs["stored"]
    if grad_plan.fp8:  # the amaxes, max-reduced: the same on every device (of a stage)
        stored = dict(stored, **{FP8: _amax_spec(layout)})
    out_specs = (stored, PartitionSpec(), PartitionSpec(), PartitionSpec())
    if diloco.active(cfg):  # each data rank a replica: a leading axis over `data`
        fn = diloco.per_replica(layout, per_device, out_specs, batch_specs())
    else:
        fn = _over_batch(layout, per_device, out_specs)

    def gradients(params, batch, seen=None):
        if seen is None:  # no history (the noise probe): each tensor scaled by its own amax
            seen = jax.tree.map(fp8.seen, _empty_history(cfg)) or None
        return fn(params, batch, seen)

    return gradients


def _amax_spec(layout: Layout) -> PartitionSpec:
    """model.fp8=delayed's amaxes, (layers, x w g) per FP8 weight: each pipeline stage
    has its own layers' (the state keeps them whole, on every device)."""
    return PartitionSpec(pipeline.AXIS) if layout.pipeline > 1 else PartitionSpec()


def _over_batch(layout: Layout, per_device, out_specs):
    """(params, batch) -> per_device(params, compute copy, batch) over the layout's manual
    axes. gspmd: the partitioner lays the compute copy out, outside the shard_map;
    explicit: each device makes its own (the ZeRO gathers written out)."""
    stored, batch_spec, every = layout.specs["stored"], batch_specs(), _amax_spec(layout)
    if not layout.gspmd:
        fn = lambda p, b, s: per_device(p, layout.compute_copy(p), b, s)  # noqa: E731
        sharded = layout.shard_map(fn, (stored, batch_spec, every), out_specs)
        return lambda params, batch, seen=None: sharded(params, batch, seen)
    in_specs = (stored, layout.specs["compute"], batch_spec, every)
    sharded = layout.shard_map(per_device, in_specs, out_specs)
    return lambda params, batch, seen=None: sharded(
        params, layout.compute_copy(params), batch, seen
    )


def make_train_step(cfg: Config, tx, schedule, mesh=None, rules: Rules | None = None):
    """Build train_step(state, batch[, position]) -> (state, metrics). Jit it with
    `jit_train_step`. The learning rate is schedule(position), position the step count
    unless given (in config batches of tokens trained: ultrajax/train/ramp.py)."""
    gradients = make_gradients(cfg, mesh, rules)

    def update(state, batch, lr):
        params, history = state["params"], state.get(FP8)
        seen = None if history is None else jax.tree.map(fp8.seen, history)
        grads, loss, n_targets, stats = gradients(params, batch, seen)
        amaxes = grads.pop(FP8, None)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = tx.update(grads, state["opt_state"], params)
        params = optax.apply_updates(params, optim.scale(updates, lr))
        if stats:  # MoE: the router biases move against the step's load (bias balance)
            layers = params["layers"]
            bias = moe.update_bias(cfg.model, layers["router_bias"], stats["load"])
            params = dict(params, layers=dict(layers, router_bias=bias))
        new = {"step": state["step"] + 1, "params": params, "opt_state": opt_state}
        if history is not None:  # this step's amaxes in front of each history
            new[FP8] = jax.tree.map(fp8.record, history, amaxes)
        return new, loss, grad_norm, n_targets, stats

    if diloco.active(cfg):  # the replicas' inner steps, every H-th the outer one
        layout = Layout(cfg, *_mesh_rules(cfg, mesh, rules))
        f = cfg.parallel.diloco_fragments
        syncs = [diloco.synchronise(cfg, layout, i if f > 1 else None) for i in range(f)]
        syncs += [diloco.synchronise(cfg, layout, None)] * (f > 1)  # all at once: the last step
        update = diloco.make_update(cfg, tx, gradients, syncs, optim.scale, moe.update_bias)

    def train_step(state, batch, position=None):
        lr = schedule(state["step"] if position is None else position)
        new, loss, grad_norm, n_targets, stats = update(state, batch, lr)
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": lr, "n_targets": n_targets}
        if stats:  # the losses as their mean over the micro-batches
            m = jax.tree.leaves(batch)[0].shape[0]
            metrics["moe"] = dict(stats, aux=stats["aux"] / m, z=stats["z"] / m)
            every = cfg.model.moe_every  # each MoE layer's index in the model, for the record
            metrics["moe"]["layer"] = jnp.arange(every - 1, cfg.model.n_layers, every)
        return new, metrics

    return train_step


def jit_grad_norm(cfg: Config, mesh, rules: Rules, shardings: dict, batch_sh):
    """(params, batch) -> (|gradient|, targets) of one batch, nothing updated: the gradient
    noise scale's small-batch measurement (one micro-batch at a time; not with DiLoCo,
    whose steps have a gradient per replica: the config's validation refuses both)."""
    gradients = make_gradients(cfg, mesh, rules)

    def grad_norm(params, batch):
        grads, _, n_targets, _ = gradients(params, batch)
        grads.pop(FP8, None)
        return optax.tree.norm(grads), n_targets

    return jax.jit(grad_norm, in_shardings=(shardings["params"], batch_sh))


def _plan(cfg: Config, layout: Layout, kind: str):
    par = cfg.parallel
    return plan_lib.make_plan(kind, layout.pipeline, cfg.train.grad_accum, par.virtual_stages)


def _stage_copy(cfg: Config, layout: Layout, cparams):
    """This device's compute copy with its layers as its chunks (interleaved: moved from
    its slice of the model's order, in which the state keeps them)."""
    v = cfg.parallel.virtual_stages
    return dict(cparams, layers=pipeline.to_stages(cparams["layers"], layout.pipeline, v))


def _pipelined(cfg: Config, layout: Layout):
    """per_device for mesh.pipeline > 1: the schedule's executor (parallel/pipeline/executor.py),
    then each gradient reduced once and its layers sent home."""
    plan = _plan(cfg, layout, cfg.parallel.pipeline_schedule)

    def per_device(params, cparams, batch: Batch, seen=None):
        if seen is not None:  # delayed: this stage's rows of the amaxes, moved as its layers
            cparams = dict(cparams, layers=dict(cparams["layers"], **{LAYER_FP8: seen}))
        cparams = _stage_copy(cfg, layout, cparams)
        n_targets = layout.psum(batch.loss_mask.sum())
        scale = 1.0 / jnp.maximum(n_targets, 1).astype(jnp.float32)
        grads, loss, stats = pipeline.run(plan, cfg, layout, cparams, batch, scale)
        layers = dict(grads["layers"])
        amaxes = layers.pop(LAYER_FP8, None)
        grads = pipeline.reduce(cfg, layout, dict(grads, layers=layers), params)
        v, p = cfg.parallel.virtual_stages, layout.pipeline
        grads = dict(grads, layers=pipeline.to_model(grads["layers"], p, v))
        if amaxes is not None:  # the largest over the ranks that split this stage's work
            grads, found = layout.grads.amaxes({**grads, FP8: pipeline.to_model(amaxes, p, v)})
            grads[FP8] = found
        return grads, jax.lax.psum(layout.psum(loss), pipeline.AXIS), n_targets, layout.psum(stats)

    return per_device


def _pipelined_eval(cfg: Config, layout: Layout):
    """eval_step for mesh.pipeline > 1: the micro-batches go through the stages forwards
    only (pipeline.evaluate), so no device ever holds another stage's layers."""
    plan = _plan(cfg, layout, plan_lib.FORWARD_ONLY)

    def per_device(params, cparams, batch: Batch, seen=None):
        total = pipeline.evaluate(plan, cfg, layout, _stage_copy(cfg, layout, cparams), batch)
        return jax.lax.psum(layout.psum(total), pipeline.AXIS), layout.psum(batch.loss_mask.sum())

    return _over_batch(layout, per_device, (PartitionSpec(), PartitionSpec()))


def make_eval_step(cfg: Config, mesh=None, rules: Rules | None = None):
    """eval_step(params, batch) -> (sum of NLL, count) over all micro-batches."""
    layout = Layout(cfg, *_mesh_rules(cfg, mesh, rules), grads=False)
    if layout.pipeline > 1:
        return _pipelined_eval(cfg, layout)
    gather = layout.gather_layer()

    def per_device(params, cparams, batch: Batch, seen=None):
        prepare = None
        if gather is not None:
            prepare = lambda p: {k: gather(w, k) for k, w in p.items()}  # noqa: E731

        def micro(carry, mb):
            s, _ = loss_sum(cfg, cparams, mb, tp=layout.tp, cp=layout.cp, ep=layout.ep,
                            prepare=prepare, gathered_over=layout.gathered_over)  # fmt: skip
            return carry + s, None

        zero = zeros((), jnp.float32, vma(batch.inputs))
        total, _ = jax.lax.scan(micro, zero, batch)
        return layout.psum(total), layout.psum(batch.loss_mask.sum())

    return _over_batch(layout, per_device, (PartitionSpec(), PartitionSpec()))


def jit_train_step(
    cfg: Config, mesh, rules: Rules, tx, schedule, shardings: dict, batch_sh, position=False
):
    """The jitted step with donated state: what the train loop runs and the analyzer compiles.
    position=True: it takes the schedule's position as a third argument (train/loop.py)."""
    step = make_train_step(cfg, tx, schedule, mesh, rules)
    in_shardings = (shardings, batch_sh, None) if position else (shardings, batch_sh)
    return jax.jit(
        step, in_shardings=in_shardings, out_shardings=(shardings, None), donate_argnums=0
    )


__all__ = [
    "Layout",
    "batch_sharding",
    "init_state",
    "jit_grad_norm",
    "jit_train_step",
    "make_eval_step",
    "make_gradients",
    "make_train_step",
    "state_shardings",
    "unsupported",
]
