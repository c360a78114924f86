"""The train step: gradient accumulation normalised by target tokens, eval step, optimizer."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ultrajax.config.parse import load
from ultrajax.config.schema import Config, ModelConfig
from ultrajax.model.llama import NORMS
from ultrajax.model.stack import forward
from ultrajax.train import batch as batch_lib
from ultrajax.train import optim
from ultrajax.train.batch import target_mask
from ultrajax.train.step import make_eval_step, make_train_step

MODEL = ModelConfig(
    vocab_size=128,
    d_model=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    d_ff=64,
    seq_len=16,
    dtype="float32",
    loss_chunk=0,  # built by hand, not validated: the default (null, auto) stays unresolved
)
G, B, S = 4, 2, MODEL.seq_len  # micro-batches, rows per micro-batch, sequence length

# (valid tokens of the row out of S + 1, where document 2 starts or None); padding
# (segment 0) fills the END of each row, a different amount in every micro-batch.
ROWS = [
    [(17, 9), (17, None)],
    [(12, None), (9, 4)],
    [(5, None), (17, 6)],
    [(3, None), (2, None)],
]


def _batch(seed=0) -> dict:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, MODEL.vocab_size, (G, B, S + 1)).astype(np.int32)
    seg = np.zeros((G, B, S + 1), np.int32)
    pos = np.zeros((G, B, S + 1), np.int32)
    for g, rows in enumerate(ROWS):
        for b, (valid, split) in enumerate(rows):
            split = split or valid
            seg[g, b, :split] = 1
            seg[g, b, split:valid] = 2
            pos[g, b, :split] = np.arange(split)
            pos[g, b, split:valid] = np.arange(valid - split)
    return {"tokens": tokens, "segment_ids": seg, "positions": pos}


def _flat(batch: dict) -> dict:
    """(G, B, S+1) -> (1, G*B, S+1): the same global batch as one micro-batch."""
    return {k: v.reshape(1, G * B, S + 1) for k, v in batch.items()}


def _cfg(grad_accum: int, cross_doc_mask: bool = True) -> Config:
    cfg = Config(model=MODEL)
    cfg.train.grad_accum = grad_accum
    cfg.train.micro_batch_size = G * B // grad_accum
    cfg.data.cross_doc_mask = cross_doc_mask
    return cfg


def capture_grads() -> optax.GradientTransformation:
    """An optax transformation that keeps the gradients it receives in its state (and
    leaves the parameters alone), so the step's gradients can be read exactly."""

    def init(params):
        return {"g": jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)}

    def update(grads, state, params=None):
        return jax.tree.map(jnp.zeros_like, grads), {"g": grads}

    return optax.GradientTransformation(init, update)


def _run_step(cfg, params, batch):
    tx = capture_grads()
    step = jax.jit(make_train_step(cfg, tx, optax.constant_schedule(0.5)))
    state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params)}
    b = batch_lib.make(batch, cfg.data.cross_doc_mask)
    new, metrics = step(state, jax.tree.map(jnp.asarray, b))
    return jax.device_get(new), jax.device_get(metrics)


# --------------------------------------------------------------------------- reference


