"""The Llama block's building blocks: RMSNorm and rotary position embeddings."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from ultrajax.model.ops import scale


def rms_norm(x, weight, eps):
    """RMSNorm in fp32 (the mean of squares is where bf16 loses digits)."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return scale(y, weight).astype(x.dtype)


def rope(
    x,
    positions,
    theta,
    *,
    scaling: str = "none",
    factor: float = 1.0,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_max_len: int = 8192,
):
    """Rotary embedding, half-split layout (Hugging Face Llama's `rotate_half`).

    x: (batch, length, heads, head_dim); positions: (batch, length).
    `scaling` rescales the inverse frequencies (in fp32) as transformers' rope types do,
    so long-context checkpoints compute what they were trained to: linear divides them
    all by `factor`; llama3 divides those with wavelengths above
    original_max_len / low_freq_factor, keeps those below original_max_len /
    high_freq_factor and interpolates between (`_compute_llama3_parameters`).
    """
    half = x.shape[-1] // 2
    freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    if scaling == "linear":
        freq = freq / factor
    elif scaling == "llama3":
        wavelen = 2 * math.pi / freq
        scaled = jnp.where(wavelen > original_max_len / low_freq_factor, freq / factor, freq)
        smooth = (original_max_len / wavelen - low_freq_factor) / (
            high_freq_factor - low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= original_max_len / high_freq_factor) & (
            wavelen <= original_max_len / low_freq_factor
        )
        freq = jnp.where(medium, smoothed, scaled)
    elif scaling != "none":
        raise ValueError(f"rope scaling {scaling!r} is not one of none, linear, llama3")
    angle = positions.astype(jnp.float32)[..., None] * freq  # (b, t, half)
    cos, sin = jnp.cos(angle)[:, :, None], jnp.sin(angle)[:, :, None]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def cross_entropy(logits, targets, tp):
    """Per-token NLL from vocabulary-sharded fp32 logits, never gathering the vocabulary:
    the max, the sum of exponentials and the target logit are reduced as scalars per token."""
    if tp is None or tp.size == 1:
        log_z = jax.nn.logsumexp(logits, axis=-1)
        target = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
        return log_z - target
    log_z, target, _ = _log_z_and_target(logits, targets, tp)
    return log_z - target


def cross_entropy_grad(logits, targets, mask, tp, dtype):
    """(summed NLL of the masked tokens, its gradient with respect to the fp32 logits, in
    `dtype`), the gradient written out: softmax minus one-hot, one pass over the logits.

    Autodiff of `cross_entropy` builds the one-hot by scattering into a zero fp32
    tensor the logits' size and passes over the logits more often: compiled for an H200,
    the 1B step's chunked loss moved 59.1 GiB a step that way, 27.8 this way
    (docs/kernels.md). The same vocabulary sharding as `cross_entropy`; `tp` None: whole
    (or sharded by the partitioner)."""
    log_z, target, local = _log_z_and_target(logits, targets, tp, online=True)
    nll = jnp.sum((log_z - target) * mask)
    vocab = jax.lax.broadcasted_iota(local.dtype, logits.shape, logits.ndim - 1)
    p = jnp.exp(logits - log_z[..., None])
    g = (p - (vocab == local[..., None])) * mask[..., None]
    return nll, g.astype(dtype)


def _log_z_and_target(logits, targets, tp, online: bool = False):
    """(log-sum-exp, target logit, the target's index in this device's slice) per token,
    over the vocabulary `tp` shards (None or size 1: whole), reduced as scalars.
    `online` (not differentiable): the max and the sum of exponentials in one pass over
    the logits (`_max_and_sum_exp`), not two."""
    local_vocab = logits.shape[-1]
    sharded = tp is not None and tp.size > 1
    if online:
        m, sum_exp = _max_and_sum_exp(logits)
        if sharded:
            top = tp.max(m)
            m, sum_exp = top, sum_exp * jnp.exp(m - top)
    else:
        m = jax.lax.stop_gradient(jnp.max(logits, axis=-1))  # for stability only
        m = tp.max(m) if sharded else m
        sum_exp = jnp.sum(jnp.exp(logits - m[..., None]), axis=-1)
    local = targets - (tp.vocab_start(local_vocab) if sharded else 0)
    mine = (local >= 0) & (local < local_vocab)
    picked = jnp.take_along_axis(logits, jnp.clip(local, 0, local_vocab - 1)[..., None], -1)
    target = jnp.where(mine, picked[..., 0], 0.0)
    if sharded:
        sum_exp, target = tp.sum(sum_exp), tp.sum(target)
    return jnp.log(sum_exp) + m, target, local


def _max_and_sum_exp(x):
    """(max, sum of exp(x - max)) over the last axis in one reduction: a running max
    whose sum is rescaled when the max grows (the online softmax's), one exponential an
    element as in the two-pass form. Compiled for an H200 the 1B step's chunked loss
    then reads its fp32 logits twice, not three times: 7.8 GiB a step less."""

    def combine(a, b):
        (ma, sa), (mb, sb) = a, b
        first = ma >= mb
        # the smaller side's scale; equal maxima (two empty sides: -inf) scale by one
        e = jnp.where(ma == mb, 1.0, jnp.exp(-jnp.abs(ma - mb)))
        return jnp.where(first, ma, mb), jnp.where(first, sa + sb * e, sa * e + sb)

    init = (jnp.array(-jnp.inf, x.dtype), jnp.array(0.0, x.dtype))
    return jax.lax.reduce((x, jnp.ones_like(x)), init, combine, (x.ndim - 1,))
