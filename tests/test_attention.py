"""attention.xla_attention against a naive per-head reference (GQA, causal, segments)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ultrajax.model.attention import backends as attention
from ultrajax.model.attention import blocked as blocked_lib
from ultrajax.model.attention import tiled as tiled_lib
from ultrajax.model.attention import xla as xla_lib

xla = jax.jit(xla_lib.xla_attention)  # one compile per shape, not one per op


def naive_attention(q, k, v, segment_ids=None):
    """One query head at a time in float64 numpy; query head i reads kv head i // group
    (Hugging Face's repeat_kv layout)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    b, t, h, d = q.shape
    group = h // k.shape[2]
    out = np.zeros_like(q)
    for bi in range(b):
        for hi in range(h):
            kh = hi // group
            for i in range(t):
                allowed = [
                    j
                    for j in range(i + 1)
                    if segment_ids is None or segment_ids[bi, j] == segment_ids[bi, i]
                ]
                scores = np.array([q[bi, i, hi] @ k[bi, j, kh] for j in allowed]) / np.sqrt(d)
                p = np.exp(scores - scores.max())
                p /= p.sum()
                out[bi, i, hi] = sum(pj * v[bi, j, kh] for pj, j in zip(p, allowed, strict=True))
    return out


def _qkv(seed, b=2, t=12, h=4, kv=2, d=8):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, t, h, d)).astype(np.float32)
    k = rng.standard_normal((b, t, kv, d)).astype(np.float32)
    v = rng.standard_normal((b, t, kv, d)).astype(np.float32)
    return q, k, v


SEGMENTS = np.array(
    [
        [1, 1, 1, 1, 1, 2, 2, 2, 3, 3, 3, 3],
        [1, 1, 1, 1, 1, 1, 1, 2, 2, 0, 0, 0],  # padding (segment 0) at the end
    ],
    np.int32,
)


@pytest.mark.parametrize("h, kv", [(4, 2), (4, 1), (4, 4)])
def test_xla_matches_naive_causal(h, kv):
    q, k, v = _qkv(seed=h * 10 + kv, h=h, kv=kv)
    got = xla(q, k, v)
    np.testing.assert_allclose(np.asarray(got), naive_attention(q, k, v), rtol=1e-5, atol=1e-5)


def test_xla_matches_naive_with_segments_and_gqa():
    q, k, v = _qkv(seed=7)
    got = np.asarray(xla(q, k, v, jnp.asarray(SEGMENTS)))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, naive_attention(q, k, v, SEGMENTS), rtol=1e-5, atol=1e-5)
    # the segment mask matters: plain causal attention gives something else
    plain = naive_attention(q, k, v)
    assert np.abs(got - plain).max() > 1e-2


def test_gqa_grouping_is_repeat_interleave():
    """Query heads 0,1 share kv head 0 and heads 2,3 share kv head 1 (not 0,2 / 1,3)."""
    q, k, v = _qkv(seed=3, h=4, kv=2)
    k_full = np.repeat(k, 2, axis=2)
    v_full = np.repeat(v, 2, axis=2)
    gqa = np.asarray(xla(q, k, v))
    mha = np.asarray(xla(q, k_full, v_full))
    np.testing.assert_allclose(gqa, mha, rtol=1e-6, atol=1e-6)


def test_all_ones_segments_equal_plain_causal():
    q, k, v = _qkv(seed=5)
    ones = jnp.ones(q.shape[:2], jnp.int32)
    np.testing.assert_allclose(
        np.asarray(xla(q, k, v, ones)),
        np.asarray(xla(q, k, v)),
        rtol=1e-6,
        atol=1e-6,
    )


def test_padding_rows_give_no_nan_in_values_or_gradients():
    q, k, v = _qkv(seed=11)
    seg = SEGMENTS.copy()
    seg[1] = 0  # a row made entirely of padding

    def f(q, k, v):
        return jnp.sum(xla_lib.xla_attention(q, k, v, jnp.asarray(seg)) ** 2)

    out = xla(q, k, v, jnp.asarray(seg))
    grads = jax.jit(jax.grad(f, argnums=(0, 1, 2)))(q, k, v)
    assert np.isfinite(np.asarray(out)).all()
    for g in grads:
        assert np.isfinite(np.asarray(g)).all()