def _reference_parts(fwd, params, batch):
    """Per-token NLL and target mask of a (rows, S+1) batch, in numpy float64."""
    tokens, seg, pos = batch["tokens"], batch["segment_ids"], batch["positions"]
    logits = np.asarray(fwd(params, tokens[:, :-1], pos[:, :-1], seg[:, :-1]), np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    targets = tokens[:, 1:]
    nll = -np.take_along_axis(logp, targets[..., None], -1)[..., 0]
    mask = (seg[:, 1:] > 0) & (seg[:, 1:] == seg[:, :-1])  # no padding, no next-doc start
    return nll, mask


@pytest.fixture(scope="module")
def setup(random_params):
    params = random_params(MODEL, seed=0)
    batch = _batch()
    fwd = jax.jit(functools.partial(forward, MODEL))
    flat = {k: v.reshape(G * B, S + 1) for k, v in batch.items()}
    nll, mask = _reference_parts(fwd, params, flat)
    four = _run_step(_cfg(4), params, batch)
    one = _run_step(_cfg(1), params, _flat(batch))
    return dict(params=params, batch=batch, fwd=fwd, nll=nll, mask=mask, four=four, one=one)


def test_batch_has_different_token_counts_per_micro_batch(setup):
    counts = setup["mask"].reshape(G, B, S).sum(axis=(1, 2))
    assert len(set(counts.tolist())) == G, counts
    assert counts.tolist() == [31, 18, 19, 3]


def test_loss_is_token_weighted_mean(setup):
    nll, mask = setup["nll"], setup["mask"]
    ref = (nll * mask).sum() / mask.sum()
    for name in ("four", "one"):
        _, metrics = setup[name]
        assert np.isfinite(metrics["loss"])
        np.testing.assert_allclose(metrics["loss"], ref, rtol=1e-5, err_msg=name)
        assert int(metrics["n_targets"]) == mask.sum()


def test_loss_is_not_the_mean_of_micro_batch_means(setup):
    nll, mask = setup["nll"].reshape(G, B, S), setup["mask"].reshape(G, B, S)
    mean_of_means = np.mean([(nll[g] * mask[g]).sum() / mask[g].sum() for g in range(G)])
    loss = float(setup["four"][1]["loss"])
    # far outside the 1e-5 tolerance the equivalence is checked at
    assert abs(loss - mean_of_means) > 1e-2 * abs(loss), (loss, mean_of_means)


def test_grad_accum_4_equals_grad_accum_1(setup):
    g4 = setup["four"][0]["opt_state"]["g"]
    g1 = setup["one"][0]["opt_state"]["g"]
    leaves4 = jax.tree_util.tree_leaves_with_path(g4)
    leaves1 = jax.tree.leaves(g1)
    assert len(leaves4) == len(leaves1)
    for (path, a), b in zip(leaves4, leaves1, strict=True):
        assert a.dtype == np.float32
        assert np.isfinite(a).all() and np.abs(a).max() > 0, path
        # fp32 summation-order noise, measured ~1e-6 of the leaf's largest entry
        scale = np.abs(b).max()
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * scale, err_msg=str(path))
    np.testing.assert_allclose(setup["four"][1]["grad_norm"], setup["one"][1]["grad_norm"], 1e-5)


def test_gradient_matches_finite_difference_of_reference_loss(setup):
    """The accumulated gradient is the gradient of the token-weighted mean, not a
    multiple of it: check its derivative along a random direction."""
    params, fwd = setup["params"], setup["fwd"]
    flat = {k: v.reshape(G * B, S + 1) for k, v in setup["batch"].items()}
    rng = np.random.default_rng(1)
    direction = jax.tree.map(lambda p: rng.standard_normal(p.shape).astype(np.float32), params)

    def loss(eps):
        moved = jax.tree.map(lambda p, d: p + eps * d, params, direction)
        nll, mask = _reference_parts(fwd, moved, flat)
        return (nll * mask).sum() / mask.sum()

    eps = 1e-3
    numeric = (loss(eps) - loss(-eps)) / (2 * eps)
    g = setup["four"][0]["opt_state"]["g"]
    analytic = sum(
        float(np.vdot(a, d))
        for a, d in zip(jax.tree.leaves(g), jax.tree.leaves(direction), strict=True)
    )
    assert abs(analytic) > 1e-2
    np.testing.assert_allclose(analytic, numeric, rtol=2e-2)


def test_step_reports_schedule_and_counts_steps(setup):
    new, metrics = setup["four"]
    assert int(new["step"]) == 1
    assert float(metrics["lr"]) == 0.5
    for a, b in zip(jax.tree.leaves(new["params"]), jax.tree.leaves(setup["params"]), strict=True):
        np.testing.assert_array_equal(a, b)  # the capture transform returns zero updates


