"""A zero computed from an array, so XLA must wait for that array to make it.

XLA's schedulers place work by data dependence alone, and build a constant (a zero table,
a fixed index) wherever it suits them: before a loop it does not belong to, where it then
lives through the loop. An optimisation barrier is gone before scheduling. A zero read
off the array it should follow is not a constant: XLA cannot fold `v * 0` for a float v
(NaN, inf), and converting it to an integer gives 0 whatever v holds (XLA converts NaN
to 0). Costs one scalar read and multiply; where the partitioner splits x over devices
(parallel.collectives=gspmd), also a scalar all-reduce to fetch that value, which adds
latency but no bandwidth (4 bytes; explicit collectives read it locally).
"""

from __future__ import annotations

import jax.numpy as jnp


def zero_after(x):
    """An int32 scalar 0 that XLA computes only once x is (its first value times zero)."""
    return (x.ravel()[0] * 0).astype(jnp.int32)


def zeros_after(x, shape, dtype=jnp.float32):
    """Zeros of `shape` that XLA builds only once x is: a table not made before its loop."""
    return jnp.broadcast_to(zero_after(x).astype(dtype), shape)
