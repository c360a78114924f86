"""FP8 matmuls with current per-tensor scaling (model.fp8=tensorwise): one byte a value
in the matmul's operands, fp32 accumulation and scales.

Why this recipe: the forward operands (activations, weights) go to e4m3, more mantissa
for values whose range a per-tensor scale already fits; the backward's gradient operand
goes to e5m2, more range for gradients whose spread is wider. Each operand is scaled so
its largest magnitude lands on the format's largest finite value (448 for e4m3, 57344
for e5m2), clipped there, cast; the product of two quantised operands is divided by
both scales. Nothing overflows to inf: a value far beyond the format is clipped after
scaling by its own tensor's amax, so it lands on the largest finite value.

`matmul(eq, x, w)` is einsum(eq, x, w) in fp32 through FP8 operands; its backward
quantises the output's cotangent to e5m2 and reuses the forward's e4m3 operands (kept
for the backward: one byte a value instead of two).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

E4M3 = jnp.float8_e4m3fn  # forward operands
E5M2 = jnp.float8_e5m2  # the backward's gradient operand


def quantize(x, dtype, amax=None):
    """(q, scale): x ~ q / scale, q in `dtype`, scale = the format's max / amax(x) (1
    where x is all zeros), fp32. `amax`: the whole tensor's, where x is a shard of it."""
    top = float(jnp.finfo(dtype).max)
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32)) if amax is None else amax
    scale = jnp.where(amax > 0, top / jnp.maximum(amax, jnp.finfo(jnp.float32).tiny), 1.0)
    return jnp.clip(x32 * scale, -top, top).astype(dtype), scale


def scaled(eq: str, a, sa, b, sb):
    """einsum(eq) of two quantised operands, fp32, their scales divided out."""
    return jnp.einsum(eq, a, b, preferred_element_type=jnp.float32) / (sa * sb)


def _transposes(eq: str) -> tuple[str, str]:
    """'A,B->C' -> ('C,B->A', 'A,C->B'): the einsums of dx and dw."""
    ins, out = eq.split("->")
    a, b = ins.split(",")
    return f"{out},{b}->{a}", f"{a},{out}->{b}"


def forward(eq: str, x, w):
    """(einsum(eq, x, w) in fp32 through e4m3 operands, what `backward` needs: the
    quantised operands and their scales, one byte a value)."""
    (xq, sx), (wq, sw) = quantize(x, E4M3), quantize(w, E4M3)
    return scaled(eq, xq, sx, wq, sw), (xq, sx, wq, sw)


def backward(eq: str, res, g):
    """(dx, dw) in fp32 from `forward`'s residuals: the cotangent in e5m2 against the
    forward's e4m3 operands."""
    xq, sx, wq, sw = res
    gq, sg = quantize(g, E5M2)
    eq_dx, eq_dw = _transposes(eq)
    return scaled(eq_dx, gq, sg, wq, sw), scaled(eq_dw, xq, sx, gq, sg)


def matmul(eq: str, x, w):
    """einsum(eq, x, w) in fp32 with e4m3 operands (module docstring)."""
    return _matmul(eq, x.dtype.name, w.dtype.name, x, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _matmul(eq: str, x_dtype: str, w_dtype: str, x, w):
    return forward(eq, x, w)[0]


def _matmul_fwd(eq, x_dtype, w_dtype, x, w):
    return forward(eq, x, w)


def _matmul_bwd(eq, x_dtype, w_dtype, res, g):
    dx, dw = backward(eq, res, g)
    return dx.astype(x_dtype), dw.astype(w_dtype)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)