def test_mask_is_causal_and_segment_local():
    seg = jnp.asarray([[1, 1, 2, 2, 0]])
    m = np.asarray(xla_lib.mask(seg, 5))
    assert m.shape == (1, 1, 5, 5)
    expected = np.array(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [0, 0, 1, 0, 0],
            [0, 0, 1, 1, 0],
            [0, 0, 0, 0, 1],
        ],
        bool,
    )
    np.testing.assert_array_equal(m[0, 0], expected)
    np.testing.assert_array_equal(
        np.asarray(xla_lib.mask(None, 3))[0, 0], np.tril(np.ones((3, 3), bool))
    )


def test_bf16_inputs_close_to_fp32():
    q, k, v = _qkv(seed=13)
    ref = naive_attention(q, k, v, SEGMENTS)
    got = xla(*(jnp.asarray(a, jnp.bfloat16) for a in (q, k, v)), jnp.asarray(SEGMENTS))
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), ref, rtol=0.05, atol=0.05)


def test_dispatch_routes_and_rejects_unknown():
    q, k, v = _qkv(seed=17)
    np.testing.assert_array_equal(
        np.asarray(jax.jit(attention.attend)(q, k, v)),
        np.asarray(xla(q, k, v)),
    )
    with pytest.raises(ValueError, match="model.attention"):
        attention.attend(q, k, v, implementation="flash9000")


def test_mask_with_query_offset_is_the_tail_of_the_causal_mask():
    """Decoding against a KV cache: queries at offset 3 of 5 keys see keys 0..3 and 0..4."""
    m = np.asarray(xla_lib.mask(None, 2, 5, q_offset=3))[0, 0]
    np.testing.assert_array_equal(m, np.tril(np.ones((5, 5), bool))[3:])


def test_attention_with_offset_equals_the_last_rows_of_full_attention():
    rng = np.random.default_rng(7)
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in [(1, 6, 4, 8)] * 3)
    k, v = k[:, :, :2], v[:, :, :2]  # GQA: 2 kv heads
    full = attention.attend(q, k, v)
    tail = attention.attend(q[:, 4:], k, v, q_offset=4)
    np.testing.assert_allclose(tail, full[:, 4:], rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------- the interface


def test_auto_resolves_from_the_table():
    assert attention.resolve("auto", "cpu", packed=True) == "blocked"
    assert attention.resolve("auto", "cpu", packed=True, seq_len=blocked_lib.BLOCK) == "tiled"
    assert attention.resolve("auto", "cpu", packed=True, seq_len=4 * blocked_lib.BLOCK) == "blocked"
    assert attention.resolve("auto", "gpu", packed=False) == "cudnn"
    assert attention.resolve("auto", "gpu", packed=True) == "pallas"  # no dense mask
    assert attention.resolve("xla", "gpu", packed=True) == "xla"
    for name, backend in attention.BACKENDS.items():
        assert backend.name == name
        assert (attention.problem(name, "cpu") is not None) == backend.gpu_only
        assert attention.problem(name, "gpu") is None
    assert "needs a GPU" in attention.problem("cudnn", "cpu")
    # only a backend that says so is given a query offset
    q = jnp.zeros((1, 2, 2, 4))
    for blocks in (None, (16, 16, 16, 16)):  # tile sizes do not get past the check either
        with pytest.raises(ValueError, match="cannot place queries"):
            attention.attend(q, q, q, implementation="pallas", q_offset=3, blocks=blocks)


def test_pallas_backend_in_the_model_matches_xla():
    """model.attention=pallas (interpreted on the CPU) through the whole model: the same
    logits and gradients as the plain attention, with packed documents."""
    from ultrajax.config.schema import ModelConfig
    from ultrajax.model.llama import init_params
    from ultrajax.model.stack import forward

    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2,
                      d_ff=64, seq_len=24, dtype="float32")  # fmt: skip
    params = init_params(cfg, jax.random.key(1))
    rng = np.random.default_rng(2)
    tokens = jnp.asarray(rng.integers(0, 64, (2, 24)), jnp.int32)
    seg = jnp.asarray(np.where(np.arange(24) < 10, 1, 2)[None].repeat(2, 0), jnp.int32)
    pos = jnp.where(seg == 1, jnp.arange(24), jnp.arange(24) - 10)

    def loss(p, impl):
        c = dataclasses.replace(cfg, attention=impl)
        return jnp.sum(forward(c, p, tokens, pos, seg) ** 2) * 1e-3

    (lp, gp), (lx, gx) = (
        jax.jit(jax.value_and_grad(loss), static_argnums=1)(params, i) for i in ("pallas", "xla")
    )
    np.testing.assert_allclose(lp, lx, rtol=1e-5)
    # the kernel sums keys and features in other orders than XLA: some tens of fp32
    # roundings, each of at most eps x the leaf's largest entry (a fixed 1e-6 was below
    # the rounding itself, ~1e-6 beside entries of 3: near-zero entries decided)
    eps = np.finfo(np.float32).eps
    for a, b in zip(jax.tree.leaves(gp), jax.tree.leaves(gx), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=64 * eps * float(jnp.abs(b).max()))


