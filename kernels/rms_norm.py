"""Fused residual add + RMSNorm in Triton (through jax-triton), forward and backward,
beside its jnp reference.

A pre-norm block adds each sublayer's output to the residual stream and normalises the
sum at once: h = x + r, y = RMSNorm(h) * w. Unfused, that is a read of x and r, a
write of h, and a second read of h for the norm; the kernel reads x and r once and
writes h and y together, and keeps one fp32 number per row (1 / rms) for the backward.
The backward fuses the norm's gradient with the gradient that reached h by the
residual stream, and writes per-program fp32 partial sums of the scale's gradient.

The arithmetic is the model's (`ultrajax.model.nn.rms_norm`): h rounded to x's dtype, the
mean of squares and the scaling in fp32, y rounded to x's dtype. Its Triton source is
kernels/rms_norm_triton.py; kernels/triton_call.py launches it through jax-triton on a
GPU and through Triton's interpreter with `interpret=True` (the CPU tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ultrajax.kernels.triton_call import call
from ultrajax.kernels.varying import sum_like

MAX_PROGRAMS = 512  # backward programs at most (each sums its rows' scale gradient)


def reference(x, weight, residual=None, eps=1e-5):
    """(y, h) in plain jnp: what the kernel must equal. h is x without a residual."""
    h = x if residual is None else (x.astype(jnp.float32) + residual).astype(x.dtype)
    h32 = h.astype(jnp.float32)
    rstd = jax.lax.rsqrt(jnp.mean(h32 * h32, axis=-1, keepdims=True) + eps)
    return (h32 * rstd * weight.astype(jnp.float32)).astype(x.dtype), h


def rms_norm(x, weight, residual=None, eps=1e-5, *, interpret=None):
    """(y, h): y = RMSNorm(h) * weight with h = x + residual (h = x without one).

    x, residual: (..., features), one dtype; weight: (features,). Differentiable in all
    three. `interpret`: run in Triton's interpreter (default: off a GPU)."""
    if x.shape[-1] != weight.shape[-1] or weight.ndim != 1:
        raise ValueError(f"rms_norm: weight {weight.shape} does not match x {x.shape}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"rms_norm: residual {residual.shape} {residual.dtype} is not x's {x.shape} {x.dtype}"
        )
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    out = _fused(x, residual, weight, float(eps), bool(interpret))
    return out if residual is not None else (out, x)


def _block(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()  # the next power of two: one row per block


def _warps(block: int) -> int:
    return min(max(block // 256, 1), 16)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _fused(x, residual, weight, eps, interpret):
    """(y, h) with a residual, y alone without (h is then x, outside this function)."""
    y, h, _ = _forward(x, residual, weight, eps, interpret)
    return (y, h) if residual is not None else y


def _forward(x, residual, weight, eps, interpret):
    d = x.shape[-1]
    rows = x.size // d
    x2 = x.reshape(rows, d)
    r2 = x2 if residual is None else residual.reshape(rows, d)  # unread without one
    y, h, rstd = call(
        _source().forward_kernel,
        x2,
        r2,
        weight,
        d,
        d,
        np.float32(eps),
        out_shape=[
            jax.ShapeDtypeStruct((rows, d), x.dtype),
            jax.ShapeDtypeStruct((rows, d) if residual is not None else (1,), x.dtype),
            jax.ShapeDtypeStruct((rows,), jnp.float32),
        ],
        grid=(rows,),
        interpret=interpret,
        num_warps=_warps(_block(d)),
        HAS_RESIDUAL=residual is not None,
        BLOCK=_block(d),
    )
    h = x if residual is None else h.reshape(x.shape)
    return y.reshape(x.shape), h, rstd


def _fused_fwd(x, residual, weight, eps, interpret):
    y, h, rstd = _forward(x, residual, weight, eps, interpret)
    out = (y, h) if residual is not None else y
    return out, (h, weight, rstd)


def _fused_bwd(eps, interpret, res, cotangents):
    h, weight, rstd = res
    has_residual = isinstance(cotangents, tuple)  # (dy, dh) where the output was (y, h)
    dy, dh = cotangents if has_residual else (cotangents, None)
    d = h.shape[-1]
    rows = h.size // d
    if rows == 0:  # nothing to normalise: no kernel (its grid would divide by 0 programs)
        dx = jnp.zeros_like(h)
        return dx, (dx if has_residual else None), jnp.zeros_like(weight)
    programs = min(rows, MAX_PROGRAMS)
    per_program = -(-rows // programs)
    programs = -(-rows // per_program)
    dy2 = dy.reshape(rows, d)
    dx, dw = call(
        _source().backward_kernel,
        dy2,
        dh.reshape(rows, d) if has_residual else dy2,  # h's own cotangent; unread without
        h.reshape(rows, d),
        weight,
        rstd,
        rows,
        d,
        d,
        out_shape=[
            jax.ShapeDtypeStruct((rows, d), h.dtype),
            jax.ShapeDtypeStruct((programs, d), jnp.float32),
        ],
        grid=(programs,),
        interpret=interpret,
        num_warps=_warps(_block(d)),
        HAS_DH=has_residual,
        ROWS=per_program,
        BLOCK=_block(d),
    )
    dx = dx.reshape(h.shape)
    dw = sum_like(jnp.sum(dw, axis=0).astype(weight.dtype), weight)
    return dx, (dx if has_residual else None), dw


_fused.defvjp(_fused_fwd, _fused_bwd)


def _source():
    from ultrajax.kernels import rms_norm_triton  # imports triton: only when a kernel runs

    return rms_norm_triton
