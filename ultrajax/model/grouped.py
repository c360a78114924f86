"""Grouped matmuls over blocks of rows: each group's rows times its own weight, at the
FLOPs of the rows that exist.

Why: jax's `ragged_dot` runs as a dense product of every row with every group's weight
on a CPU (jax's own lowering) and on a GPU (XLA's ragged-dot rewriter, jax 0.11), so an
MoE layer of E experts and top-k does E/k times the expert FLOPs the model counts and
holds (E, rows, hidden) temporaries (docs/moe.md). Here each group's rows are padded to
whole blocks of `block` rows, every block belongs to one group, and a loop multiplies
block by block with that group's weight: at most E·(block - 1) padding rows are
multiplied beyond the real ones, and nothing larger than one block's product is held.

`matmul(x, w, sizes)` is `ragged_dot(x, w, sizes)`: x (rows, k) sorted by group, group i
the next sizes[i] rows, w (groups, k, n); rows past sum(sizes) give zeros.
`weight_gradient(x, g, sizes)` is its transpose in w: each group's x^T g, (groups, k, n).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ultrajax.kernels.varying import vma, zeros

MAX_BLOCK = 128  # rows a block: a GPU's matmul tile; fewer where the groups are small


def implementation(setting: str, platform: str | None = None) -> str:
    """model.moe_grouped resolved: auto is blocked on a CPU (1.8x the ragged step of
    moe-tiny's shape there), ragged elsewhere (a GPU's blocked speed is not measured)."""
    if setting != "auto":
        return setting
    return "blocked" if (platform or jax.default_backend()) == "cpu" else "ragged"


def block_rows(rows: int, groups: int) -> int:
    """The block: a power of two near half the mean group's rows, 8 to MAX_BLOCK, so
    the padding (under one block a group) stays under the real rows."""
    b = 8
    while b * 2 <= min(MAX_BLOCK, rows // (2 * groups)):
        b *= 2
    return b


class Blocks(NamedTuple):
    """Where the rows go in the padded layout of whole blocks (all shapes static)."""

    src: jax.Array  # (blocks x block,) the row each padded slot reads
    valid: jax.Array  # (blocks x block,) whether that slot holds a row
    group: jax.Array  # (blocks,) each block's group
    dst: jax.Array  # (rows,) each row's padded slot
    kept: jax.Array  # (rows,) whether the row belongs to a group


def _after(i, ends):
    """How many of the sorted `ends` are <= each i: the group of index i (searchsorted
    right, which jax cannot trace with varying types inside shard_map)."""
    return jnp.sum(i[:, None] >= ends[None, :], axis=1, dtype=jnp.int32)


def layout(sizes, rows: int, block: int) -> Blocks:
    """The padded layout for `rows` rows in groups of `sizes`: ceil(rows / block) +
    groups blocks, enough for any sizes that sum to at most `rows`."""
    groups = sizes.shape[0]
    n = (-(-rows // block) + groups) * block
    sizes = sizes.astype(jnp.int32)
    padded = (sizes + block - 1) // block * block
    pend = jnp.cumsum(padded)
    pstart, start = pend - padded, jnp.cumsum(sizes) - sizes
    slot = jnp.arange(n, dtype=jnp.int32)
    g = jnp.minimum(_after(slot, pend), groups - 1)
    off = slot - pstart[g]
    valid = (slot < pend[-1]) & (off < sizes[g])
    src = jnp.clip(start[g] + off, 0, rows - 1)
    row = jnp.arange(rows, dtype=jnp.int32)
    rg = jnp.minimum(_after(row, jnp.cumsum(sizes)), groups - 1)
    kept = row < jnp.sum(sizes)
    dst = jnp.clip(pstart[rg] + row - start[rg], 0, n - 1)
    return Blocks(src, valid, g[::block], dst, kept)


def _padded(a, at: Blocks, block: int):
    """Rows -> (blocks, block, ...) with zeros in the padding."""
    out = jnp.where(at.valid[:, None], a[at.src], jnp.zeros((), a.dtype))
    return out.reshape(-1, block, *a.shape[1:])


def matmul(x, w, sizes, *, block: int | None = None, out_dtype=None):
    """ragged_dot(x, w, sizes) block by block (module docstring), in `out_dtype`
    (default x's), accumulating in fp32. Its derivative is the same blocks' (the input's
    gradient a grouped matmul by the transposed weights, the weight's `weight_gradient`),
    keeping x and w for the backward pass as ragged_dot's does."""
    block = block or block_rows(x.shape[0], w.shape[0])
    return _matmul(x, w, sizes, block, jnp.dtype(out_dtype or x.dtype).name)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _matmul(x, w, sizes, block: int, out_dtype: str):
    return _blocks(x, w, sizes, block, jnp.dtype(out_dtype))


def _matmul_fwd(x, w, sizes, block, out_dtype):
    return _matmul(x, w, sizes, block, out_dtype), (x, w, sizes)


def _matmul_bwd(block, out_dtype, res, g):
    x, w, sizes = res
    dx = _blocks(g.astype(x.dtype), jnp.swapaxes(w, 1, 2), sizes, block, x.dtype)
    dw = weight_gradient(x, g.astype(x.dtype), sizes, w.shape[0], block=block)
    return dx, dw.astype(w.dtype), None


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def _blocks(x, w, sizes, block: int, out_dtype):
    """The forward loop: each block of padded rows times its group's weight."""
    rows = x.shape[0]
    at = layout(sizes, rows, block)

    def one(_, xs_g):
        xs, g = xs_g
        y = jnp.dot(xs, w[g].astype(xs.dtype), preferred_element_type=jnp.float32)
        return None, y.astype(out_dtype)

    _, ys = jax.lax.scan(one, None, (_padded(x, at, block), at.group))
    y = ys.reshape(-1, w.shape[-1])[at.dst]
    return jnp.where(at.kept[:, None], y, jnp.zeros((), out_dtype))


def weight_gradient(x, g, sizes, groups: int, *, block: int | None = None, dtype=jnp.float32):
    """Each group's x^T g, (groups, k, n) in `dtype`: the transpose of `matmul` in w, each
    block's product added into its group's slice of the sum."""
    rows = x.shape[0]
    block = block or block_rows(rows, groups)
    at = layout(sizes, rows, block)

    def one(dw, parts):
        xs, gs, grp = parts
        part = jnp.dot(xs.T, gs, preferred_element_type=dtype)
        return dw.at[grp].add(part), None

    zero = zeros((groups, x.shape[1], g.shape[1]), dtype, vma(x) | vma(g))
    dw, _ = jax.lax.scan(one, zero, (_padded(x, at, block), _padded(g, at, block), at.group))
    return dw