def test_eval_step_sums_nll_and_counts_targets(setup):
    b = batch_lib.make(setup["batch"], cross_doc_mask=True)
    s, n = jax.jit(make_eval_step(_cfg(4)))(setup["params"], jax.tree.map(jnp.asarray, b))
    nll, mask = setup["nll"], setup["mask"]
    assert int(n) == mask.sum()
    np.testing.assert_allclose(float(s), (nll * mask).sum(), rtol=1e-5)


def test_target_mask_by_hand():
    seg = jnp.asarray([[1, 1, 1, 2, 2, 0, 0], [1, 1, 1, 1, 1, 1, 1]])
    with_docs = np.asarray(target_mask(seg, cross_doc_mask=True))
    np.testing.assert_array_equal(with_docs[0], [1, 1, 0, 1, 0, 0])
    np.testing.assert_array_equal(with_docs[1], [1] * 6)
    no_docs = np.asarray(target_mask(seg, cross_doc_mask=False))
    np.testing.assert_array_equal(no_docs[0], [1, 1, 1, 1, 0, 0])


def test_bf16_compute_accumulates_fp32_gradients():
    cfg = _cfg(4)
    cfg.model = dataclasses.replace(MODEL, dtype="bfloat16")
    tx = capture_grads()
    step = make_train_step(cfg, tx, optax.constant_schedule(0.1))

    def run(key):
        from ultrajax.train.step import init_state

        b = batch_lib.make(_batch(), cross_doc_mask=True)
        return step(init_state(cfg, tx, key), jax.tree.map(jnp.asarray, b))

    new, metrics = jax.eval_shape(run, jax.random.key(0))  # types only: nothing compiled
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(new["opt_state"]["g"]))
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(new["params"]))
    assert metrics["loss"].dtype == jnp.float32


# --------------------------------------------------------------------------- optimizer


def test_decay_mask_skips_norm_scales(random_params):
    mask = optim.decay_mask(random_params(MODEL))
    assert mask["final_norm"] is False
    assert mask["layers"]["attn_norm"] is False and mask["layers"]["mlp_norm"] is False
    assert mask["embed"] is True and mask["lm_head"] is True
    decayed = [k for k, v in mask["layers"].items() if v]
    assert sorted(decayed) == sorted(set(mask["layers"]) - set(NORMS))


def test_adamw_decays_weights_but_not_norm_scales(random_params):
    cfg = load(
        None,
        [
            "optim.schedule=constant",
            "optim.warmup_steps=0",
            "optim.lr=0.1",
            "optim.weight_decay=0.5",
        ],
    )
    tx = optim.optimizer(cfg)
    params = random_params(MODEL, seed=3)
    zeros = jax.tree.map(jnp.zeros_like, params)

    @jax.jit
    def one_update(params):
        updates, _ = tx.update(zeros, tx.init(params), params)
        return optax.apply_updates(params, optim.scale(updates, 0.1))  # as the step does

    new = one_update(params)
    flat_new = dict(jax.tree_util.tree_leaves_with_path(new))
    for path, p in jax.tree_util.tree_leaves_with_path(params):
        is_norm = any(getattr(k, "key", None) in NORMS for k in path)
        expected = p if is_norm else p * (1 - 0.1 * 0.5)
        np.testing.assert_allclose(flat_new[path], expected, rtol=1e-6, err_msg=str(path))


def _sched(*overrides):
    cfg = load(None, ["train.steps=100", "optim.lr=1e-3", "optim.min_lr=1e-4", *overrides])
    s = optim.lr_schedule(cfg)
    return np.asarray(jax.jit(s)(jnp.arange(101)), np.float64)


def test_warmup_then_cosine_to_min_lr():
    """Position p is step p + 1. Warmup over 10 steps: lr/10 at step 1, lr at step 10;
    min_lr at the last step, 100 (it came one position past it, and the peak at 11)."""
    lr = _sched("optim.schedule=cosine", "optim.warmup_steps=10")
    np.testing.assert_allclose(lr[:10], np.linspace(1e-4, 1e-3, 10), rtol=1e-5)  # lr/W first
    np.testing.assert_allclose(lr[54], (1e-3 + 1e-4) / 2, rtol=1e-5)  # halfway down
    np.testing.assert_allclose(lr[99:], 1e-4, rtol=1e-5)  # the last step, and held past it
    assert np.all(np.diff(lr[9:]) <= 1e-12) and lr[98] > lr[99]
    expected = 1e-4 + 0.5 * (1e-3 - 1e-4) * (1 + np.cos(np.pi * (np.arange(9, 100) - 9) / 90))
    np.testing.assert_allclose(lr[9:100], expected, rtol=1e-5)


