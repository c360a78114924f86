"""One tick of the schedule on one device: the body of the `lax.scan` over the plan's
rows, for training (`Tick`) and for evaluation (`ForwardTick`), and the carry the
training loop starts from.

At every tick a device reads its row of the plan and runs its op: a forward (the
first stage embeds first; the last runs the head and the loss, whose gradient waits for
its own backward), a backward (or zero bubble's input and weight halves), the first
stage's embedding backward, or nothing. Each buffer is updated under its own `when`
(parallel/pipeline/buffers.py), then one ppermute moves activations down the ring and
one moves gradients up.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from ultrajax.kernels.varying import like, vary, vma, zeros
from ultrajax.model import units
from ultrajax.model.loss import head_nll
from ultrajax.model.stack import final_norm, head_params, layers
from ultrajax.parallel.grads import LAYER_FP8
from ultrajax.parallel.pipeline.buffers import add, buffer, read, when, write
from ultrajax.parallel.pipeline.device import AXIS, Device, forwards, ring, send
from ultrajax.parallel.pipeline.plan import (
    BWD,
    BWD_FIRST,
    BWD_IN,
    BWD_IN_FIRST,
    BWD_W,
    FWD_LAST,
    TickPlan,
)
from ultrajax.parallel.pipeline.stage import Stage


def initial_state(stage: Stage, slots: dict) -> dict:
    """The carry before the first tick: the arriving activations and gradients at their
    planned number of slots plus one (the sink for "nothing arrives": a tick writes what
    the ring delivers whether or not anything came), the residuals and zero bubble's
    pairs at their planned number exactly (written and read only under the conditional
    of a tick that uses them, always at a real slot), the gradient accumulators and the
    loss zero."""
    dev, sinks, n_per = stage.dev, stage.sinks, stage.n_per
    stored = stage.split.stored
    res_axes = [vma(s) | {AXIS} for s in stored]
    v = dev.n_chunks
    return {
        "res": [
            buffer(s, ax, (slots["res"], n_per)) for s, ax in zip(stored, res_axes, strict=True)
        ],
        "act": dev.stream.zeros((slots["act"] + 1,)),
        "grad": dev.stream.zeros((slots["grad"] + 1,)),
        "cot": _pair_buffers(stage, slots["cot"])
        if stage.splits_backward
        else dev.stream.zeros((1,)),
        "layers": jax.tree.map(
            lambda s: zeros((v, n_per, *s.shape), s.dtype, vma(s)), sinks.layers
        ),
        "head": sinks.head,  # a tied embedding's lookup adds into head["embed"] as well
        "embed": None if dev.cfg.model.tie_embeddings else sinks.embed,
        "loss": zeros((), jnp.float32, sinks.axes),
        # an MoE layer's statistics, summed over micro-batches: per chunk, per layer
        "stats": jax.tree.map(lambda s: buffer(s, vma(s) | {AXIS}, (v, n_per)), stage.split.aux),
    }


def _pair_buffers(stage: Stage, n_slots: int) -> dict:
    """Zero bubble: each layer's (input, cotangent) pairs, kept from the input step to W
    (an input several weights read is kept once, with the first of them; a grouped
    matmul's pair has its group sizes as well, delayed FP8's the history's amaxes, a
    weight no matmul reads has none), and delayed FP8's recorded amaxes, which W adds
    (keeping the larger) where it adds the gradients."""
    out = {
        k: tuple(
            None
            if (n == 0 and stage.shares[k] != k)
            else buffer(a, ax | {AXIS}, (n_slots, stage.n_per))
            for n, (a, ax) in enumerate(dk.seen[1:] if dk.seen else ())
        )
        for k, dk in stage.layer.deferred.items()
    }
    if LAYER_FP8 in stage.sinks.layers:
        out[LAYER_FP8] = jax.tree.map(
            lambda s: buffer(s, vma(s) | {AXIS}, (n_slots, stage.n_per)),
            stage.sinks.layers[LAYER_FP8],
        )
    return out


def gradients(stage: Stage, state: dict) -> dict:
    """The accumulated (unreduced) gradients from the final carry, in `cparams`' shape."""
    m = stage.dev.cfg.model
    grads = {k: state["head"][k] for k in head_params(m)}
    if not m.tie_embeddings:
        grads["embed"] = state["embed"]
    layers = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), state["layers"])
    grads["layers"] = units.merge(m, layers)  # units (model/units.py) back to layers
    return grads


