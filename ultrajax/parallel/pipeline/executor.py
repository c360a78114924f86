"""Pipeline parallelism over `mesh.pipeline`: one executor for any schedule table.

The layer stack is cut into S = v·p virtual stages along `layers`; device d holds the
stages d, d + p, ... (its v chunks). A schedule (parallel/pipeline/schedules.py) says what every
device does at every tick: a forward, a backward (or zero-bubble's input and weight
halves) of one micro-batch on one chunk, or nothing. The executor is one `lax.scan`
over the ticks inside the step's `shard_map`; at each tick every device reads its own
row of the plan and runs its op (each buffer is updated under its own `lax.cond`, see
buffers.when), then one `ppermute` moves activations down the ring and one moves
gradients up. It is a single SPMD program: no per-device programs, no host loop.

Between a forward and its backward the residuals `jax.vjp` would keep (the activations;
`model.remat` decides which) wait in buffers of fixed size, whose slots plan.py
assigns on the host from the table; so does every arriving activation and gradient.
The backward never recomputes the forward unless `model.remat` asks for it.

The first stage also embeds, the last also runs the final norm, the LM head and the
loss (its forward tick makes the loss gradient, its backward tick reads it back). Every
device computes with the whole embedding, final norm and LM head (gathered over
`pipeline` once a step where the state keeps the embedding and head split over it along
the vocabulary, mesh.vocab_over_pipeline); their gradients are reduced over `pipeline`
at the end (reduce-scattered back into the state's split, or summed), which is where a
tied embedding's two halves (lookup on the first stage, head on the last) meet.
All weight gradients stay unreduced over the data axes until the last micro-batch is
done, then each is reduced once (parallel.zero's reduce-scatter where it shards them).

The pieces, each in its own module: plan.py (the table as rows and slots), device.py
(what a device reads each tick), stage.py (its chunks run forwards and backwards),
buffers.py (slots and the conditionals that update them), tick.py (the scan's body).
This file puts them in order, reduces the gradients once and moves the layers between
the model's order and the stages'.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ultrajax.config.schema import Config
from ultrajax.kernels.varying import vma
from ultrajax.model.ops import Reduce, finish
from ultrajax.parallel.mesh import entry_axes
from ultrajax.parallel.pipeline.device import AXIS, Device
from ultrajax.parallel.pipeline.plan import TickPlan
from ultrajax.parallel.pipeline.stage import Stage
from ultrajax.parallel.pipeline.tick import ForwardTick, Tick, gradients, initial_state

__all__ = ["AXIS", "evaluate", "reduce", "run", "to_model", "to_stages"]


def _ticks(plan: TickPlan):
    """The scan's inputs: per tick, every device's row of the plan and who sends."""
    return jnp.asarray(plan.rows), jnp.asarray(plan.sends)


def run(plan: TickPlan, cfg: Config, layout, cparams: dict, batch, scale):
    """Per device, inside the step's shard_map: (unreduced fp32 gradients of `cparams`'
    shape, varying over the data axes and `pipeline`; this device's share of the loss).

    `cparams` is this device's compute copy: its `layers` hold the v chunks of this
    device in `layer_order`."""
    dev = Device.make(cfg, layout, cparams, batch, plan.v)
    stage = Stage.make(cfg, layout, dev, plan.kind, scale)
    state = initial_state(stage, plan.slots)
    tick = Tick.make(stage, plan, template=state)
    state, _ = jax.lax.scan(tick, state, _ticks(plan))
    return gradients(stage, state), state["loss"], _model_order(state["stats"], plan.p)


def evaluate(plan: TickPlan, cfg: Config, layout, cparams: dict, batch):
    """Per device: this device's share of the summed NLL of every micro-batch, the
    stages run forwards only (`plan` is FORWARD_ONLY's): each device holds its own
    layers and the activations in flight, never the whole model."""
    dev = Device.make(cfg, layout, cparams, batch, plan.v)
    tick = ForwardTick.make(dev, plan.p, layout.ep)
    init = (dev.stream.zeros((plan.slots["act"] + 1,)), tick.zero_loss)
    (_, total), _ = jax.lax.scan(tick, init, _ticks(plan))
    return total


def _model_order(stats: dict, p: int) -> dict:
    """Every device's MoE statistics (v, layers per chunk, ...) -> every layer's, in the
    model's order, on every device: chunk j of device s is virtual stage j·p + s."""

    me = jax.lax.axis_index(AXIS)

    def one(a):  # a psum of each device's rows in place: the same on every device
        every = jnp.zeros((p, *a.shape), a.dtype).at[me].set(a)
        every = jnp.swapaxes(jax.lax.psum(every, AXIS), 0, 1)  # (v, p, n, ...): stage order
        return every.reshape(-1, *every.shape[3:])

    return jax.tree.map(one, stats)


def reduce(cfg: Config, layout, grads: dict, params: dict) -> dict:
    """Each accumulated gradient reduced once: over the data axes (ZeRO >= 1: scattered
    into this rank's shard of `params`), and the weights every stage computes with over
    `pipeline`: reduce-scattered along `vocab` where the state keeps them split over it
    (mesh.vocab_over_pipeline: the gradient takes the state's layout), else summed (the
    final norm)."""
    dtype = cfg.parallel.grad_reduce_dtype
    out = {}
    for k, g in grads.items():
        names, stored = layout.names[k], layout.specs["stored"][k]
        if k == "layers":
            out[k] = {
                kk: _finish(layout, gg, params[k][kk], names[kk], stored[kk], dtype)
                for kk, gg in g.items()
            }
        else:
            out[k] = _finish(layout, g, params[k], names, stored, dtype)
    return out


def _finish(layout, g, param, names, stored, dtype):
    scatter = layout.zero.scatter(names, last=True) if layout.zero.shards_state else None
    if scatter is not None and scatter[0] not in layout.manual:
        scatter = None
    split = _pipeline_dim(names, stored)
    if split is not None:  # the state's layout: this stage's share of the vocabulary
        rdt = jnp.dtype(dtype)
        g = jax.lax.psum_scatter(g.astype(rdt), AXIS, scatter_dimension=split, tiled=True)
        g = g.astype(jnp.float32)
    return finish(g, None, Reduce(dtype, scatter, varying=vma(param), shape=param.shape))


def _pipeline_dim(names, stored) -> int | None:
    """The dimension a stage-shared weight is stored split over `pipeline` along (the
    vocabulary), or None (the layers are a stage's own; the final norm is replicated)."""
    for d, (n, e) in enumerate(zip(names, stored, strict=True)):
        if n != "layers" and AXIS in entry_axes(e):
            return d
    return None


def _moves(p: int, v: int, back: bool = False):
    """The point-to-point copies that turn each device's contiguous layers (model order:
    device s holds chunks s·v .. s·v + v - 1) into its interleaved chunks (device t holds
    chunks t, t + p, ...), or `back`. Per (target slot, source slot): one ppermute whose
    pairs are distinct sources and targets."""
    moves = []
    for b in range(v):  # slot b of device t holds chunk b·p + t (stage order)
        for a in range(v):  # slot a of device s holds chunk s·v + a (model order)
            chunks = [c for c in range(b * p, (b + 1) * p) if c % v == a]
            pairs = [(c // v, c % p) for c in chunks]  # model -> stage
            if back:
                moves.append((a, b, [(t, s) for s, t in pairs]))
            elif pairs:
                moves.append((b, a, pairs))
    return moves


def _reorder(stack, p: int, v: int, back: bool):
    if v == 1:
        return stack

    def one(w):
        local = w.reshape(v, w.shape[0] // v, *w.shape[1:])
        out = [jnp.zeros_like(local[0]) for _ in range(v)]
        for dst, src, pairs in _moves(p, v, back):
            out[dst] = out[dst] + jax.lax.ppermute(local[src], AXIS, pairs)
        return jnp.concatenate(out, axis=0)

    return jax.tree.map(one, stack)


def to_stages(stack, p: int, v: int):
    """Per device: this device's layers (a contiguous slice of the model's order, as the
    train state and checkpoints keep them, so a checkpoint moves between pipeline layouts
    unchanged) -> its chunks in `layer_order` (interleaved: chunks d, d + p, ...).

    Point-to-point copies over `pipeline`, once a step: each device sends and receives one
    stage's weights; nobody gathers the stack. The identity unless v > 1."""
    return _reorder(stack, p, v, back=False)


def to_model(stack, p: int, v: int):
    """The inverse of `to_stages` (the layer gradients go home before the optimizer)."""
    return _reorder(stack, p, v, back=True)
