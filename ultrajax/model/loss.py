"""The training loss of one micro-batch: summed next-token NLL and its target count.

Sums, not means: gradient accumulation divides the sum over every micro-batch by
the total count of target tokens, so micro-batches holding
different numbers of valid tokens weigh each token the same.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ultrajax.config.schema import Config
from ultrajax.kernels.varying import vma, zeros
from ultrajax.model.boundaries import LOCAL, ONE_DEVICE, SINGLE
from ultrajax.model.stack import embed, final_norm, layers, logits


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
    a time, under `jax.checkpoint`, so the fp32 logits of only one chunk ever exist (in
    the backward pass too: each chunk's logits are recomputed). Same sum, same gradients.
    Validation resolves the default, null (auto), to an int where one micro-batch's fp32
    logits are large (config/validate.py, auto_loss_chunk); an unvalidated null is 0."""
    c = cfg.model.loss_chunk
    t = x.shape[1]
    if not c or c >= t:
        return jnp.sum(tp.cross_entropy(logits(cfg.model, params, x, tp=tp), targets) * mask)

    @jax.checkpoint
    def chunk(xs, ts, ms):
        return jnp.sum(tp.cross_entropy(logits(cfg.model, params, xs, tp=tp), ts) * ms)

    def split(a):  # (batch, t, ...) -> (t / c, batch, c, ...)
        return jnp.moveaxis(a.reshape(a.shape[0], t // c, c, *a.shape[2:]), 1, 0)

    def body(total, parts):
        return total + chunk(*parts), None

    zero = zeros((), jnp.float32, vma(mask))
    total, _ = jax.lax.scan(body, zero, (split(x), split(targets), split(mask)))
    return total
