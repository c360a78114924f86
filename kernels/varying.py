"""The varying manual axes of arrays inside `shard_map`, written once.

With `check_vma`, every array inside `shard_map` is typed with the manual mesh axes
over which it may differ between devices. A kernel launch (Pallas, jax-triton, a
callback) is told its outputs' types; a loop carry or both branches of a conditional
must keep one type; a gradient sink says over which axes the gradient is reduced.
These helpers read and set that type: the model, the parallel layouts, the pipeline
executor and the kernels all use them. Outside `shard_map` nothing varies and each is
the identity.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def vma(x) -> frozenset:
    """The manual mesh axes over which x (an array or a ShapeDtypeStruct) may differ."""
    aval = x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)  # jax 0.10
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(aval, "vma", ()))


def partitioned_axes() -> tuple[str, ...]:
    """The current mesh's axes (size > 1) that are not manual: those the partitioner
    splits arrays over here. None on one device or inside a shard_map over all of them,
    where the code is one device's own."""
    mesh = jax.sharding.get_abstract_mesh()
    return tuple(n for n, size in zip(mesh.axis_names, mesh.axis_sizes, strict=True)
                 if size > 1 and n not in mesh.manual_axes)  # fmt: skip


def vary(x, axes):
    """x typed as varying over `axes` as well (no data moves)."""
    missing = tuple(a for a in axes if a not in vma(x))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def vary_like(tree, *inputs):
    """Every leaf of `tree` typed as varying over every manual axis an input varies over
    (inputs may be None): loop-carry zeros, and outputs of launchers that come back
    untyped (jax-triton, callbacks)."""
    axes = frozenset().union(*(vma(x) for x in inputs if x is not None))

    def one(out):
        missing = tuple(sorted(axes - vma(out)))
        return jax.lax.pcast(out, missing, to="varying") if missing else out

    return jax.tree.map(one, tree)


def like(tree, ref):
    """`tree` typed leaf by leaf as `ref` (a tree of the same structure) varies: both
    branches of a conditional, and a loop's carry, must agree."""
    return jax.tree.map(lambda x, t: vary(x, tuple(sorted(vma(t)))), tree, ref)


def zeros(shape, dtype, axes=()):
    """Zeros typed as varying over `axes`."""
    return vary(jnp.zeros(shape, dtype), tuple(sorted(axes)))


def zeros32(x):
    """fp32 zeros with x's shape and varying axes."""
    return zeros(x.shape, jnp.float32, vma(x))


def sum_like(ct, primal):
    """A cotangent summed over the manual axes it varies over and its primal does not, as
    JAX's own transpose does for a replicated input (a norm's scale under data parallel)."""
    extra = tuple(sorted(vma(ct) - vma(primal)))
    return jax.lax.psum(ct, extra) if extra else ct


def struct(shape, dtype, *like_):
    """An output's ShapeDtypeStruct, varying over every manual axis `like_` varies over."""
    types = [jax.typeof(x) for x in like_]
    manual = [getattr(t, "manual_axis_type", None) for t in types]
    if all(m is not None for m in manual):  # jax 0.10
        most = max(manual, key=lambda m: len(m.varying))
        return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=most)
    axes = frozenset().union(*(getattr(t, "vma", frozenset()) for t in types))
    try:
        return jax.ShapeDtypeStruct(shape, dtype, vma=axes)
    except TypeError:  # a jax without varying-axes types
        return jax.ShapeDtypeStruct(shape, dtype)
