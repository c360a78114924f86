"""The Llama model: parameter count formula, shapes, dtypes, RoPE/RMSNorm, masking."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ultrajax.config import parse
from ultrajax.config import schema as config
from ultrajax.config.schema import ModelConfig
from ultrajax.model import nn
from ultrajax.model.llama import (
    NORMS,
    init_params,
    logical_axes,
    matmul_param_count,
    param_count,
)
from ultrajax.model.nn import rms_norm, rope
from ultrajax.model.stack import forward
from ultrajax.parallel.mesh import LOGICAL_NAMES

BASE = ModelConfig(
    vocab_size=128,
    d_model=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    d_ff=64,
    seq_len=16,
    dtype="float32",
    param_dtype="float32",
)


def _count(cfg: ModelConfig) -> int:
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    return sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))


@pytest.mark.parametrize(
    "changes",
    [
        dict(),  # GQA, untied
        dict(n_kv_heads=4),  # MHA
        dict(n_kv_heads=1),  # MQA
        dict(tie_embeddings=True),
        dict(tie_embeddings=True, n_kv_heads=1, n_layers=3),
        dict(head_dim=16),  # explicit head_dim != d_model / n_heads
        dict(head_dim=8, n_heads=6, n_kv_heads=3, d_model=40, vocab_size=200),
    ],
    ids=["gqa", "mha", "mqa", "tied", "tied-mqa-3layers", "head_dim", "odd-shape"],
)
def test_param_count_formula_matches_the_model(changes):
    cfg = dataclasses.replace(BASE, **changes)
    assert param_count(cfg) == _count(cfg)


def test_param_count_by_hand():
    # embed 128*32 + lm_head 32*128 + final norm 32 + per layer:
    # 2 norms 64, wq 32*4*8, wk/wv 2*32*2*8, wo 4*8*32, mlp 3*32*64
    per_layer = 64 + 1024 + 1024 + 1024 + 6144
    assert param_count(BASE) == 2 * 128 * 32 + 32 + 2 * per_layer


def test_matmul_param_count_by_hand():
    # per layer wq 32*4*8, wk/wv 2*32*2*8, wo 4*8*32, mlp 3*32*64; + the LM head 32*128,
    # which multiplies every token even when it is the (tied) embedding
    per_layer = 1024 + 1024 + 1024 + 6144
    assert matmul_param_count(BASE) == 2 * per_layer + 32 * 128
    assert matmul_param_count(dataclasses.replace(BASE, tie_embeddings=True)) == (
        2 * per_layer + 32 * 128
    )


def test_norms_are_the_scales_that_start_at_one():
    params = init_params(BASE, jax.random.key(0))
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        is_norm = path[-1].key in NORMS
        assert is_norm == bool(jnp.all(leaf == 1)), path
        scale_shapes = {(BASE.d_model,), (BASE.n_layers, BASE.d_model)}  # one per layer or one
        assert is_norm == (leaf.shape in scale_shapes), path


def test_every_parameter_has_logical_names_of_its_rank():
    cfg = dataclasses.replace(BASE, head_dim=16)
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    names = logical_axes(cfg)
    flat_shapes = jax.tree_util.tree_leaves_with_path(shapes)
    flat_names = dict(
        jax.tree_util.tree_leaves_with_path(names, is_leaf=lambda x: isinstance(x, tuple))
    )
    assert len(flat_shapes) == len(flat_names)
    for path, leaf in flat_shapes:
        axes = flat_names[path]
        assert len(axes) == leaf.ndim, (path, axes, leaf.shape)
        assert all(a in LOGICAL_NAMES for a in axes), axes
    layers = shapes["layers"]
    assert layers["wq"].shape == (2, 32, 4, 16)
    assert layers["wk"].shape == (2, 32, 2, 16)
    assert layers["wo"].shape == (2, 4, 16, 32)
    assert all(leaf.shape[0] == cfg.n_layers for leaf in jax.tree.leaves(layers))


def test_tied_model_has_no_lm_head():
    shapes = jax.eval_shape(
        lambda: init_params(dataclasses.replace(BASE, tie_embeddings=True), jax.random.key(0))
    )
    assert "lm_head" not in shapes and "embed" in shapes


# --------------------------------------------------------------------------- building blocks


def test_rms_norm_matches_reference():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 5, 16)).astype(np.float32) * 3
    scale = rng.standard_normal(16).astype(np.float32)
    ref = x / np.sqrt(np.mean(x.astype(np.float64) ** 2, -1, keepdims=True) + 1e-5) * scale
    np.testing.assert_allclose(np.asarray(rms_norm(x, scale, 1e-5)), ref, rtol=1e-5, atol=1e-6)


def test_rope_matches_hugging_face_rotate_half():
    rng = np.random.default_rng(1)
    b, t, h, d, theta = 2, 7, 3, 8, 10000.0
    x = rng.standard_normal((b, t, h, d)).astype(np.float32)
    pos = rng.integers(0, 50, (b, t))
    inv_freq = 1.0 / theta ** (np.arange(0, d, 2) / d)
    angle = pos[..., None] * inv_freq  # (b, t, d/2)
    emb = np.concatenate([angle, angle], -1)[:, :, None, :]
    rotate_half = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], -1)
    ref = x * np.cos(emb) + rotate_half * np.sin(emb)
    got = np.asarray(rope(jnp.asarray(x), jnp.asarray(pos), theta))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_rope_scores_depend_only_on_relative_position():
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.standard_normal((1, 1, 1, 8)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, 1, 1, 8)), jnp.float32)

    def score(i, j):
        qi = rope(q, jnp.full((1, 1), i), 10000.0)
        kj = rope(k, jnp.full((1, 1), j), 10000.0)
        return float(jnp.sum(qi * kj))

    assert score(5, 2) == pytest.approx(score(13, 10), rel=1e-5, abs=1e-5)
    assert abs(score(5, 2) - score(5, 4)) > 1e-3


def _llama3_reference(inv_freq, factor, low, high, original):
    """Meta's `apply_scaling` (llama3 reference code, float64 loop): an independent
    statement of what rope scaling=llama3 computes."""
    out = []
    for f in inv_freq:
        wavelen = 2 * math.pi / f
        if wavelen < original / high:
            out.append(f)
        elif wavelen > original / low:
            out.append(f / factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return np.array(out)


def _angles(d, theta, **scaling):
    """Recover rope's per-pair angle at position 1 by rotating the unit vector (1, 0)."""
    x = jnp.concatenate([jnp.ones(d // 2), jnp.zeros(d // 2)]).reshape(1, 1, 1, d)
    out = np.asarray(rope(x, jnp.ones((1, 1), jnp.int32), theta, **scaling))[0, 0, 0]
    return np.arctan2(out[d // 2 :], out[: d // 2])


def test_rope_without_scaling_is_unchanged():
    """scaling="none" must stay bit-identical to the unscaled formula (old checkpoints)."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((2, 9, 3, 16)), jnp.float32)
    pos = jnp.asarray(rng.integers(0, 5000, (2, 9)))
    freq = 500000.0 ** (-jnp.arange(8, dtype=jnp.float32) / 8)
    angle = pos.astype(jnp.float32)[..., None] * freq
    cos, sin = jnp.cos(angle)[:, :, None], jnp.sin(angle)[:, :, None]
    x1, x2 = jnp.split(x, 2, axis=-1)
    want = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    got = rope(x, pos, 500000.0, scaling="none", factor=8.0, original_max_len=16)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_rope_llama3_scaling_matches_meta_reference():
    d, theta, factor, low, high, original = 128, 500000.0, 32.0, 1.0, 4.0, 8192
    plain = theta ** (-np.arange(d // 2, dtype=np.float64) / (d // 2))
    want = _llama3_reference(plain, factor, low, high, original)
    kw = dict(factor=factor, low_freq_factor=low, high_freq_factor=high, original_max_len=original)
    got = _angles(d, theta, scaling="llama3", **kw)
    np.testing.assert_allclose(got, want, rtol=2e-6)
    # all three bands occur: kept, smoothed, divided by factor
    ratio = plain / want
    assert (ratio == 1).any() and (ratio == factor).any()
    assert ((ratio > 1.001) & (ratio < factor * 0.999)).any()


def test_rope_linear_scaling_divides_positions():
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((1, 6, 2, 8)), jnp.float32)
    pos = jnp.asarray(rng.integers(0, 400, (1, 6)))
    got = rope(x, pos, 10000.0, scaling="linear", factor=4.0)
    want = rope(x, pos.astype(jnp.float32) / 4.0, 10000.0)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
    assert np.abs(np.asarray(got) - np.asarray(rope(x, pos, 10000.0))).max() > 0.1


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.rope_scaling=yarn"], "model.rope_scaling"),
        (["model.rope_scaling=linear", "model.rope_factor=0"], "model.rope_factor must be"),
        (
            ["model.rope_scaling=llama3", "model.rope_low_freq_factor=4"],
            "model.rope_low_freq_factor must be positive and smaller than",
        ),
        (
            ["model.rope_scaling=llama3", "model.rope_original_max_len=0"],
            "model.rope_original_max_len must be positive",
        ),
    ],
)
def test_rope_scaling_config_is_validated(overrides, message):
    with pytest.raises(config.ConfigError) as e:
        parse.load(None, overrides)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_forward_uses_rope_scaling(params):
    """The config's scaling reaches every layer's rope (logits move)."""
    tokens = jnp.asarray(np.random.default_rng(5).integers(0, 128, (1, 16)))
    cfg = dataclasses.replace(BASE, rope_scaling="linear", rope_factor=4.0)
    base = np.asarray(forward(BASE, params, tokens))
    assert np.abs(np.asarray(forward(cfg, params, tokens)) - base).max() > 1e-3
    same = dataclasses.replace(BASE, rope_scaling="linear", rope_factor=1.0)
    np.testing.assert_allclose(np.asarray(forward(same, params, tokens)), base, atol=1e-5)


# --------------------------------------------------------------------------- forward


@pytest.fixture(scope="module")
def params(random_params):
    return random_params(BASE, seed=0)


@pytest.fixture(scope="module")
def fwd():
    """forward(params, tokens, positions, segment_ids), compiled once for (2, 16)."""
    return jax.jit(functools.partial(forward, BASE))


def _tokens(seed, shape=(2, 16)):
    return jnp.asarray(np.random.default_rng(seed).integers(0, BASE.vocab_size, shape), jnp.int32)


POS = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (2, 16))
ONE_SEGMENT = jnp.ones((2, 16), jnp.int32)


def test_logits_shape_and_fp32(params):
    logits = jax.jit(functools.partial(forward, BASE))(params, _tokens(0))  # default positions
    assert logits.shape == (2, 16, BASE.vocab_size)
    assert logits.dtype == jnp.float32
    assert np.isfinite(np.asarray(logits)).all()


def test_bf16_compute_keeps_fp32_logits_and_master_weights(random_params, params, fwd):
    cfg = dataclasses.replace(BASE, dtype="bfloat16")
    tokens = _tokens(0)
    logits = jax.jit(functools.partial(forward, cfg))(params, tokens, POS, ONE_SEGMENT)
    assert logits.dtype == jnp.float32
    ref = np.asarray(fwd(params, tokens, POS, ONE_SEGMENT))
    got = np.asarray(logits)
    assert np.isfinite(got).all()
    assert 0 < np.abs(got - ref).max() < 0.1 * np.abs(ref).max()  # bf16 rounding, no more
    master = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(master))
    low = jax.eval_shape(
        lambda: init_params(dataclasses.replace(cfg, param_dtype="bfloat16"), jax.random.key(0))
    )
    assert all(p.dtype == jnp.bfloat16 for p in jax.tree.leaves(low))


def test_causal_earlier_logits_ignore_later_tokens(params, fwd):
    a = _tokens(1)
    cut = 9
    b = a.at[:, cut:].set((a[:, cut:] + 7) % BASE.vocab_size)
    la = np.asarray(fwd(params, a, POS, ONE_SEGMENT))
    lb = np.asarray(fwd(params, b, POS, ONE_SEGMENT))
    np.testing.assert_allclose(la[:, :cut], lb[:, :cut], rtol=1e-6, atol=1e-6)
    assert np.abs(la[:, cut:] - lb[:, cut:]).max() > 1e-3  # later positions do see the change


DOC1 = 7  # tokens of document 1; document 2 fills the rest of the 16
SEG = jnp.asarray([[1] * DOC1 + [2] * (16 - DOC1)] * 2, jnp.int32)
SEG_POS = jnp.asarray([list(range(DOC1)) + list(range(16 - DOC1))] * 2, jnp.int32)


def test_cross_document_mask_isolates_documents(params, fwd):
    a = _tokens(2)
    b = a.at[:, :DOC1].set((a[:, :DOC1] + 5) % BASE.vocab_size)  # change only document 1
    la, lb = np.asarray(fwd(params, a, SEG_POS, SEG)), np.asarray(fwd(params, b, SEG_POS, SEG))
    np.testing.assert_allclose(la[:, DOC1:], lb[:, DOC1:], rtol=1e-6, atol=1e-6)
    assert np.abs(la[:, :DOC1] - lb[:, :DOC1]).max() > 1e-3
    # with one segment per row, document 2 attends to document 1 and does change
    ua = np.asarray(fwd(params, a, SEG_POS, ONE_SEGMENT))
    ub = np.asarray(fwd(params, b, SEG_POS, ONE_SEGMENT))
    assert np.abs(ua[:, DOC1:] - ub[:, DOC1:]).max() > 1e-3


def test_packed_document_equals_the_document_alone(params, fwd):
    """With segment ids and restarted positions, document 2 inside a packed row gives the
    logits it gets at the start of a row of its own."""
    a = _tokens(3)
    packed = np.asarray(fwd(params, a, SEG_POS, SEG))
    n2 = 16 - DOC1
    alone_tokens = jnp.concatenate([a[:, DOC1:], a[:, :DOC1]], axis=1)  # doc 2 first
    alone = np.asarray(fwd(params, alone_tokens, POS, ONE_SEGMENT))[:, :n2]
    np.testing.assert_allclose(packed[:, DOC1:], alone, rtol=1e-5, atol=1e-5)
    # the restart matters numerically only through rounding (RoPE is relative), so the
    # check above is the end-to-end one; positions themselves are tested in test_data.


def test_padding_segments_give_finite_logits(params, fwd):
    seg = jnp.asarray([[1] * 10 + [0] * 6, [0] * 16], jnp.int32)
    logits = np.asarray(fwd(params, _tokens(4), POS, seg))
    assert np.isfinite(logits).all()


def test_tied_head_is_the_transposed_embedding(params, fwd):
    tied = dataclasses.replace(BASE, tie_embeddings=True)
    p_tied = {k: v for k, v in params.items() if k != "lm_head"}
    p_untied = dict(p_tied, lm_head=params["embed"].T)
    tokens = _tokens(5)
    np.testing.assert_allclose(
        np.asarray(jax.jit(functools.partial(forward, tied))(p_tied, tokens, POS, ONE_SEGMENT)),
        np.asarray(fwd(p_untied, tokens, POS, ONE_SEGMENT)),
        rtol=1e-6,
        atol=1e-6,
    )


@pytest.mark.parametrize("scale", [1.0, 40.0])
def test_cross_entropy_grad_is_autodiff_of_the_loss_in_one_pass(scale):
    """nn.cross_entropy_grad (the chunked loss's): the NLL and its logit gradient against
    autodiff of the two-pass cross entropy, on fresh fp32 logits with a wide spread and
    a row whose first half is -inf (masked vocabulary). Its max and sum of exponentials
    come from one reduction (`_max_and_sum_exp`), summed in another order. Tolerances
    from the computation: each log-sum-exp may differ by the rounding of m + log(s),
    a few ulps of |m| and of the V-term sum; each probability (and so each gradient
    entry) by that much relative, at most that much absolute; the NLL by their sum."""
    logits = jax.random.normal(jax.random.key(7), (3, 5, 257), jnp.float32) * scale
    logits = logits.at[0, 1, :128].set(-jnp.inf)
    targets = jax.random.randint(jax.random.key(8), (3, 5), 128, 257)
    mask = (jax.random.uniform(jax.random.key(9), (3, 5)) > 0.2).astype(jnp.float32)

    def loss(lg):
        return jnp.sum(nn.cross_entropy(lg, targets, None) * mask)

    want, want_g = jax.value_and_grad(loss)(logits)
    one_pass = jax.jit(lambda lg: nn.cross_entropy_grad(lg, targets, mask, None, jnp.float32))
    got, got_g = one_pass(logits)
    assert np.isfinite(got) and np.all(np.isfinite(got_g))
    eps, top = np.finfo(np.float32).eps, float(np.abs(logits.max(-1)).max())
    log_z = 4 * eps * (top + math.log2(logits.shape[-1]))
    np.testing.assert_allclose(got, want, rtol=0, atol=float(mask.sum()) * log_z + eps * abs(want))
    np.testing.assert_allclose(got_g, want_g, rtol=0, atol=log_z + eps)
    m, s = nn._max_and_sum_exp(logits)
    np.testing.assert_array_equal(m, logits.max(-1))
    ref = jnp.exp(logits - logits.max(-1)[..., None]).sum(-1)
    np.testing.assert_allclose(s, ref, rtol=4 * eps * math.log2(logits.shape[-1]))


def test_fields_the_test_states_are_shared_across_leave_the_state_alone():
    """tests/harness.init_state keys its states by the model with NOT_IN_STATE's fields at
    one value: every one of them set otherwise (an MoE model, so the router's are read)
    gives the same train state, bit for bit."""
    import harness

    from ultrajax.train import optim
    from ultrajax.train import step as step_lib

    moe = ("model.moe_experts=4", "model.moe_top_k=2", "model.moe_d_ff=32")
    other = dict(
        dtype="bfloat16", remat="full", attention="tiled", attention_backward="fused",
        loss_chunk=16, scan_unroll=2, seq_len=32, norm_eps=1e-3, moe_grouped="ragged",
        moe_capacity=1.25, moe_aux_coef=0.1, moe_z_coef=0.01,
    )  # fmt: skip
    assert set(other) <= set(harness.NOT_IN_STATE)
    assert all(other[k] != harness.NOT_IN_STATE[k] for k in other)
    cfg = harness.make(*moe)[0]
    changed = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **other))
    assert harness.init_model(changed.model) == harness.init_model(cfg.model)
    states = [
        jax.jit(lambda k, c=c: step_lib.init_state(c, optim.optimizer(c), k))(jax.random.key(0))
        for c in (cfg, changed)
    ]
    same = jax.tree.map(lambda a, b: a.dtype == b.dtype and np.array_equal(a, b), *states)
    assert len(jax.tree.leaves(same)) > 10 and all(jax.tree.leaves(same))
    assert set(harness.NOT_IN_STATE) - set(other) == {"attention_blocks"}  # its own lists