@dataclass(frozen=True, eq=False)
class Tick:
    """One training tick on one device, the scan's body: the op of this device's row,
    each buffer updated under its own `when`, then the sends down and up the ring."""

    stage: Stage
    template: dict  # the initial carry: every tick's carry keeps its types
    junk_grad: int  # the grad buffer's extra slot: a stage's dy goes there unless it is last
    down: list  # ppermute pairs: activations to the next stage
    up: list  # gradients to the stage before

    @classmethod
    def make(cls, stage: Stage, plan: TickPlan, template: dict) -> Tick:
        return cls(stage, template, plan.slots["grad"], ring(plan.p, 1), ring(plan.p, -1))

    def __call__(self, st: dict, xs):
        """(carry, (this tick's rows of the plan, whether anyone sends)) -> (carry, None)."""
        stage, dev = self.stage, self.stage.dev
        rows, sends = xs
        r = dev.row(rows)
        b = r["branch"]
        st = dict(st)
        st["res"], y, stats = when(forwards(b), self.forward, st["res"], st["act"], r)
        if stats:  # zeros where this tick runs no forward
            st["stats"] = add(st["stats"], r["chunk"], stats)
        st["head"], dy, loss = when(b == FWD_LAST, self.head, st["head"], y, r)
        st["loss"] = st["loss"] + vary(loss, stage.sinks.axes)
        st["grad"] = write(st["grad"], jnp.where(b == FWD_LAST, r["grad"], self.junk_grad), dy)
        # a buffer is written before it is read within a tick: the other order makes XLA
        # copy it whole (its read in one conditional outlives the update in the next)
        dx_in = 0
        if stage.splits_backward:
            is_bi = (b == BWD_IN) | (b == BWD_IN_FIRST)
            st["cot"], dx_in = when(is_bi, self.backward_input, st["cot"], st["res"], st["grad"], r)
        both = (b == BWD) | (b == BWD_FIRST) | (b == BWD_W)
        st["layers"], dx = when(
            both, self.backward_weights, st["layers"], st["res"], st["grad"], st["cot"], r
        )
        dx = dx + dx_in
        first = (b == BWD_FIRST) | (b == BWD_IN_FIRST)
        if dev.cfg.model.tie_embeddings:  # one accumulator for the lookup and the LM head
            (st["head"],) = when(first, self.tied_embed_backward, st["head"], dx, r)
        else:
            (st["embed"],) = when(first, self.embed_backward, st["embed"], dx, r)
        y = send(sends[0], y, self.down)
        dx = send(sends[1], dx, self.up)
        st["act"] = write(st["act"], r["act_in"], y)
        st["grad"] = write(st["grad"], r["grad_in"], dx)
        return like(st, self.template), None

    def forward(self, res_buf, act_buf, r):
        """FORWARD: chunk j on its input; the residuals into their slot, y to send on."""
        dev = self.stage.dev
        mb, seg = dev.micro(r["micro"])
        x = dev.stage_input(r["branch"], act_buf, r["act"], mb)
        y, (res, stats) = self.stage.forward(r["chunk"], x, mb, seg)
        return write(res_buf, r["res"], res), y, stats

    def head(self, acc, y, r):
        """The last stage's FORWARD goes on into the loss: the head's gradients are
        accumulated, y's waits in the grad buffer for this stage's own backward."""
        mb, _ = self.stage.dev.micro(r["micro"])
        loss, dhead, dy = self.stage.head(y, mb)
        return jax.tree.map(jnp.add, acc, dhead), self.stage.dev.stream.vary(dy), loss

    def backward_weights(self, gw, res_buf, grad_buf, cot_buf, r):
        """BACKWARD (both halves) or zero bubble's W: the layer gradients, added into
        chunk j's."""
        stage, j = self.stage, r["chunk"]
        if stage.splits_backward:  # W: from the pairs the input step kept
            ds, dx = stage.weight_step(read(cot_buf, r["cot"])), stage.dev.stream.zeros()
        else:
            mb, seg = stage.dev.micro(r["micro"])
            res, g = read(res_buf, r["res"]), read(grad_buf, r["grad"])
            dx, ds = stage.backward(j, res, g, mb, seg)
        # gradients add up over the micro-batches; delayed FP8's amaxes keep the largest
        return {k: add(gw[k], j, ds[k], most=k == LAYER_FP8) for k in gw}, dx

    def backward_input(self, cot_buf, res_buf, grad_buf, r):
        """Zero bubble's input step: the gradient to send, and every layer's pairs for W."""
        stage = self.stage
        mb, seg = stage.dev.micro(r["micro"])
        res = read(res_buf, r["res"])
        dx, pairs = stage.backward(r["chunk"], res, read(grad_buf, r["grad"]), mb, seg)
        return write(cot_buf, r["cot"], pairs), dx

    def embed_backward(self, acc, dx, r):
        """The first stage's backward goes on into the embedding's gradient."""
        mb, _ = self.stage.dev.micro(r["micro"])
        return (acc + self.stage.embed_gradient(dx, mb),)

    def tied_embed_backward(self, head, dx, r):
        """`embed_backward` into the head's accumulator, which a tied embedding shares."""
        return ({**head, "embed": self.embed_backward(head["embed"], dx, r)[0]},)


