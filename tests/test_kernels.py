"""Fused kernels against their plain-jnp references, on fresh random inputs.

Pallas kernels run on the CPU with `interpret=True` (the same kernel code, interpreted);
small shapes and blocks, so that several blocks, a partial last block and every mask
case are exercised in seconds.
"""

import dataclasses
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ultrajax.kernels.flash_attention import BlockSizes, flash_attention
from ultrajax.model.attention import xla

BLOCKS = BlockSizes(q=16, k=16, q_bwd=8, k_bwd=16)


def reference(q, k, v, q_segment_ids=None, kv_segment_ids=None, causal=True):
    """The one plain-jnp attention (ultrajax/model/attention/xla.py) in the kernel's
    conventions: the output in q's dtype, the log-sum-exp as (batch, length, heads)."""
    o, lse = xla.reference(q, k, v, q_segment_ids, kv_segment_ids, causal=causal)
    return o.astype(q.dtype), lse.transpose(0, 2, 1)


def inputs(b, t, h, kv, d, dtype, seed, packed=True):
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.standard_normal((b, t, n, d)), dtype) for n in (h, kv, kv))
    seg = np.ones((b, t), np.int32)
    if packed:  # two documents per row, a boundary inside a block, padding at the end
        for row in range(b):
            cut = int(rng.integers(3, t - 6))
            seg[row, cut:] = 2
            seg[row, t - 4 :] = 0
    return q, k, v, jnp.asarray(seg)


def grads(fn, q, k, v, seg, do):
    loss = lambda q, k, v: jnp.sum(fn(q, k, v)[0].astype(jnp.float32) * do)  # noqa: E731
    return jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v)