def test_attention_blocks_reach_the_kernel(monkeypatch):
    """model.attention_blocks and model.attention_backward, from the config through the
    layout's context and the interface, become the kernel's tiles and backward; the result
    and its gradients are the plain attention's with tiles that do not divide the length."""
    import harness

    from ultrajax.kernels import flash_attention as fa
    from ultrajax.parallel.layout import Layout

    seen = []
    real = fa.flash_attention
    spy = lambda *a, **kw: seen.append(kw["blocks"]) or real(*a, **kw)
    monkeypatch.setattr(fa, "flash_attention", spy)
    cfg, _ = harness.make("model.attention_blocks=[16,32,16,16]", "model.attention_backward=fused")
    mesh, rules = harness.setup(cfg)[:2]
    cp = Layout(cfg, mesh, rules).cp
    rng = np.random.default_rng(4)
    q = jnp.asarray(rng.standard_normal((1, 40, 4, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((1, 40, 2, 8)), jnp.float32) for _ in range(2))
    seg = jnp.asarray(np.where(np.arange(40) < 17, 1, 2)[None], jnp.int32)
    w = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)

    def loss(attend):
        return lambda q, k, v: jnp.sum(attend(q, k, v) * w)

    kernel = loss(lambda *a: cp.attend(*a, seg, "pallas"))
    got = jax.jit(jax.value_and_grad(kernel, (0, 1, 2)))(q, k, v)
    assert seen == [fa.BlockSizes(16, 32, 16, 16, fused_bwd=True)]
    plain = lambda *a: attention.attend(*a, seg, implementation="xla")  # noqa: E731
    want = jax.jit(jax.value_and_grad(loss(plain), (0, 1, 2)))(q, k, v)
    np.testing.assert_allclose(got[0], want[0], rtol=2e-5)
    for g, r in zip(got[1], want[1], strict=True):
        np.testing.assert_allclose(g, r, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("packed", [False, True])
def test_blocked_attention_matches_xla(packed, monkeypatch):
    """Keys in blocks of 16 (the last one partial) with an online softmax: the plain
    attention's output and gradients, GQA 2:1, packed documents with padding."""
    monkeypatch.setattr(blocked_lib, "BLOCK", 16)
    rng = np.random.default_rng(11)
    q = jnp.asarray(rng.standard_normal((2, 40, 4, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((2, 40, 2, 8)), jnp.float32) for _ in range(2))
    seg = None
    if packed:
        seg = np.ones((2, 40), np.int32)
        seg[:, 15:] = 2
        seg[1, 35:] = 0
        seg = jnp.asarray(seg)
    np.testing.assert_allclose(
        blocked_lib.blocked_attention(q, k, v, seg), xla_lib.xla_attention(q, k, v, seg),
        atol=2e-6,
    )  # fmt: skip
    do = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    grads = [
        jax.grad(lambda q, k, v, f=f: jnp.sum(f(q, k, v, seg) * do), (0, 1, 2))(q, k, v)
        for f in (blocked_lib.blocked_attention, xla_lib.xla_attention)
    ]
    for a, b in zip(*grads, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.parametrize(
    "b, t, h, kv, rows, dtype",
    [(3, 24, 4, 1, 4, "float32"), (4, 16, 4, 2, 2, "bfloat16")],
)
def test_tiled_attention_matches_xla(b, t, h, kv, rows, dtype, monkeypatch):
    """Query tiles over the keys up to their end, row groups in a loop (rows dividing the
    batch or not), probabilities recomputed in the backward: the plain attention's output
    and gradients with packed documents, padding and GQA; bf16 within bf16's rounding."""
    monkeypatch.setattr(tiled_lib, "TILE_ROWS", rows)
    rng = np.random.default_rng(b * t)
    dt = jnp.dtype(dtype)
    q = jnp.asarray(rng.standard_normal((b, t, h, 8)), dt)
    k, v = (jnp.asarray(rng.standard_normal((b, t, kv, 8)), dt) for _ in range(2))
    seg = np.ones((b, t), np.int32)
    seg[:, t // 3 :] = 2
    seg[-1, -5:] = 0  # padding at the end of the last row
    seg = jnp.asarray(seg)
    do = jnp.asarray(rng.standard_normal(q.shape), dt)
    tol = dict(atol=2e-6, rtol=1e-5) if dtype == "float32" else dict(atol=3e-2, rtol=3e-2)

    def run(f):
        out, vjp = jax.vjp(lambda q, k, v: f(q, k, v, seg), q, k, v)
        return (out, *vjp(do))

    got, want = run(tiled_lib.tiled_attention), run(xla_lib.xla_attention)
    for a, w in zip(got, want, strict=True):
        assert a.dtype == w.dtype and bool(jnp.isfinite(a.astype(jnp.float32)).all())
        np.testing.assert_allclose(a.astype(np.float32), w.astype(np.float32), **tol)


def grad_temp_bytes(f, rows: int, seq: int) -> int:
    """XLA's compiled temporaries of forward + backward of attention `f` on fp32 q (rows,
    seq, 4 heads, 16) and k, v with 2 kv heads: nothing runs."""
    q = jax.ShapeDtypeStruct((rows, seq, 4, 16), jnp.float32)
    kv = jax.ShapeDtypeStruct((rows, seq, 2, 16), jnp.float32)
    g = jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) ** 2), (0, 1, 2)))
    return g.lower(q, kv, kv).compile().memory_analysis().temp_size_in_bytes


