"""The training loss of one micro-batch: summed next-token NLL and its target count.

Sums, not means: gradient accumulation divides the sum over every micro-batch by
the total count of target tokens, so micro-batches holding
different numbers of valid tokens weigh each token the same.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ultrajax.config.schema import Config
from ultrajax.kernels.varying import vary, vma, zeros
from ultrajax.model.boundaries import LOCAL, ONE_DEVICE, SINGLE
from ultrajax.model.ops import Weight, dense_dw, finish, transposes
from ultrajax.model.order import zeros_after
from ultrajax.model.stack import LOGITS, embed, final_norm, head_weight, layers, logits


def loss_sum(cfg: Config, params, mb, **kw):
    """(sum of token NLLs, count of target tokens) for one micro-batch (rows, seq_len)."""
    return loss_and_stats(cfg, params, mb, **kw)[:2]


def loss_and_stats(
    cfg: Config, params, mb, *, tp=SINGLE, cp=LOCAL, ep=ONE_DEVICE, prepare=None,
    gathered_over=None,
):  # fmt: skip
    """`loss_sum` and every layer's MoE statistics (model/moe.py; {} for a dense model)."""
    m = cfg.model
    segments = mb.segment_ids if cfg.data.cross_doc_mask else None
    x = embed(m, params, mb.inputs, tp=tp)
    x, stats = layers(m, params["layers"], x, mb.positions, segments, tp=tp, cp=cp, ep=ep,
                      prepare=prepare, gathered_over=gathered_over)  # fmt: skip
    x = final_norm(m, params, x, tp=tp)
    mask = mb.loss_mask
    return head_nll(cfg, params, x, mb.targets, mask, tp), mask.sum(), stats


def head_nll(cfg: Config, params, x, targets, mask, tp):
    """Summed NLL of the LM head over normalised activations x (batch, length, embed).

    With `model.loss_chunk = c` the head and the loss run over c tokens of the sequence at
    a time, so the fp32 logits of only one chunk ever exist. A trained weight (`Weight`)
    gets its gradients in the same pass: each chunk's logit gradient is turned into its
    share of the input's and the weight's gradients at once, so the backward pass only
    scales them and reduces the weight's (nothing recomputed: on an H200 the 1B step's
    chunked loss went from 6.6% slower than whole logits to as fast, benchmarks/RESULTS.md).
    The price is the weight's whole local fp32 gradient from the forward pass on. Plain
    arrays and zero bubble's split weights recompute each chunk's logits in the backward
    pass (`jax.checkpoint`). Same sum, same gradients. Validation resolves the default,
    null (auto), to an int where one micro-batch's fp32 logits are large
    (config/validate.py, auto_loss_chunk); an unvalidated null is 0."""
    c = cfg.model.loss_chunk
    t = x.shape[1]
    if not c or c >= t:
        return jnp.sum(tp.cross_entropy(logits(cfg.model, params, x, tp=tp), targets) * mask)
    w, eq = head_weight(cfg.model, params)
    if isinstance(w, Weight) and w.reduce.defer is None:
        return _chunked(eq, c, tp, w.reduce, x, w.value, w.sink, w.acc, targets, mask)

    @jax.checkpoint
    def chunk(xs, ts, ms):
        return jnp.sum(tp.cross_entropy(logits(cfg.model, params, xs, tp=tp), ts) * ms)

    def body(total, parts):
        return total + chunk(*parts), None

    zero = zeros((), jnp.float32, vma(mask))
    total, _ = jax.lax.scan(body, zero, (_split(x, c), _split(targets, c), _split(mask, c)))
    return total


def _split(a, c):
    """(batch, t, ...) -> (t / c, batch, c, ...): the scan's chunks of the sequence."""
    return jnp.moveaxis(a.reshape(a.shape[0], a.shape[1] // c, c, *a.shape[2:]), 1, 0)


def _chunk_logits(eq, tp, xs, value):
    """One chunk's fp32 logits: the head's matmul as ops.dense computes it."""
    out = jnp.einsum(eq, xs, value.astype(xs.dtype), preferred_element_type=jnp.float32)
    return tp.constrain(out, LOGITS)


def _scan(eq, c, tp, red, x, value, targets, mask, grads: bool):
    """The chunks' NLL sum; with `grads`, also x's gradient and the weight's local
    (unreduced) fp32 gradient, each chunk's computed as ops.dense's backward rule does."""
    eq_dx, _ = transposes(eq)
    f32 = jnp.float32

    def body(carry, parts):
        total, dw = carry
        xs, ts, ms = parts

        lg = _chunk_logits(eq, tp, xs, value)
        if not grads:
            return (total + jnp.sum(tp.cross_entropy(lg, ts) * ms), dw), None
        nll, g = tp.cross_entropy_grad(lg, ts, ms, xs.dtype)
        dxs = jnp.einsum(eq_dx, g, value.astype(xs.dtype)).astype(xs.dtype)
        return (total + nll, dw + dense_dw(eq, xs, g, red).astype(f32)), dxs

    dw = None
    if grads:  # zeros read off x (model/order.py): a constant table XLA would build before
        # the micro-batch loop, with the running sum's zeros, and keep through it (a whole
        # fp32 embedding on the 1B size's DDP/ZeRO-1 steps with accumulation)
        dw = vary(zeros_after(x, value.shape), tuple(sorted(vma(x) | vma(value))))
    parts = (_split(x, c), _split(targets, c), _split(mask, c))
    (total, dw), dxs = jax.lax.scan(body, (zeros((), f32, vma(mask)), dw), parts)
    if not grads:
        return total, None
    return total, (jnp.moveaxis(dxs, 0, 1).reshape(x.shape), dw)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _chunked(eq, c, tp, red, x, value, sink, acc, targets, mask):
    return _scan(eq, c, tp, red, x, value, targets, mask, grads=False)[0]


def _chunked_fwd(eq, c, tp, red, x, value, sink, acc, targets, mask):
    total, (dx, dw) = _scan(eq, c, tp, red, x, value, targets, mask, grads=True)
    return total, (dx, dw, acc)


def _chunked_bwd(eq, c, tp, red, res, g):
    dx, dw, acc = res
    return (dx * g).astype(dx.dtype), None, finish(dw * g, acc, red), None, None, None


_chunked.defvjp(_chunked_fwd, _chunked_bwd)
