"""The tick loop's fixed-size buffers: slots read, written and added to at traced
indices, and the one conditional each buffer is updated under.

A schedule keeps many micro-batches in flight, so every activation, gradient and
residual between two ticks waits in a slot of a buffer whose size the plan fixes on the
host (parallel/pipeline/plan.py). Inside `lax.scan` the whole buffer is the carry; these
helpers touch one slot of it so that XLA can update it in place.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ultrajax.kernels.varying import like, vma, zeros


def buffer(struct, axes, lead=()):
    """Zeros shaped like `struct` behind the leading dimensions `lead`, typed by `axes`."""
    return zeros((*lead, *struct.shape), struct.dtype, axes)


def read(buf, slot):
    """Slot `slot` of every leaf of `buf`."""
    return jax.tree.map(lambda b: jax.lax.dynamic_index_in_dim(b, slot, 0, False), buf)


def write(buf, slot, value):
    """`buf` with `value` (cast to the buffer's dtype) in slot `slot` of every leaf."""
    return jax.tree.map(
        lambda b, x: jax.lax.dynamic_update_index_in_dim(b, x.astype(b.dtype), slot, 0),
        buf,
        value,
    )


def add(buf, slot, value, most: bool = False):
    """`buf` with `value` added into slot `slot` of every leaf (a buffer of one slot is
    indexed statically: the common case of one chunk per device); `most`: the larger of
    the two kept instead (model.fp8=delayed's amaxes)."""
    if jax.tree.leaves(buf)[0].shape[0] == 1:
        if most:
            return jax.tree.map(lambda a, b: a.at[0].max(b), buf, value)
        return jax.tree.map(lambda a, b: a.at[0].add(b), buf, value)
    both = jnp.maximum if most else jnp.add
    return jax.tree.map(
        lambda a, b: jax.lax.dynamic_update_index_in_dim(
            a, both(jax.lax.dynamic_index_in_dim(a, slot, 0, False), b), slot, 0
        ),
        buf,
        value,
    )


def when(pred, update, *operands):
    """update(*operands) where pred holds, else the operands unchanged. The unchanged
    case is branch 0 of the conditional: XLA forwards a pass-through operand of
    branch 0 in place, but copies one of any later branch (every tick, whole
    buffers), so each buffer is only ever updated under its own two-way `when`.

    `update` returns (the new first operand, *other outputs); where pred does not hold
    the other outputs are zeros of their type."""
    first = operands[0]

    def apply(*ops):
        out = update(*ops)
        return (like(out[0], first), *out[1:])

    def keep(*ops):
        out = jax.eval_shape(apply, *ops)
        blank = lambda s: zeros(s.shape, s.dtype, vma(s))  # noqa: E731
        return (ops[0], *(jax.tree.map(blank, o) for o in out[1:]))

    return jax.lax.cond(pred, apply, keep, *operands)