def test_tiled_attention_never_stores_the_scores():
    """What the backward keeps of the tiled attention is its inputs and output, not the
    scores: compiled temporaries of forward + backward at seq 256, 16 rows (4 groups of
    4), less than one copy of the fp32 scores; the plain attention's are 4x that."""
    tiled, plain = (grad_temp_bytes(f, 16, 256) for f in (tiled_lib.tiled_attention,
                                                         xla_lib.xla_attention))  # fmt: skip
    scores = 16 * 4 * 256 * 256 * 4  # rows x heads x s x s fp32
    assert plain > 4 * scores
    assert tiled < scores, (tiled, scores)


def test_blocked_attention_holds_far_less_than_the_scores(monkeypatch):
    """Compiled temporaries of forward + backward at seq 1024: the blocked attention
    keeps one (1024 x 128) block of scores at a time, the plain one all of them."""
    monkeypatch.setattr(blocked_lib, "BLOCK", 128)
    blocked, plain = (grad_temp_bytes(f, 1, 1024) for f in (blocked_lib.blocked_attention,
                                                           xla_lib.xla_attention))  # fmt: skip
    scores = 4 * 1024 * 1024 * 4  # heads x s x s fp32
    assert plain > scores
    assert blocked < 0.35 * plain, (blocked, plain)