CASES = {  # (batch, length, heads, kv_heads, head_dim, packed)
    "packed-gqa4": (2, 40, 4, 1, 16, True),  # 40: not a multiple of the blocks
    "packed-mha": (1, 32, 2, 2, 8, True),
    "causal-gqa2": (2, 24, 4, 2, 16, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_flash_attention_matches_reference_fp32(case):
    b, t, h, kv, d, packed = CASES[case]
    q, k, v, seg = inputs(b, t, h, kv, d, jnp.float32, seed=len(case), packed=packed)
    seg_args = (seg, seg) if packed else (None, None)

    def kernel(q, k, v):
        return flash_attention(q, k, v, *seg_args, blocks=BLOCKS, interpret=True)

    def ref(q, k, v):
        return reference(q, k, v, *seg_args)

    o, lse = kernel(q, k, v)
    ro, rlse = ref(q, k, v)
    assert np.isfinite(np.asarray(o)).all() and np.isfinite(np.asarray(lse)).all()
    np.testing.assert_allclose(o, ro, atol=2e-6, rtol=2e-5)
    np.testing.assert_allclose(lse, rlse, atol=2e-6, rtol=2e-6)
    do = jnp.asarray(np.random.default_rng(7).standard_normal(o.shape), jnp.float32)
    for got, want, name in zip(grads(kernel, q, k, v, seg, do), grads(ref, q, k, v, seg, do),
                               "qkv", strict=True):  # fmt: skip
        assert np.abs(np.asarray(want)).max() > 0
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-4, err_msg=f"d{name}")


def test_flash_attention_bf16_within_bf16_tolerance():
    q, k, v, seg = inputs(2, 32, 4, 2, 16, jnp.bfloat16, seed=3)
    o, lse = flash_attention(q, k, v, seg, seg, blocks=BLOCKS, interpret=True)
    ro, rlse = reference(*(x.astype(jnp.float32) for x in (q, k, v)), seg, seg)
    assert o.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    assert np.isfinite(np.asarray(o, np.float32)).all()
    np.testing.assert_allclose(np.asarray(o, np.float32), ro, atol=3e-2, rtol=3e-2)
    np.testing.assert_allclose(lse, rlse, atol=3e-2, rtol=1e-2)
    do = jnp.ones(o.shape, jnp.float32)
    got = grads(lambda *a: flash_attention(*a, seg, seg, blocks=BLOCKS, interpret=True),
                q, k, v, seg, do)  # fmt: skip
    want = grads(lambda *a: reference(*(x.astype(jnp.float32) for x in a), seg, seg),
                 q, k, v, seg, do)  # fmt: skip
    for g, w in zip(got, want, strict=True):
        assert np.isfinite(np.asarray(g, np.float32)).all()
        scale = np.abs(np.asarray(w)).max()
        np.testing.assert_allclose(np.asarray(g, np.float32), w, atol=3e-2 * scale)


def test_rows_with_nothing_to_attend_to_give_zeros_not_nan():
    """Not causal, and queries of a segment no key has: no visible key at all."""
    q, k, v, seg = inputs(1, 16, 2, 1, 8, jnp.float32, seed=5, packed=False)
    q_seg = seg.at[:, :5].set(9)  # no key is in segment 9
    o, lse = flash_attention(q, k, v, q_seg, seg, causal=False, blocks=BLOCKS, interpret=True)
    assert not np.isnan(np.asarray(o)).any()
    np.testing.assert_array_equal(np.asarray(o[:, :5]), 0.0)
    assert np.isneginf(np.asarray(lse[:, :5])).all()
    ro, _ = reference(q, k, v, q_seg, seg, causal=False)
    np.testing.assert_allclose(o[:, 5:], ro[:, 5:], atol=2e-6)
    g = jax.grad(lambda q: flash_attention(q, k, v, q_seg, seg, causal=False, blocks=BLOCKS,
                                           interpret=True)[0].sum())(q)  # fmt: skip
    assert not np.isnan(np.asarray(g)).any()
    np.testing.assert_array_equal(np.asarray(g[:, :5]), 0.0)


def test_blocks_of_other_documents_are_skipped_and_nothing_else():
    """Three documents in a row of 64 (tiles of 16): the loops start and end at the blocks
    that can share a document, only pairs of blocks wholly in one document run without
    the segment mask, and the result (output, lse, gradients) is unchanged."""
    from ultrajax.kernels.flash_attention import _bounds

    def blocks(x):  # one value per block of 16
        return np.asarray(x)[0, ::16].tolist()

    seg = np.concatenate([np.full(20, 1), np.full(25, 2), np.full(15, 3), np.zeros(4)])
    seg = jnp.asarray(np.stack([seg, np.ones(64)]).astype(np.int32))  # row 2: one document
    got = _bounds(seg, seg, 16, 16)
    # query blocks' smallest ids 1, 1, 2, 0 (padding); key blocks' largest 1, 2, 2, 3
    assert blocks(got.first) == [0, 0, 1, 0]
    assert blocks(got.end) == [4, 4, 4, 4]  # padding last: no end skip
    assert np.asarray(got.first)[1].tolist() == [0] * 64
    # only block 0 holds one id: the pair (0, 0) alone is bare
    assert (blocks(got.q_lo), blocks(got.q_hi)) == ([0] * 4, [1, 0, 0, 0])
    assert (blocks(got.k_lo), blocks(got.k_hi)) == ([0] * 4, [1, 0, 0, 0])
    assert np.asarray(got.q_hi)[1].tolist() == [4] * 64  # one document: all bare
    rising = jnp.asarray(np.repeat([[1, 1, 2, 3]], 16, axis=1), jnp.int32)  # no padding
    got = _bounds(rising, rising, 16, 16)
    assert (blocks(got.first), blocks(got.end)) == ([0, 0, 2, 3], [2, 2, 3, 4])
    assert (blocks(got.q_lo), blocks(got.q_hi)) == ([0, 0, 2, 3], [2, 2, 3, 4])
    assert (blocks(got.k_lo), blocks(got.k_hi)) == ([0, 0, 2, 3], [2, 2, 3, 4])
    falling = rising[:, ::-1]  # nothing can be skipped, and nothing is
    got = _bounds(falling, falling, 16, 16)
    assert (blocks(got.first), blocks(got.end)) == ([0] * 4, [4] * 4)
    apart = jnp.asarray(np.repeat([[1, 2, 1, 1]], 16, axis=1), jnp.int32)
    got = _bounds(apart, apart, 16, 16)  # id 1's blocks 0, 2, 3 are no one run: all masked
    assert (blocks(got.q_lo), blocks(got.q_hi)) == ([0, 1, 0, 0], [0, 2, 0, 0])
    q, k, v, _ = inputs(2, 64, 4, 2, 8, jnp.float32, seed=9, packed=False)
    blocks = BlockSizes(16, 16, 16, 16)
    o, lse = flash_attention(q, k, v, seg, seg, blocks=blocks, interpret=True)
    ro, rlse = reference(q, k, v, seg, seg)
    np.testing.assert_allclose(o, ro, atol=2e-6, rtol=2e-5)
    np.testing.assert_allclose(lse, rlse, atol=2e-6, rtol=2e-6)
    do = jnp.asarray(np.random.default_rng(1).standard_normal(o.shape), jnp.float32)
    kernel = lambda q, k, v: flash_attention(q, k, v, seg, seg, blocks=blocks, interpret=True)
    got = grads(kernel, q, k, v, seg, do)
    want = grads(lambda q, k, v: reference(q, k, v, seg, seg), q, k, v, seg, do)
    for g, w, name in zip(got, want, "qkv", strict=True):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-4, err_msg=f"d{name}")


