"""One device's v chunks as functions of a micro-batch: the forward that keeps
`jax.vjp`'s residuals (parallel/pipeline/residuals.py), the backward that reads them
back, zero bubble's weight step, and the first and last stages' extra work (the
embedding's backward, the head's loss).

Built once per step, before the tick loop: the gradient sinks, the layer as the
backward differentiates it, and one abstract trace of it that fixes the residuals'
types (so their buffers can be made) and, under zero bubble, which weights share an
input.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from ultrajax.config.schema import Config, ModelConfig
from ultrajax.kernels.varying import vma, zeros
from ultrajax.model import units
from ultrajax.model.llama import block_stats
from ultrajax.model.loss import head_nll
from ultrajax.model.ops import Deferred, Reduce, Weight
from ultrajax.model.remat import layers_per_iteration, remat_policy
from ultrajax.model.stack import embed, final_norm, head_params
from ultrajax.parallel.axes import PIPELINE, TOKEN_AXES
from ultrajax.parallel.grads import LAYER_FP8
from ultrajax.parallel.pipeline import residuals, schedules
from ultrajax.parallel.pipeline.device import Device

AXIS = PIPELINE


def weights(values: dict, sinks: dict, red: Reduce) -> dict:
    """Each weight with its sink: differentiating by the sinks gives the gradients. Under
    model.fp8=delayed a layer's values and sinks hold, at LAYER_FP8, each FP8 weight's
    history amaxes and the sink its recorded amaxes leave through (parallel/grads.py)."""
    seen = values.get(LAYER_FP8, {})

    def fp8(k):
        return (seen[k], sinks[LAYER_FP8][k]) if k in seen else None

    return {k: Weight.make(values[k], sinks[k], None, red, fp8(k)) for k in sinks if k != LAYER_FP8}


@dataclass(frozen=True, eq=False)
class Sinks:
    """fp32 zeros typed like each gradient before any data reduction (varying over the
    token axes and `pipeline`): what the backward differentiates at, and the types of
    the gradient accumulators."""

    axes: tuple[str, ...]
    layers: dict  # one layer's weights
    head: dict  # stack.head_params
    embed: jax.Array

    @classmethod
    def make(cls, m: ModelConfig, layout, cparams: dict, per_layer: dict) -> Sinks:
        axes = (*(a for a in TOKEN_AXES if a in layout.manual), AXIS)

        def sink(w):
            return zeros(w.shape, jnp.float32, vma(w) | set(axes))

        layers = jax.tree.map(sink, per_layer)
        if LAYER_FP8 in per_layer:  # delayed's amaxes: one per device until the step's pmax
            every = set(layout.manual)
            layers[LAYER_FP8] = jax.tree.map(
                lambda a: zeros(a.shape, jnp.float32, every), per_layer[LAYER_FP8]
            )
        head = {k: sink(cparams[k]) for k in head_params(m)}
        return cls(axes, layers, head, sink(cparams["embed"]))


@dataclass(frozen=True, eq=False)
class Layer:
    """One block as the pipeline differentiates it: (given, diff, x) -> x, given being
    (weights, positions, segment ids) and diff what it is differentiated at.

    Zero bubble: the layer's weights hand out (input, cotangent) pairs in the input step
    (diff: zeros shaped like them) and the weight step computes their gradients from
    those alone (model.ops.Deferred); the other schedules differentiate the layer with
    respect to its sinks."""

    m: ModelConfig
    tp: object  # layout.tp
    ep: object  # layout.ep
    red: Reduce
    sinks: dict  # Sinks.layers
    deferred: dict | None  # zero bubble: per weight, its Deferred
    policy: object = None  # remat, per layer of a unit (model/units.py; else on the whole)

    def __call__(self, given, diff, x):
        """(the block's output, its MoE statistics: {} for a dense layer). Interleaved
        dense and MoE layers: a unit of them (model/units.py), each layer in turn."""
        w, pos, seg = given
        m = self.m

        def layer(ws, x):
            return block_stats(ws, x, pos, seg, cfg=m, tp=self.tp, ep=self.ep)

        if units.size(m) == 1:
            return layer(self.weights(w, diff), x)

        def pick(wd, j):
            return units.layers(m, wd[0])[j], units.layers(m, wd[1])[j]

        # each layer of the unit under its own checkpoint (Stage.make), its slices inside
        fns = units.checkpointed(m, lambda wd, x: layer(self.weights(*wd), x), self.policy, pick)
        return units.run(fns, (w, diff), x)

    def weights(self, w: dict, diff: dict) -> dict:
        """The layer's weights as the block reads them, each with its sink (and pair)."""
        if self.deferred is None:
            return weights(w, diff, self.red)
        seen = w.get(LAYER_FP8, {})  # delayed FP8: the amaxes' sinks stay differentiated
        return {
            k: Weight.make(
                w[k],
                self.sinks[k],
                diff[k],
                Reduce(self.red.dtype, defer=self.deferred[k]),
                (seen[k], diff[LAYER_FP8][k]) if k in seen else None,
            )
            for k in self.deferred
        }

    def diff(self) -> dict:
        """What the layer is differentiated at (zero bubble: fresh pair zeros, and delayed
        FP8's amax sinks)."""
        if self.deferred is None:
            return self.sinks
        out = {k: self.deferred[k].zeros() for k in self.deferred}
        if LAYER_FP8 in self.sinks:
            out[LAYER_FP8] = self.sinks[LAYER_FP8]
        return out


def _keep_input(pair: tuple, own: bool) -> tuple:
    """A weight's pair as kept for W: its input only if it is the first reader (`own`);
    the rest (the cotangent, a grouped matmul's sizes) always; () for a weight without one."""
    return (pair[0] if own else None, *pair[1:]) if pair else pair


def _shares(deferred: dict | None) -> dict:
    """Weights that read the same input (wq, wk, wv; w_gate, w_up) keep it once, with the
    first of them: W reads it from there."""
    if deferred is None:
        return {}
    first_reader: dict = {}
    return {k: first_reader.setdefault(d.source, k) for k, d in deferred.items()}


@dataclass(frozen=True, eq=False)
class Stage:
    """This device's chunks, run forwards, backwards and (zero bubble) for the weights."""

    dev: Device
    chunks: dict  # the device's chunks as (v, units per chunk, ...): model/units.py
    sinks: Sinks
    layer: Layer
    fn: Callable  # the layer under jax.checkpoint where model.remat asks for it
    split: residuals.Split  # what of the layer's vjp is stored, what handed back
    shares: dict  # zero bubble: weight -> the weight whose kept input it reads
    red: Reduce
    scale: jax.Array  # the loss's factor: one over the step's target count
    n_per: int  # units (layers, unless dense and MoE layers interleave) per chunk
    unroll: int

    @classmethod
    def make(cls, cfg: Config, layout, dev: Device, kind: str, scale) -> Stage:
        """The sinks, the layer, and one abstract trace of it for the residuals' types."""
        m = cfg.model
        red = Reduce(cfg.parallel.grad_reduce_dtype)
        chunks = units.view(m, dev.chunks, axis=1)  # (v, units per chunk, ...)
        per_layer = jax.tree.map(lambda a: a[0, 0], chunks)
        sinks = Sinks.make(m, layout, dev.cparams, per_layer)
        split_backward = schedules.SCHEDULES[kind].splits_backward
        deferred = None
        if split_backward:
            deferred = {k: Deferred() for k in per_layer if k != LAYER_FP8}
        policy = remat_policy(m.remat)
        inner = policy if units.size(m) > 1 else None  # a unit checkpoints each of its layers
        layer = Layer(m, dev.tp, layout.ep, red, sinks.layers, deferred, inner)
        fn = layer
        if policy is not None and inner is None:
            fn = jax.checkpoint(layer, policy=policy, prevent_cse=False)
        mb0, seg0 = dev.micro(0)
        given0, x_probe = (per_layer, mb0.positions, seg0), dev.stream.zeros()
        if split_backward:  # a shape trace records each weight's (input, cotangent) pair
            probe = {k: sinks.layers[k] if k == LAYER_FP8 else None for k in per_layer}
            jax.eval_shape(lambda: layer(given0, probe, x_probe))
        split = residuals.probe(fn, given0, layer.diff(), x_probe)
        n_per = jax.tree.leaves(chunks)[0].shape[1]
        unroll = layers_per_iteration(m.scan_unroll, n_per, recomputes=policy is not None)
        shares = _shares(deferred)
        return cls(dev, chunks, sinks, layer, fn, split, shares, red, scale, n_per, unroll)

    @property
    def splits_backward(self) -> bool:
        return self.layer.deferred is not None

    def chunk(self, j) -> dict:
        """Chunk j's layer weights (a static slice when the device holds one chunk)."""
        chunks = self.chunks
        if self.dev.n_chunks == 1:
            return jax.tree.map(lambda a: a[0], chunks)
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, j, 0, False), chunks)

    def forward(self, j, x, mb, seg):
        """(chunk j's output on x, per layer: (the residuals its backward will read, its
        MoE statistics))."""

        def body(x, w):
            given = (w, mb.positions, seg)
            y, res, stats = residuals.forward(self.split, self.fn, given, self.layer.diff(), x)
            return self.dev.stream.vary(y), (res, stats)

        return jax.lax.scan(body, x, self.chunk(j), unroll=self.unroll)

    def backward(self, j, res, g, mb, seg):
        """(input gradient, per layer: the weight gradients, or zero bubble's pairs)."""
        shares = self.shares

        def body(g, xs):
            w, r = xs
            given = (w, mb.positions, seg)
            out, dx = residuals.backward(self.split, given, self.layer.diff(), r, g)
            if self.splits_backward:  # an input read by several weights is kept once
                out = {
                    k: pair if k == LAYER_FP8 else _keep_input(pair, shares[k] == k)
                    for k, pair in out.items()
                }
            return self.dev.stream.vary(dx), out

        return jax.lax.scan(body, g, (self.chunk(j), res), reverse=True, unroll=self.unroll)

    def weight_step(self, pairs):
        """Zero bubble's W: every layer's weight gradients from the pairs its input step kept."""
        deferred, shares = self.layer.deferred, self.shares
        reduce_ = {
            k: Reduce(self.red.dtype, varying=vma(s), shape=s.shape)
            for k, s in self.sinks.layers.items()
            if k != LAYER_FP8
        }

        def body(_, pair):
            amaxes = pair.get(LAYER_FP8)  # delayed FP8's, from the input step: passed on
            pair = {k: (pair[shares[k]][0], *pair[k][1:]) if pair[k] else pair[k] for k in deferred}
            out = {k: deferred[k].weight_gradient(pair[k], reduce_[k]) for k in pair}
            return None, out if amaxes is None else dict(out, **{LAYER_FP8: amaxes})

        return jax.lax.scan(body, None, pairs, unroll=self.unroll)[1]

    def head(self, y, mb):
        """The last stage's scaled loss of `mb` and its gradients: (loss, the head's
        weight gradients, the gradient of the stream y)."""
        cfg, tp = self.dev.cfg, self.dev.tp

        def loss(sinks, y):
            w = weights(self.dev.cparams, sinks, self.red)
            xn = final_norm(cfg.model, w, y, tp=tp)
            return head_nll(cfg, w, xn, mb.targets, mb.loss_mask, tp) * self.scale

        value, pull = jax.vjp(loss, self.sinks.head, y)
        dhead, dy = pull(jnp.ones_like(value))
        return value, dhead, dy

    def embed_gradient(self, dx, mb):
        """The first stage's input gradient is the embedding's: its lookup, differentiated."""
        m, tp, table = self.dev.cfg.model, self.dev.tp, self.dev.cparams["embed"]

        def lookup(s):
            return embed(m, {"embed": Weight.make(table, s, None, self.red)}, mb.inputs, tp=tp)

        _, pull = jax.vjp(lookup, self.sinks.embed)
        (de,) = pull(dx.astype(self.dev.stream.struct.dtype))
        return de