def _nll(dev: Device, y, micro):
    """The last stage's summed NLL of micro-batch `micro` (varying over `pipeline`)."""
    mb, _ = dev.micro(micro)
    xn = final_norm(dev.cfg.model, dev.cparams, y, tp=dev.tp)
    return vary(head_nll(dev.cfg, dev.cparams, xn, mb.targets, mb.loss_mask, dev.tp), (AXIS,))


@dataclass(frozen=True, eq=False)
class ForwardTick:
    """One evaluation tick on one device: forwards only, nothing kept for a backward;
    the last stage adds its micro-batch's summed NLL to the carry's total."""

    dev: Device
    down: list  # ppermute pairs: activations to the next stage
    zero_loss: jax.Array  # typed like every tick's NLL: both branches must agree
    ep: object  # layout.ep: an MoE layer's reach (its statistics are not kept here)

    @classmethod
    def make(cls, dev: Device, p: int, ep) -> ForwardTick:
        nll = jax.eval_shape(lambda y: _nll(dev, y, 0), dev.stream.zeros())
        zero_loss = vary(jnp.zeros((), jnp.float32), tuple(sorted(vma(nll) | {AXIS})))
        return cls(dev, ring(p, 1), zero_loss, ep)

    def __call__(self, carry, xs):
        """((activation buffer, total), (rows, whether anyone sends)) -> (carry, None)."""
        dev = self.dev
        act_buf, total = carry
        rows, sends = xs
        r = dev.row(rows)
        b = r["branch"]
        y = jax.lax.cond(
            forwards(b),
            lambda: self.forward(act_buf, r),
            lambda: dev.stream.residual(dev.stream.zeros()),  # idle: nothing to send
        )
        part = jax.lax.cond(b == FWD_LAST, lambda: _nll(dev, y, r["micro"]), lambda: self.zero_loss)
        y = send(sends[0], y, self.down)
        act_buf = jax.lax.dynamic_update_index_in_dim(act_buf, y, r["act_in"], 0)
        return (act_buf, total + vary(part, tuple(sorted(vma(self.zero_loss))))), None

    def forward(self, act_buf, r):
        """FORWARD: chunk j on its input, all its layers in one pass (no residuals)."""
        dev = self.dev
        mb, seg = dev.micro(r["micro"])
        x = dev.stage_input(r["branch"], act_buf, r["act"], mb)
        chunk = jax.tree.map(
            lambda a: jax.lax.dynamic_index_in_dim(a, r["chunk"], 0, False), dev.chunks
        )
        x, _ = layers(dev.cfg.model, chunk, x, mb.positions, seg, tp=dev.tp, ep=self.ep)
        return dev.stream.residual(x)