@pytest.mark.parametrize("case", ["packed-gqa4", "causal-gqa2"])
def test_one_kernel_backward_equals_the_two_kernels(case):
    """model.attention_backward=fused: dK/dV's kernel also adds each block's dQ share into
    an fp32 sum, from the same probabilities. Interpreted, the adds come in the split dQ
    kernel's order (key blocks rising), so the two agree to fp32 rounding; both against
    the reference as in the fp32 test, and bf16 within bf16's tolerance."""
    b, t, h, kv, d, packed = CASES[case]
    fused = dataclasses.replace(BLOCKS, fused_bwd=True)
    for dtype in (jnp.float32, jnp.bfloat16):
        q, k, v, seg = inputs(b, t, h, kv, d, dtype, seed=11, packed=packed)
        seg_args = (seg, seg) if packed else (None, None)
        do = jnp.asarray(np.random.default_rng(2).standard_normal(q.shape), jnp.float32)

        def kernel(q, k, v, blocks, seg_args=seg_args):
            return flash_attention(q, k, v, *seg_args, blocks=blocks, interpret=True)

        def f32(q, k, v, seg_args=seg_args):
            return reference(*(x.astype(jnp.float32) for x in (q, k, v)), *seg_args)

        got = grads(functools.partial(kernel, blocks=fused), q, k, v, seg, do)
        split = grads(functools.partial(kernel, blocks=BLOCKS), q, k, v, seg, do)
        want = grads(f32, q, k, v, seg, do)
        for g, sp, w, name in zip(got, split, want, "qkv", strict=True):
            g, sp = np.asarray(g, np.float32), np.asarray(sp, np.float32)
            assert np.isfinite(g).all(), name
            scale = np.abs(np.asarray(w)).max()
            assert scale > 0
            if dtype == jnp.float32:  # one rounding per add, a few adds per element
                np.testing.assert_allclose(g, sp, atol=8 * np.finfo(np.float32).eps * scale)
                np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-4, err_msg=f"d{name}")
            else:
                np.testing.assert_allclose(g, w, atol=3e-2 * scale, err_msg=f"d{name}")


def test_the_grid_order_changes_no_value():
    """BlockSizes.blocks_first (blocks fastest, query blocks numbered from the last)
    against batch and head fastest: each program computes the same block either way, and
    the one-kernel backward's dQ adds come in the same key-block order per row, so out,
    lse and every gradient agree (packed documents, GQA 4:1, causal). Bit for bit on the
    CPU this was written on; the bound is a few fp32 roundings of the largest magnitude,
    as XLA:CPU may fuse the two interpreted programs' loops apart on another CPU."""
    b, t, h, kv, d, _ = CASES["packed-gqa4"]
    q, k, v, seg = inputs(b, t, h, kv, d, jnp.float32, seed=5)
    do = jnp.asarray(np.random.default_rng(3).standard_normal(q.shape), jnp.float32)
    for fused in (False, True):
        runs = []
        for first in (True, False):
            blocks = dataclasses.replace(BLOCKS, fused_bwd=fused, blocks_first=first)
            fn = functools.partial(flash_attention, q_segment_ids=seg, kv_segment_ids=seg,
                                   blocks=blocks, interpret=True)  # fmt: skip
            runs.append([*fn(q, k, v), *grads(fn, q, k, v, seg, do)])
        for got, want, name in zip(*runs, ("out", "lse", "dq", "dk", "dv"), strict=True):
            got, want = np.asarray(got), np.asarray(want)
            assert np.isfinite(got).all(), name
            scale = np.abs(np.where(np.isfinite(want), want, 0)).max()
            np.testing.assert_allclose(got, want, rtol=0, atol=4 * np.finfo(np.float32).eps * scale,
                                       err_msg=f"{name}, fused={fused}")  # fmt: skip


