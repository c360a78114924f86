"""model/grouped.py: the grouped matmul over blocks of rows and its weight gradient against
jax's ragged_dot and its transpose (fp32, fresh random inputs), on the cases a router
makes: empty groups, one group holding every row, rows past the groups (expert
parallelism's padded slots), blocks smaller and larger than the groups. Zero bubble's
split of the experts' matmul (model/ops.py `Deferred`) gives the ordinary rule's gradient."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ultrajax.model import grouped, ops


def _case(rows, groups, sizes, k=12, n=20, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(rows, k)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(groups, k, n)), jnp.float32)
    g = jnp.asarray(rng.normal(size=(rows, n)), jnp.float32)
    return x, w, g, jnp.asarray(sizes, jnp.int32)


CASES = {
    "random": (96, 8, np.bincount(np.random.default_rng(1).integers(0, 8, 96), minlength=8)),
    "empty groups": (64, 5, [0, 30, 0, 34, 0]),
    "one group": (40, 4, [0, 0, 40, 0]),
    "rows past the groups": (50, 3, [7, 0, 21]),
}


@pytest.mark.parametrize("block", [None, 32])
@pytest.mark.parametrize("name", list(CASES))
def test_blocks_give_ragged_dot_and_its_weight_gradient(name, block):
    rows, groups, sizes = CASES[name]
    x, w, g, sizes = _case(rows, groups, sizes)
    want = jax.lax.ragged_dot(x, w, sizes)
    got = grouped.matmul(x, w, sizes, block=block)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))
    assert not np.any(np.asarray(got)[int(sizes.sum()) :])  # rows past the groups: zeros
    (dw_want,) = jax.vjp(lambda w: jax.lax.ragged_dot(x, w, sizes), w)[1](g)
    dw = grouped.weight_gradient(x, g, sizes, groups, block=block)
    scale = float(jnp.abs(dw_want).max())
    np.testing.assert_allclose(dw, dw_want, rtol=1e-5, atol=1e-5 * scale)


def test_the_block_keeps_the_padding_under_the_rows():
    """Padding is under one block a group: the block is at most half the mean group's
    rows (8 at least, MAX_BLOCK at most), so the rows multiplied stay under twice the
    real ones once groups hold 16 rows on average."""
    assert grouped.block_rows(4096, 8) == grouped.MAX_BLOCK
    assert grouped.block_rows(128, 8) == 8
    for rows, groups in [(256, 8), (1000, 4), (4096, 64)]:
        b = grouped.block_rows(rows, groups)
        assert 8 <= b <= grouped.MAX_BLOCK and groups * (b - 1) <= rows


@pytest.mark.parametrize("impl", ["ragged", "blocked"])
def test_deferred_weight_gradient_is_the_ordinary_rules(impl):
    """A deferred expert weight's backward hands out (x, cotangent, sizes as fp32) as its
    pair and gives the same input gradient; W's gradient from the pair is the ordinary
    rule's (zero bubble with MoE, parallel/pipeline/stage.py). An empty group and padded
    rows: the router's cases W must keep."""
    rows, groups, sizes = CASES["rows past the groups"]
    x, w, g, sizes = _case(rows, groups, sizes)
    sink, red = jnp.zeros(w.shape, jnp.float32), ops.Reduce()

    def ordinary(x, sink):
        return ops.ragged_dense(x, ops.Weight.make(w, sink, None, red), sizes, impl)

    dx_want, dw_want = jax.vjp(ordinary, x, sink)[1](g)
    defer = ops.Deferred()
    split = ops.Reduce(defer=defer)
    jax.eval_shape(lambda: ops.ragged_dense(x, ops.Weight.make(w, sink, None, split), sizes, impl))
    assert defer.seen[0] == ("ragged", impl, groups)

    def deferred(x, pair):
        return ops.ragged_dense(x, ops.Weight.make(w, sink, pair, split), sizes, impl)

    dx, pair = jax.vjp(deferred, x, defer.zeros())[1](g)
    np.testing.assert_array_equal(pair[2], sizes)  # exact in fp32
    np.testing.assert_allclose(dx, dx_want, rtol=1e-6)
    dw = defer.weight_gradient(pair, dataclasses.replace(red, shape=w.shape))
    np.testing.assert_allclose(dw, dw_want, rtol=1e-6, atol=1e-6 * float(jnp.abs(dw_want).max()))
