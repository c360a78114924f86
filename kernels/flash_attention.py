"""Flash attention in Pallas (Triton-style), forward and backward.

Dao et al. 2022/2023: queries are processed a block at a time; for each, the key/value
blocks stream through with an online softmax (a running max `m` and sum `l`), so the
(seq x seq) scores never exist in memory. The backward pass recomputes each block's
probabilities from the saved log-sum-exp instead of storing them.

What it supports, and how:
- causal masking by index, and packed documents by segment ids (a query attends to keys
  of its own segment only): no dense mask is ever built, each block builds its own, and
  blocks that cannot share a document are skipped: the loops start and end where the
  segment ids' block minima and maxima allow (`_bounds`), so with several documents in a
  row the work falls with the documents' lengths, not the row's;
- masks only where one can hide something: blocks that the causal diagonal does not
  cross skip the causal mask, and blocks whose queries and keys all hold one and the same
  segment id skip the segment mask (without segment ids, none builds one), so the
  interior of a causal attention, and of each packed document, is bare dots and softmax;
- grouped-query attention without repeating K/V: query head h reads K/V head
  h // (heads / kv_heads) through the BlockSpec's index map; the dK/dV kernel runs per
  K/V head and sums the group's query heads in fp32 inside, one write in the inputs' dtype;
- warps and pipelining stages per head_dim and tile from a sweep on an H200
  (`TUNED_FWD`, `TUNED_BWD`); scores in base 2 (exp2, the GPU's instruction);
- two backward kernels by default (dQ per query block, dK/dV per key block, each
  recomputing the probabilities; deterministic), or one (`BlockSizes.fused_bwd`,
  model.attention_backward=fused): the dK/dV kernel also adds each block's share of dQ
  into an fp32 dQ by atomic adds, so the probabilities are computed once (5 matmuls per
  block instead of 7) at the price of dQ's atomics and run-to-run last bits;
- fp32 accumulation in every dot; returns the output and the log-sum-exp (natural log,
  per query and head), which ring attention needs to merge blocks;
- lengths that are not a multiple of the block: inputs are padded to whole blocks with
  segment ids no real token has, and the padding is sliced off.
A query row with no key to attend to (never the case under causal masking, where each
token sees itself) gives zeros and lse = -inf, never NaN.

Interpreted on a CPU (the tests, against ultrajax/model/attention/xla.py's `reference`);
on a GPU through Pallas's Triton lowering, fp32 inputs in TF32 (benchmarks/RESULTS.md).
Shapes: q (batch, length, heads, head_dim), k and v (batch, kv_length, kv_heads,
head_dim), segment ids (batch, length) and (batch, kv_length) int32.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl

from ultrajax.kernels import attention_inputs
from ultrajax.kernels.varying import struct, vary_like

NEG_INF = -1e30  # finite: a masked score, so exp2() is exactly 0 and max() stays finite
LOG2E = math.log2(math.e)  # scores in base 2: exp2 is the GPU's instruction, exp one more


# Measured on one H200 (benchmarks/RESULTS.md, `scripts/bench_attention.py --sweep fwd|bwd`,
# seq 4096, bf16, 2048 query features): the fastest (warps, stages) per head_dim and tile,
# forward and backward apart. Tiles not listed get `_rule`.
TUNED_FWD = {  # (head_dim, q, k): (warps, stages)
    (64, 128, 128): (8, 3), (64, 128, 64): (4, 3), (64, 64, 64): (4, 3), (64, 64, 128): (4, 2),
    (128, 128, 128): (8, 3), (128, 128, 64): (8, 3), (128, 64, 64): (4, 3), (128, 64, 128): (4, 3),
}  # fmt: skip
TUNED_BWD = {  # (head_dim, q_bwd, k_bwd): (warps, stages)
    (64, 64, 64): (4, 3), (64, 64, 128): (4, 3), (64, 128, 64): (4, 2), (64, 128, 128): (8, 3),
    (128, 64, 64): (4, 2), (128, 64, 128): (4, 3), (128, 128, 64): (8, 2), (128, 128, 128): (8, 2),
}  # fmt: skip
TILES = {64: (128, 64, 128, 64), 128: (128, 128, 64, 64)}  # head_dim: the fastest tiles


def _rule(head_dim: int, q: int, k: int) -> tuple[int, int]:
    """(warps, stages) off the table: 8 warps once a tile's fp32 scores and accumulator
    outgrow 4 warps' registers (JAX's own Pallas attention does the same for head_dim > 64)."""
    return (8 if head_dim > 64 and q * k >= 128 * 64 else 4), 2


@dataclass(frozen=True)
class BlockSizes:
    """Tile sizes (queries x keys) of the forward and the backward kernels, and the Triton
    lowering's warps per program and software-pipelining stages on a GPU (None: from the
    measured table for the head_dim and tile, `TUNED_FWD` / `TUNED_BWD`).
    `model.attention_blocks` sets the four tile sizes (None: `TILES` for the head_dim);
    `scripts/bench_attention.py --sweep` times other choices on a GPU."""

    q: int = 128
    k: int = 128
    q_bwd: int = 64
    k_bwd: int = 64
    warps: int | None = None
    stages: int | None = None
    warps_bwd: int | None = None  # the backward kernels' (None: tuned)
    stages_bwd: int | None = None
    # one backward kernel (each block's probabilities computed once, dQ by fp32 atomic
    # adds) instead of two (dQ, then dK/dV, each recomputing them); model.attention_backward
    fused_bwd: bool = False
    # the grid's first (fastest) axis is the block, then batch and head: the programs that
    # run at once share one head's K and V (or Q and dO) in L2, as FlashAttention-2 and
    # Triton's attention tutorial order their grids, and the query-block kernels start the
    # longest causal rows first. False: batch, head, block (the order before; for timing)
    blocks_first: bool = True

    @classmethod
    def of(cls, sizes, head_dim: int, itemsize: int = 2, fused_bwd: bool = False) -> BlockSizes:
        """From `model.attention_blocks` ([q, k, q_bwd, k_bwd]), or None: the head_dim's
        tiles (fp32 inputs: 64 x 64, as 128-wide fp32 tiles outgrow shared memory)."""
        if sizes is None:
            sizes = (64, 64, 64, 64) if itemsize > 2 else TILES.get(head_dim, (64,) * 4)
        return cls(*sizes, fused_bwd=fused_bwd)

    def launch(self, head_dim: int, backward: bool, itemsize: int = 2) -> tuple[int, int]:
        """(warps, stages) of the forward or the backward kernels; the table's stages are
        for bf16 tiles, so fp32 inputs keep 2 (each stage buffers twice the bytes)."""
        if backward:
            q, k, warps, stages = self.q_bwd, self.k_bwd, self.warps_bwd, self.stages_bwd
            tuned = TUNED_BWD.get((head_dim, q, k))
        else:
            q, k, warps, stages = self.q, self.k, self.warps, self.stages
            tuned = TUNED_FWD.get((head_dim, q, k))
        w, st = tuned or _rule(head_dim, q, k)
        st = min(st, 2) if itemsize > 2 else st
        return (w if warps is None else warps), (st if stages is None else stages)


# --------------------------------------------------------------------------- kernels


def _dot(a, b):  # a @ b, fp32 accumulation
    return jnp.dot(a, b, preferred_element_type=jnp.float32)


def _dot_t(a, b):  # a @ b.T without materialising the transpose
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _mask(q_seg, k_seg, q_start, k_start, causal: bool, segmented: bool):
    """Which of a block's scores are visible, or None where all are (no work spent)."""
    visible = None
    if segmented:
        visible = q_seg[:, None] == k_seg[None, :]
    if causal:
        shape = (q_seg.shape[0], k_seg.shape[0])
        rows = q_start + lax.broadcasted_iota(jnp.int32, shape, 0)
        cols = k_start + lax.broadcasted_iota(jnp.int32, shape, 1)
        visible = rows >= cols if visible is None else visible & (rows >= cols)
    return visible