@pytest.mark.parametrize(
    "blocks",
    [
        BlockSizes.of(None, 64),
        BlockSizes(64, 64, 32, 64, warps=8, stages=3),
        BlockSizes.of(None, 64, fused_bwd=True),
    ],
    ids=["tuned", "given", "fused"],
)
def test_kernels_lower_to_triton_for_a_gpu(blocks):
    """What the interpreter cannot show: forward, dQ and dK/dV (or the one backward, with
    its atomic adds) go through Pallas's Triton lowering for a GPU (lowered here for the
    cuda platform, not compiled): bf16, GQA 4:1, packed documents, a length that is not a
    multiple of the tiles."""
    q = jax.ShapeDtypeStruct((1, 200, 4, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 200, 1, 64), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((1, 200), jnp.int32)

    def grads(q, k, v, seg):
        def loss(q, k, v):
            o, _ = flash_attention(q, k, v, seg, seg, blocks=blocks, interpret=False)
            return jnp.sum(o.astype(jnp.float32))

        return jax.grad(loss, (0, 1, 2))(q, k, v)

    text = jax.jit(grads).trace(q, kv, kv, seg).lower(lowering_platforms=("cuda",)).as_text()
    names = ("forward", "bwd") if blocks.fused_bwd else ("forward", "dq", "dkv")
    for name in ("forward", "dq", "dkv", "bwd"):
        assert (f'name = "flash_attention_{name}"' in text) == (name in names), name
    assert ("atomic_rmw" in text) == blocks.fused_bwd  # dQ's adds, in the Triton IR
    # each launch's grid puts the blocks first (blocks_first), then batch, then heads
    found = re.findall(r"grid_x = (\d+) : i32, grid_y = (\d+) : i32, grid_z = (\d+)", text)
    step = math.lcm(blocks.q, blocks.k, blocks.q_bwd, blocks.k_bwd)
    t = -(-200 // step) * step  # the padded length
    want = {(t // blocks.q, 1, 4), (t // blocks.k_bwd, 1, 1)}  # forward; dK/dV over K/V heads
    want |= set() if blocks.fused_bwd else {(t // blocks.q_bwd, 1, 4)}  # dQ
    assert {tuple(map(int, g)) for g in found} == want, found
    for backward in (False, True):
        warps, stages = blocks.launch(64, backward)
        assert f"num_warps = {warps}" in text and f"num_stages = {stages}" in text


def test_not_causal_without_segment_ids_masks_the_padding_only():
    """No segment ids and a length that is not a multiple of the tiles, not causal: the
    padded keys are the only ones hidden (causal masking cannot hide them here)."""
    q, k, v, _ = inputs(2, 20, 4, 2, 8, jnp.float32, seed=11, packed=False)

    def kernel(q, k, v):
        return flash_attention(q, k, v, causal=False, blocks=BLOCKS, interpret=True)

    o, lse = kernel(q, k, v)
    ro, rlse = reference(q, k, v, causal=False)
    np.testing.assert_allclose(o, ro, atol=2e-6, rtol=2e-5)
    np.testing.assert_allclose(lse, rlse, atol=2e-6, rtol=2e-6)
    do = jnp.asarray(np.random.default_rng(2).standard_normal(o.shape), jnp.float32)
    want = grads(lambda q, k, v: reference(q, k, v, causal=False), q, k, v, None, do)
    for g, w, name in zip(grads(kernel, q, k, v, None, do), want, "qkv", strict=True):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-4, err_msg=f"d{name}")


def test_negative_segment_ids_and_inputs_that_do_not_fit_each_other():
    """Padding got the fixed ids -2 (queries) and -1 (keys): a real query of segment -1
    attended to the zero-filled padded keys (lse off by 0.49). Padding's ids are now
    below every real one. Inputs that do not fit each other are refused: a short id row
    or a smaller value head_dim came back as zeros, no kv ids as a traceback."""
    q, k, v, _ = inputs(1, 20, 2, 2, 8, jnp.float32, seed=12, packed=False)
    seg = jnp.full((1, 20), -1, jnp.int32)
    o, lse = flash_attention(q, k, v, seg, seg, causal=False, blocks=BLOCKS, interpret=True)
    ro, rlse = reference(q, k, v, seg, seg, causal=False)
    np.testing.assert_allclose(o, ro, atol=2e-6, rtol=2e-5)
    np.testing.assert_allclose(lse, rlse, atol=2e-6, rtol=2e-6)
    ones = jnp.ones((1, 20), jnp.int32)
    bad = {
        "k .* and v .* must have one shape": (q, k, v[:, :16], ones, ones),
        "batch and head_dim must agree": (q, k[..., :4], v[..., :4], ones, ones),
        "segment ids .* must be": (q, k, v, ones[:, :16], ones),
        "give both or neither": (q, k, v, ones, None),
        "an empty sequence": (q[:, :0], k, v, None, None),
    }
    for said, args in bad.items():
        with pytest.raises(ValueError, match=said):
            flash_attention(*args, causal=False, blocks=BLOCKS, interpret=True)
    from ultrajax.kernels.flash_attention import pair_forward

    with pytest.raises(ValueError, match="multiples of the tiles"):
        pair_forward(q, k, v, ones, ones, causal=False, blocks=BLOCKS, interpret=True)


def test_tiles_warps_and_stages_follow_the_head_dim_and_the_dtype():
    """The measured table where it has the tile (bf16), the register rule where it has
    not, and fp32 inputs on 64-wide tiles with at most 2 stages (128-wide fp32 tiles asked
    for more shared memory than an H200 has: 262,656 of 232,448 bytes, seen in the sweep)."""
    from ultrajax.kernels.flash_attention import TUNED_BWD, TUNED_FWD

    b64, b128 = BlockSizes.of(None, 64), BlockSizes.of(None, 128)
    assert (b64.q, b64.k, b128.q, b128.k) == (128, 64, 128, 128)
    assert b64.launch(64, backward=False) == TUNED_FWD[64, 128, 64]
    assert b128.launch(128, backward=True) == TUNED_BWD[128, 64, 64]
    assert BlockSizes(32, 32, 32, 32).launch(128, backward=False) == (4, 2)  # off the table
    fp32 = BlockSizes.of(None, 128, itemsize=4)
    assert (fp32.q, fp32.k, fp32.q_bwd, fp32.k_bwd) == (64, 64, 64, 64)
    assert fp32.launch(128, backward=False, itemsize=4)[1] <= 2
    assert BlockSizes(warps=2, stages=5).launch(64, backward=False) == (2, 5)  # as asked


def test_ring_pairs_keep_their_output_in_fp32_for_the_merge():
    """pair_forward hands ring attention an fp32 output (a bf16 one would be rounded once
    per pair before the merge). From bf16 inputs its only rounding is the probabilities'
    to bf16 before the value matmul (as in the jnp reference): each within 2^-9 of
    itself, so the output within 2^-9 · max|v| of the fp32 reference (bounded here by
    2^-8 for fp32 accumulation), NaN never."""
    from ultrajax.kernels.flash_attention import pair_forward

    q, k, v, seg = inputs(1, 32, 4, 2, 16, jnp.bfloat16, seed=13)
    o, _ = pair_forward(q, k, v, seg, seg, causal=True, blocks=BLOCKS, interpret=True)
    assert o.dtype == jnp.float32
    ro, _ = reference(*(x.astype(jnp.float32) for x in (q, k, v)), seg, seg)
    err = np.abs(np.asarray(o) - np.asarray(ro, np.float32))
    bound = 2.0**-8 * float(np.abs(np.asarray(v, np.float32)).max())
    assert np.isfinite(err).all() and err.max() <= bound, (err.max(), bound)
