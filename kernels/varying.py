"""Output types for kernel calls inside `shard_map`.

A kernel launch (Pallas, jax-triton, a callback) is told its outputs' shapes and
dtypes. Inside `shard_map` with `check_vma`, as ring attention and the explicit step
call kernels, an output must also say which manual mesh axes it varies over: those its
inputs vary over.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def struct(shape, dtype, *like):
    """An output's ShapeDtypeStruct, varying over every manual axis `like` varies over."""
    types = [jax.typeof(x) for x in like]
    manual = [getattr(t, "manual_axis_type", None) for t in types]
    if all(m is not None for m in manual):  # jax 0.10
        most = max(manual, key=lambda m: len(m.varying))
        return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=most)
    vma = frozenset().union(*(getattr(t, "vma", frozenset()) for t in types))
    try:
        return jax.ShapeDtypeStruct(shape, dtype, vma=vma)
    except TypeError:  # a jax without varying-axes types
        return jax.ShapeDtypeStruct(shape, dtype)


def vary_like(out, *inputs):
    """`out` typed as varying over every manual axis an input varies over (no data moves):
    for launchers whose outputs come back untyped (jax-triton, callbacks)."""
    axes = frozenset().union(*(vma(x) for x in inputs))
    missing = tuple(sorted(axes - vma(out)))
    return jax.lax.pcast(out, missing, to="varying") if missing else out


def sum_like(ct, primal):
    """A cotangent summed over the manual axes it varies over and its primal does not, as
    JAX's own transpose does for a replicated input (a norm's scale under data parallel)."""
    extra = tuple(sorted(vma(ct) - vma(primal)))
    return jax.lax.psum(ct, extra) if extra else ct


def vma(x) -> frozenset:
    """The manual mesh axes over which x may differ (empty outside shard_map)."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)  # jax 0.10
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(aval, "vma", ()))


def vary(x, axes):
    """x typed as varying over `axes` as well (no data moves)."""
    missing = tuple(a for a in axes if a not in vma(x))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def zeros32(x):
    """fp32 zeros with x's shape and varying axes."""
    z = jnp.zeros(x.shape, jnp.float32)
    return vary(z, tuple(sorted(vma(x))))