def _run(pieces, body, carry):
    """carry after body(diagonal, segmented)(block, carry) over each piece's blocks, pieces
    (start, stop, diagonal, segmented) in order: every kernel's loops."""
    for start, stop, diagonal, segmented in pieces:
        carry = lax.fori_loop(start, stop, body(diagonal, segmented), carry)
    return carry


def _around(start, stop, lo, hi, diagonal):
    """[start, stop) in three pieces, of which blocks in [lo, hi) (pairs within one
    document: `_bounds`) build no segment mask."""
    a = jnp.clip(lo, start, stop)
    z = jnp.clip(hi, a, stop)
    return [(start, a, diagonal, True), (a, z, diagonal, False), (z, stop, diagonal, True)]


def _key_pieces(i, n_k, bq, bk, causal, segmented, first_ref, lo_ref, hi_ref):
    """The key blocks query block i may see, in rising order, as pieces for `_run`: from
    `first` (earlier ones hold other documents only), bare where neither mask can hide
    anything, the diagonal blocks last with the causal mask."""
    if not segmented:  # nothing to skip; under causal masking every row sees key 0 first
        if not causal:
            return [(0, n_k, False, False)]
        last = jnp.minimum(n_k, pl.cdiv((i + 1) * bq, bk))
        edge = jnp.minimum((i * bq + 1) // bk, last)
        return [(0, edge, False, False), (edge, last, True, False)]
    first = first_ref[...].min()
    lo, hi = lo_ref[...].min(), hi_ref[...].min()
    if not causal:
        return _around(first, n_k, lo, hi, False)
    # key blocks wholly at or below the first query's index need no causal mask
    last = jnp.minimum(n_k, pl.cdiv((i + 1) * bq, bk))
    edge = jnp.clip((i * bq + 1) // bk, first, last)
    return [*_around(first, edge, lo, hi, False), (edge, last, True, True)]


def _fwd_kernel(
    q_ref, k_ref, v_ref, qs_ref, ks_ref, first_ref, lo_ref, hi_ref, o_ref, lse_ref, *, scale,
    bq, bk, causal, segmented, grid,
):  # fmt: skip
    i = grid.block_id()
    n_k = k_ref.shape[0] // bk
    q = q_ref[...]
    q_seg = qs_ref[...]

    def body(diagonal: bool, segmented: bool):
        def step(j, carry):
            acc, m, denom = carry
            ks = pl.ds(j * bk, bk)
            s = _dot_t(q, k_ref[ks, :]) * (scale * LOG2E)
            visible = _mask(q_seg, ks_ref[ks], i * bq, j * bk, diagonal, segmented)
            if visible is not None:
                s = jnp.where(visible, s, NEG_INF)
            m_new = jnp.maximum(m, s.max(axis=1))
            p = jnp.exp2(s - m_new[:, None])
            if segmented:  # a row that has seen nothing yet (m = NEG_INF) adds nothing
                p = jnp.where(s > NEG_INF / 2, p, 0.0)
            corr = jnp.exp2(m - m_new)
            acc = acc * corr[:, None] + _dot(p.astype(v_ref.dtype), v_ref[ks, :])
            return acc, m_new, denom * corr + p.sum(axis=1)

        return step

    carry = (jnp.zeros(q.shape, jnp.float32), jnp.full((bq,), NEG_INF, jnp.float32),
             jnp.zeros((bq,), jnp.float32))  # fmt: skip
    pieces = _key_pieces(i, n_k, bq, bk, causal, segmented, first_ref, lo_ref, hi_ref)
    acc, m, denom = _run(pieces, body, carry)
    seen = denom > 0
    safe = jnp.where(seen, denom, 1.0)
    o_ref[...] = jnp.where(seen[:, None], acc / safe[:, None], 0.0).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen, (m + jnp.log2(safe)) / LOG2E, -jnp.inf)  # natural log


def _probs(q, k, lse, q_seg, k_seg, q_start, k_start, scale, diagonal, segmented):
    """One block's probabilities, recomputed from the saved log-sum-exp (in base 2)."""
    s = _dot_t(q, k) * (scale * LOG2E)
    lse = lse * LOG2E
    visible = _mask(q_seg, k_seg, q_start, k_start, diagonal, segmented)
    if not segmented:  # every row sees a key here or before: its lse is finite
        p = jnp.exp2(s - lse[:, None])
        return p if visible is None else jnp.where(visible, p, 0.0)
    visible = visible & jnp.isfinite(lse)[:, None]
    return jnp.where(visible, jnp.exp2(s - jnp.where(visible, lse[:, None], 0.0)), 0.0)


def _dq_kernel(
    q_ref, k_ref, v_ref, qs_ref, ks_ref, first_ref, lo_ref, hi_ref, do_ref, lse_ref, delta_ref,
    dq_ref, *, scale, bq, bk, causal, segmented, grid,
):  # fmt: skip
    i = grid.block_id()
    n_k = k_ref.shape[0] // bk
    q, do, lse, delta, q_seg = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...], qs_ref[...]

    def body(diagonal: bool, segmented: bool):
        def step(j, dq):
            ks = pl.ds(j * bk, bk)
            k, v = k_ref[ks, :], v_ref[ks, :]
            p = _probs(q, k, lse, q_seg, ks_ref[ks], i * bq, j * bk, scale, diagonal, segmented)
            ds = p * (_dot_t(do, v) - delta[:, None])
            return dq + _dot(ds.astype(k.dtype), k)

        return step

    pieces = _key_pieces(i, n_k, bq, bk, causal, segmented, first_ref, lo_ref, hi_ref)
    dq = _run(pieces, body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkv_kernel(
    q_ref, k_ref, v_ref, qs_ref, ks_ref, end_ref, lo_ref, hi_ref, do_ref, lse_ref, delta_ref,
    *refs, scale, bq, bk, causal, segmented, group, grid,
):  # fmt: skip
    """dK and dV of one key block, summed in fp32 over the `group` query heads that share
    its K/V head (GQA) before one write in the inputs' dtype. `refs`: (dk, dv), or for the
    one-kernel backward (dq zeros aliased in, dk, dv, dq): the same probabilities and dS
    then also give each query block's share of dQ, added into the fp32 dQ that every key
    block's program adds to. On a GPU those adds are atomic, so dQ's fp32 sum order (its
    last bits) may differ from run to run."""
    dk_ref, dv_ref, dq_ref = (*refs, None) if len(refs) == 2 else refs[1:]
    if dq_ref is not None:
        from jax.experimental.pallas import triton as pltriton  # atomic_add (interpretable)
    j = grid.block_id()
    n_q = q_ref.shape[0] // bq
    k, v, k_seg = k_ref[...], v_ref[...], ks_ref[...]

    def body(h, diagonal: bool, segmented: bool):
        def step(i, carry):
            dk, dv = carry
            qs = pl.ds(i * bq, bq)
            q, do = q_ref[qs, h, :], do_ref[qs, h, :]
            p = _probs(q, k, lse_ref[h, qs], qs_ref[qs], k_seg, i * bq, j * bk, scale, diagonal,
                       segmented)  # fmt: skip
            dv = dv + _dot(p.T.astype(do.dtype), do)
            ds = (p * (_dot_t(do, v) - delta_ref[h, qs][:, None])).astype(q.dtype)
            if dq_ref is not None:
                pltriton.atomic_add(dq_ref, (qs, h, slice(None)), _dot(ds, k))
            return dk + _dot(ds.T, q), dv

        return step

    # the query blocks that may see this key block, in rising order: the diagonal ones
    # first (causal mask), then those wholly after the block's last key, up to `end`
    # (later ones hold other documents only), bare where they share its one document
    end = jnp.minimum(n_q, end_ref[...].max()) if segmented else n_q
    start = (j * bk) // bq if causal else 0
    edge = jnp.clip(pl.cdiv(j * bk + bk - 1, bq), start, end) if causal else start
    pieces = [(start, edge, True, segmented)] if causal else []
    if segmented:
        pieces += _around(edge, end, lo_ref[...].min(), hi_ref[...].min(), False)
    else:
        pieces.append((edge, end, False, False))

    def head(h, carry):
        return _run(pieces, functools.partial(body, h), carry)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(0, group, head, (zeros, zeros))
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


# --------------------------------------------------------------------------- calls


def _call(kernel, grid, in_specs, out_specs, out_shape, interpret, name, launch, aliases=None):
    """pallas_call with the Triton lowering's (warps, stages) `launch` on a GPU."""
    extra = {}
    if not interpret:
        from jax.experimental.pallas import triton as pltriton  # GPU only

        extra["compiler_params"] = pltriton.CompilerParams(
            num_warps=launch[0], num_stages=launch[1]
        )
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        name=name,
        input_output_aliases=aliases or {},
        **extra,
    )