def test_wsd_holds_the_peak_then_decays_to_min_lr_at_the_last_step():
    """decay_fraction 0.2 of 100 steps: the last 20 below the peak, the last at min_lr
    (it never reached min_lr: 10 steps ended at 5.5 x min_lr)."""
    lr = _sched("optim.schedule=wsd", "optim.warmup_steps=10", "optim.decay_fraction=0.2")
    np.testing.assert_allclose(lr[:10], np.linspace(1e-4, 1e-3, 10), rtol=1e-5)  # lr/W first
    np.testing.assert_allclose(lr[9:80], 1e-3, rtol=1e-6)  # stable phase at the peak
    np.testing.assert_allclose(lr[79:100], np.linspace(1e-3, 1e-4, 21), rtol=1e-5)
    np.testing.assert_allclose(lr[100], 1e-4, rtol=1e-5)
    short = load(None, ["train.steps=10", "optim.warmup_steps=2", "optim.schedule=wsd"])
    lr = np.asarray(jax.jit(optim.lr_schedule(short))(jnp.arange(10)), np.float64)
    np.testing.assert_allclose(lr, [1.5e-3, *[3e-3] * 6, 3e-3, 1.65e-3, 3e-4], rtol=1e-5)


def test_constant_schedule_after_warmup():
    lr = _sched("optim.schedule=constant", "optim.warmup_steps=5")
    np.testing.assert_allclose(lr[4:], 1e-3, rtol=1e-6)  # lr from step 5, the warmup's last
    np.testing.assert_allclose(lr[0], 1e-3 / 5, rtol=1e-6)  # step 1 already trains
    no_warmup = _sched("optim.schedule=cosine", "optim.warmup_steps=0")
    assert no_warmup[0] == pytest.approx(1e-3) and no_warmup[99] == pytest.approx(1e-4)


# --------------------------------------------------------------------------- chunked loss


def test_chunked_loss_equals_the_plain_loss_and_gradients(setup):
    """model.loss_chunk: the head and loss over 4 tokens at a time give the same loss
    and the same gradients (fp32) as the whole sequence at once."""
    plain = setup["four"]
    cfg = _cfg(4)
    cfg.model = dataclasses.replace(MODEL, loss_chunk=4)
    chunked = _run_step(cfg, setup["params"], setup["batch"])
    np.testing.assert_allclose(chunked[1]["loss"], plain[1]["loss"], rtol=1e-6)
    for a, b in zip(
        jax.tree.leaves(chunked[0]["opt_state"]["g"]),
        jax.tree.leaves(plain[0]["opt_state"]["g"]),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * np.abs(b).max())


def test_chunked_loss_never_holds_the_full_logits():
    """What the backward pass keeps: with chunks, no (rows, seq, vocab) fp32 array."""
    from jax.ad_checkpoint import print_saved_residuals

    from ultrajax.model.loss import loss_sum
    from ultrajax.train.batch import Batch

    def saved(chunk):
        cfg = _cfg(1)
        cfg.model = dataclasses.replace(MODEL, vocab_size=512, loss_chunk=chunk)
        params = jax.eval_shape(lambda: init_state_params(cfg))
        mb = Batch(*(jax.ShapeDtypeStruct((B, S), jnp.int32) for _ in Batch._fields))
        import contextlib
        import io

        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            print_saved_residuals(lambda p, x: loss_sum(cfg, p, x)[0], params, mb)
        return out.getvalue()

    full = f"f32[{B},{S},512]"
    assert full in saved(0)
    assert full not in saved(4)


def init_state_params(cfg):
    from ultrajax.model.llama import init_params

    return init_params(cfg.model, jax.random.key(0))