class Grid(NamedTuple):
    """A kernel's grid over (batch, head, block), in launch order: `blocks_first` puts the
    block axis first (it varies fastest as programs start); `reverse` numbers the blocks
    from the last (the query-block kernels: under a causal mask the last rows see the most
    keys, so they start first and the short ones fill the tail)."""

    batch: int
    heads: int
    blocks: int
    blocks_first: bool
    reverse: bool

    def shape(self) -> tuple[int, int, int]:
        if self.blocks_first:
            return self.blocks, self.batch, self.heads
        return self.batch, self.heads, self.blocks

    def _block(self, i):
        return self.blocks - 1 - i if self.reverse else i

    def block_id(self):
        """This program's block (inside a kernel)."""
        return self._block(pl.program_id(0 if self.blocks_first else 2))

    def index_map(self, f):
        """f(batch, head, block) -> block indices, as a BlockSpec index map of this grid."""
        if self.blocks_first:
            return lambda i, bi, hi: f(bi, hi, self._block(i))
        return lambda bi, hi, i: f(bi, hi, self._block(i))


def _specs(grid: Grid, t, s, h, kv, d, bq, bk, q_blocked: bool):
    """BlockSpecs over `grid`: the blocked side (queries, or keys for the dK/dV kernel) one
    block per program, the other side whole. The dK/dV grid runs over K/V heads: its
    programs see the whole group of query heads sharing one."""
    g, at = h // kv, grid.index_map
    if q_blocked:
        q = pl.BlockSpec((None, bq, None, d), at(lambda bi, hi, i: (bi, i, hi, 0)))
        kvs = pl.BlockSpec((None, s, None, d), at(lambda bi, hi, i: (bi, 0, hi // g, 0)))
        qs = pl.BlockSpec((None, bq), at(lambda bi, hi, i: (bi, i)))
        ks = pl.BlockSpec((None, s), at(lambda bi, hi, i: (bi, 0)))
        row = pl.BlockSpec((None, None, bq), at(lambda bi, hi, i: (bi, hi, i)))
    else:
        q = pl.BlockSpec((None, t, g, d), at(lambda bi, hi, j: (bi, 0, hi, 0)))
        kvs = pl.BlockSpec((None, bk, None, d), at(lambda bi, hi, j: (bi, j, hi, 0)))
        qs = pl.BlockSpec((None, t), at(lambda bi, hi, j: (bi, 0)))
        ks = pl.BlockSpec((None, bk), at(lambda bi, hi, j: (bi, j)))
        row = pl.BlockSpec((None, g, t), at(lambda bi, hi, j: (bi, hi, 0)))
    return q, kvs, qs, ks, row


def _forward(q, k, v, qs, ks, *, blocks: BlockSizes, causal: bool, segmented: bool,
             interpret: bool, out_dtype=None):  # fmt: skip
    b, t, h, d = q.shape
    s, kv = k.shape[1], k.shape[2]
    bq, bk = blocks.q, blocks.k
    grid = Grid(b, h, t // bq, blocks.blocks_first, reverse=blocks.blocks_first)
    qspec, kvspec, qsspec, ksspec, row = _specs(grid, t, s, h, kv, d, bq, bk, True)
    kernel = functools.partial(_fwd_kernel, scale=d**-0.5, bq=bq, bk=bk, causal=causal,
                               segmented=segmented, grid=grid)  # fmt: skip
    bounds = _bounds(qs, ks, bq, bk)
    return _call(
        kernel,
        grid.shape(),
        [qspec, kvspec, kvspec, qsspec, ksspec, qsspec, qsspec, qsspec],
        [qspec, row],
        [struct(q.shape, out_dtype or q.dtype, q, k), struct((b, h, t), jnp.float32, q, k)],
        interpret,
        "flash_attention_forward",
        blocks.launch(d, backward=False, itemsize=q.dtype.itemsize),
    )(q, k, v, qs, ks, bounds.first, bounds.q_lo, bounds.q_hi)


class Bounds(NamedTuple):
    """Per query (b, t) or key (b, s), repeated over its block: where its block's loop
    starts, ends, and runs bare. See `_bounds`."""

    first: jax.Array  # queries: the first key block the query block may see
    end: jax.Array  # keys: one past the last query block that may see the key block
    q_lo: jax.Array  # queries: [q_lo, q_hi) the key blocks wholly in its one document
    q_hi: jax.Array
    k_lo: jax.Array  # keys: [k_lo, k_hi) the query blocks wholly in its one document
    k_hi: jax.Array


def _bounds(qs, ks, bq, bk) -> Bounds:
    """Which blocks can see each other at all, and which pairs need no segment mask.

    first: every key block before it holds only segment ids below all of the query
    block's, so none can match. end: every later query block holds only ids above all of
    the key block's. [lo, hi): the blocks that hold one id only, the same as this block's
    one id: no score of such a pair is hidden by segments. Where those pairs do not form
    one run (ids in no rising order), the run is empty and every pair keeps its mask.
    With packed documents (ids rising along the row) the loops then skip the blocks of
    other documents and mask only the blocks at a document's edges; with none (or in any
    other order) they skip nothing and mask everything, never too little."""
    b, t = qs.shape
    s = ks.shape[1]
    q_blocks, k_blocks = qs.reshape(b, t // bq, bq), ks.reshape(b, s // bk, bk)
    q_min, q_max = q_blocks.min(axis=-1), q_blocks.max(axis=-1)  # (b, query blocks)
    k_min, k_max = k_blocks.min(axis=-1), k_blocks.max(axis=-1)  # (b, key blocks)
    sees = k_max[:, None, :] >= q_min[:, :, None]  # (b, query block, key block)
    n_q, n_k = sees.shape[1:]
    first = jnp.where(sees, jnp.arange(n_k), n_k).min(axis=2)
    end = jnp.where(sees, jnp.arange(1, n_q + 1)[:, None], 0).max(axis=1)
    one_q, one_k = (q_min == q_max)[:, :, None], (k_min == k_max)[:, None, :]
    pure = one_q & one_k & (q_min[:, :, None] == k_min[:, None, :])

    def run(axis, n):
        """[lo, hi) of the pure pairs along `axis` where they are one run, else (0, 0)."""
        idx = jnp.arange(n).reshape((n, 1) if axis == 1 else (n,))
        lo = jnp.where(pure, idx, n).min(axis=axis)
        hi = jnp.where(pure, idx + 1, 0).max(axis=axis)
        whole = pure.sum(axis=axis) == hi - lo
        return jnp.where(whole, lo, 0), jnp.where(whole, hi, 0)

    (q_lo, q_hi), (k_lo, k_hi) = run(2, n_k), run(1, n_q)
    per_q = lambda x: jnp.repeat(x, bq, axis=1)  # noqa: E731
    per_k = lambda x: jnp.repeat(x, bk, axis=1)  # noqa: E731
    return Bounds(per_q(first), per_k(end), per_q(q_lo), per_q(q_hi), per_k(k_lo), per_k(k_hi))


def _delta(o, do):
    """rowsum(dout * out) per query and head, (b, h, t) fp32: the backward's softmax term."""
    return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1).transpose(0, 2, 1)


def _backward(q, k, v, qs, ks, delta, lse, do, *, blocks: BlockSizes, causal: bool,
              segmented: bool, interpret: bool):  # fmt: skip
    b, t, h, d = q.shape
    s, kv = k.shape[1], k.shape[2]
    bq, bk = blocks.q_bwd, blocks.k_bwd
    common = dict(scale=d**-0.5, bq=bq, bk=bk, causal=causal, segmented=segmented)
    launch = blocks.launch(d, backward=True, itemsize=q.dtype.itemsize)
    bounds = _bounds(qs, ks, bq, bk)
    grid = Grid(b, kv, s // bk, blocks.blocks_first, reverse=False)  # causal: longest first
    qspec, kvspec, qsspec, ksspec, row = _specs(grid, t, s, h, kv, d, bq, bk, False)
    dkv = functools.partial(_dkv_kernel, group=h // kv, grid=grid, **common)
    args = (q, k, v, qs, ks, bounds.end, bounds.k_lo, bounds.k_hi, do, lse, delta)
    in_specs = [qspec, kvspec, kvspec, qsspec, ksspec, ksspec, ksspec, ksspec, qspec, row, row]
    dkv_shapes = [struct(k.shape, k.dtype, q, k), struct(v.shape, v.dtype, q, k)]
    if blocks.fused_bwd:  # one kernel: dQ's fp32 sum starts as zeros, aliased to its output
        dq32 = vary_like(jnp.zeros(q.shape, jnp.float32), q, k)
        dk, dv, dq = _call(dkv, grid.shape(), [*in_specs, qspec], [kvspec, kvspec, qspec],
                           [*dkv_shapes, struct(q.shape, jnp.float32, q, k)], interpret,
                           "flash_attention_bwd", launch, aliases={len(args): 2},
                           )(*args, dq32)  # fmt: skip
        return (dq * common["scale"]).astype(q.dtype), dk, dv
    dk, dv = _call(dkv, grid.shape(), in_specs, [kvspec, kvspec], dkv_shapes, interpret,
                   "flash_attention_dkv", launch)(*args)  # fmt: skip
    grid = Grid(b, h, t // bq, blocks.blocks_first, reverse=blocks.blocks_first)
    qspec, kvspec, qsspec, ksspec, row = _specs(grid, t, s, h, kv, d, bq, bk, True)
    dq = _call(
        functools.partial(_dq_kernel, grid=grid, **common),
        grid.shape(),
        [qspec, kvspec, kvspec, qsspec, ksspec, qsspec, qsspec, qsspec, qspec, row, row],
        qspec,
        struct(q.shape, q.dtype, q, k),
        interpret,
        "flash_attention_dq",
        launch,
    )(q, k, v, qs, ks, bounds.first, bounds.q_lo, bounds.q_hi, do, lse, delta)
    return dq, dk, dv


_OPERANDS = ("q", "kv", "kv", "ids", "ids")  # q, k, v, their segment ids: `per_device`'s kinds


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _flash(q, k, v, qs, ks, blocks, flags, saved_as, per_device):
    return _flash_fwd(q, k, v, qs, ks, blocks, flags, saved_as, per_device)[0]


def _flash_fwd(q, k, v, qs, ks, blocks, flags, saved_as, per_device):
    forward = functools.partial(_forward, blocks=blocks, **flags._asdict())
    if per_device is not None:
        forward = per_device(forward, _OPERANDS, ("q", "rows"))
    o, lse = forward(q, k, v, qs, ks)
    if saved_as is not None:  # what a remat policy that keeps the name keeps
        o, lse = checkpoint_name(o, saved_as), checkpoint_name(lse, saved_as)
    return (o, lse), (q, k, v, qs, ks, o, lse)


def _flash_bwd(blocks, flags, saved_as, per_device, res, cts):
    q, k, v, qs, ks, o, lse = res
    do, _ = cts  # the log-sum-exp output is for merging blocks; its gradient is not used
    backward = functools.partial(_backward, blocks=blocks, **flags._asdict())
    if per_device is not None:
        backward = per_device(backward, (*_OPERANDS, "rows", "rows", "q"), ("q", "kv", "kv"))
    return (*backward(q, k, v, qs, ks, _delta(o, do), lse, do), None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)


class Flags(NamedTuple):
    """The kernels' static switches: causal masking by index, and whether segment ids
    mask anything (packed documents, or padding that a query could otherwise see)."""

    causal: bool
    segmented: bool
    interpret: bool


def flash_attention(
    q,
    k,
    v,
    q_segment_ids=None,
    kv_segment_ids=None,
    *,
    causal: bool = True,
    blocks: BlockSizes | None = None,
    interpret: bool = False,
    saved_as: str | None = None,
    per_device=None,
):
    """(out (batch, length, heads, head_dim), lse (batch, length, heads), natural log).

    Differentiable in q, k, v (the lse's own gradient is not propagated: callers that
    merge blocks use it for weights only). `blocks` None: `BlockSizes.of` the head_dim.
    `saved_as`: a `checkpoint_name` for the out and lse the backward reads: a remat policy
    that keeps it runs no forward kernel again in the backward pass.
    `per_device`: (fn, operand kinds, result kinds) -> fn on each device's part, in which
    the forward and backward kernels each run ("rows": (b, h, t); parallel/context.py)."""
    attention_inputs.check(q, k, v, q_segment_ids, kv_segment_ids)
    b, t, h, d = q.shape
    s = k.shape[1]
    blocks = BlockSizes.of(None, d, q.dtype.itemsize) if blocks is None else blocks
    step = math.lcm(blocks.q, blocks.q_bwd, blocks.k, blocks.k_bwd)
    # without segment ids, padding needs no mask where causal masking already hides the
    # padded keys from every real query (they come after all of them)
    padded = (s % step) > 0
    segmented = q_segment_ids is not None or (padded and (not causal or t > s))
    qp, kp, vp, qs, ks = attention_inputs.pad(q, k, v, q_segment_ids, kv_segment_ids, step)
    flags = Flags(causal, segmented, interpret)
    o, lse = _flash(qp, kp, vp, qs, ks, blocks, flags, saved_as, per_device)
    return o[:, :t], lse[:, :, :t].transpose(0, 2, 1)


def pair_forward(q, k, v, q_segment_ids, kv_segment_ids, *, causal: bool,
                 blocks: BlockSizes | None = None, interpret: bool = False):  # fmt: skip
    """(out fp32, lse (batch, heads, length)) of queries against one block of keys,
    lengths already multiples of the block sizes: the per-pair kernel of ring attention
    (ultrajax/parallel/context.py), which merges pairs with their log-sum-exp. The
    output stays fp32 for that merge (rounded to bf16 per pair, its error would grow
    with the number of pairs). Not differentiable by itself: the ring's backward calls
    `pair_backward`."""
    blocks = BlockSizes.of(None, q.shape[-1], q.dtype.itemsize) if blocks is None else blocks
    attention_inputs.check_pair(q, k, blocks)
    return _forward(q, k, v, q_segment_ids, kv_segment_ids, blocks=blocks, causal=causal,
                    segmented=True, interpret=interpret, out_dtype=jnp.float32)  # fmt: skip


def pair_backward(q, k, v, q_segment_ids, kv_segment_ids, lse, delta, do, *, causal: bool,
                  blocks: BlockSizes | None = None, interpret: bool = False):  # fmt: skip
    """This pair's (dq, dk, dv), from the log-sum-exp over every pair and delta =
    rowsum(dout * out), both (b, h, t) and computed once by the caller (the flash
    backward recomputes the pair's probabilities from them)."""
    blocks = BlockSizes.of(None, q.shape[-1], q.dtype.itemsize) if blocks is None else blocks
    attention_inputs.check_pair(q, k, blocks)
    return _backward(q, k, v, q_segment_ids, kv_segment_ids, delta, lse, do, blocks=blocks,
                     causal=causal, segmented=True, interpret=interpret)  # fmt: skip
