"""model/fp8.py (model.fp8=tensorwise|rowwise): each FP8 matmul against a reference that quantises,
dequantises and multiplies in fp32 (fresh random inputs), no inf or NaN far beyond the
formats' range, and a train step whose lowered program multiplies e4m3 and e5m2."""

from __future__ import annotations

import dataclasses

import harness
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from ultrajax.model import fp8
from ultrajax.model.ops import Reduce, Weight, dense

EQ = "btd,df->btf"


def _inputs(seed=0, scale=1.0):
    k = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(k[0], (2, 16, 32), jnp.float32) * scale
    w = jax.random.normal(k[1], (32, 24), jnp.float32) / np.sqrt(32)
    g = jax.random.normal(k[2], (2, 16, 24), jnp.float32)
    return x, w, g


def _dequantised(a, dtype, axes=None):
    q, s = fp8.quantize(a, dtype, axes=axes)
    return q.astype(jnp.float32) / s


def test_quantize_puts_the_largest_magnitude_on_the_formats_largest_value():
    x, _, _ = _inputs()
    for dtype, top, bits in ((fp8.E4M3, 448.0, 3), (fp8.E5M2, 57344.0, 2)):
        q, s = fp8.quantize(x, dtype)
        assert q.dtype == dtype
        assert float(jnp.max(jnp.abs(q.astype(jnp.float32)))) == top
        # each value within half a unit in the last place of its own magnitude
        err = jnp.abs(q.astype(jnp.float32) / s - x)
        assert bool(jnp.all(err <= jnp.abs(x) * 2.0 ** -(bits + 1) + 1e-6 / s))
    q, s = fp8.quantize(jnp.zeros((3, 4)), fp8.E4M3)
    assert float(s) == 1.0 and not np.any(np.asarray(q.astype(jnp.float32)))


def test_matmul_and_its_gradients_are_the_quantised_products():
    """Forward: e4m3(x) e4m3(w); backward: e5m2(g) against the forward's e4m3 operands,
    each the fp32 product of the dequantised operands (fp32 accumulation)."""
    x, w, g = _inputs(1)
    y, pull = jax.vjp(lambda x, w: fp8.matmul(EQ, x, w), x, w)
    dx, dw = pull(g)
    xd, wd, gd = _dequantised(x, fp8.E4M3), _dequantised(w, fp8.E4M3), _dequantised(g, fp8.E5M2)
    np.testing.assert_allclose(y, jnp.einsum(EQ, xd, wd), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx, jnp.einsum("btf,df->btd", gd, wd), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, jnp.einsum("btd,btf->df", xd, gd), rtol=1e-5, atol=1e-4)
    # and near the exact product: e4m3 keeps 3 mantissa bits a value
    exact = jnp.einsum(EQ, x, w)
    assert float(jnp.max(jnp.abs(y - exact))) < 0.1 * float(jnp.max(jnp.abs(exact)))


def test_rowwise_scales_each_row_onto_the_formats_largest_value():
    x, _, _ = _inputs(4)
    q, s = fp8.quantize(x, fp8.E4M3, axes=(2,))
    assert s.shape == (2, 16, 1)
    np.testing.assert_array_equal(jnp.max(jnp.abs(q.astype(jnp.float32)), axis=2), 448.0)


def test_rowwise_products_are_the_quantised_products():
    """Forward: x per token (amax over d) against w per output column (amax over d);
    dx: g per token (over f) against w per input row (over f); dw: x and g per feature
    (amax over the tokens). Each the fp32 product of the dequantised operands."""
    x, w, g = _inputs(5)
    y, pull = jax.vjp(lambda x, w: fp8.matmul(EQ, x, w, "rowwise"), x, w)
    dx, dw = pull(g)
    e4, e5 = fp8.E4M3, fp8.E5M2
    y_ref = jnp.einsum(EQ, _dequantised(x, e4, (2,)), _dequantised(w, e4, (0,)))
    dx_ref = jnp.einsum("btf,df->btd", _dequantised(g, e5, (2,)), _dequantised(w, e4, (1,)))
    dw_ref = jnp.einsum("btd,btf->df", _dequantised(x, e4, (0, 1)), _dequantised(g, e5, (0, 1)))
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, dw_ref, rtol=1e-5, atol=1e-4)
    # not the tensorwise products: the scales differ row by row
    assert float(jnp.max(jnp.abs(y - fp8.matmul(EQ, x, w)))) > 1e-4


def test_rowwise_tokens_do_not_see_each_others_outliers():
    """One token at 1e6: under rowwise scaling every other token's output is unchanged
    (and a token's output does not depend on the batch it came in); under tensorwise
    the outlier pushes every other token below e4m3's smallest values."""
    x, w, _ = _inputs(6)
    big = x.at[0, 0].multiply(1e6)
    rows = fp8.matmul(EQ, x, w, "rowwise")
    np.testing.assert_allclose(fp8.matmul(EQ, big, w, "rowwise")[:, 1:], rows[:, 1:], rtol=1e-6)
    np.testing.assert_allclose(fp8.matmul(EQ, x[1:], w, "rowwise"), rows[1:], rtol=1e-6)
    exact = jnp.einsum(EQ, x, w)[:, 1:]
    err_rows = jnp.abs(fp8.matmul(EQ, big, w, "rowwise")[:, 1:] - exact).max()
    err_tensor = jnp.abs(fp8.matmul(EQ, big, w)[:, 1:] - exact).max()
    assert float(err_tensor) > 10 * float(err_rows)


@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_values_far_beyond_the_formats_give_no_inf_or_nan(recipe):
    """Activations at 1e6 with an outlier at 1e9 and gradients at 1e5 (e4m3's range ends
    at 448, e5m2's at 57344; the true results fit fp32): every operand is scaled by its
    own amax before the cast, so nothing overflows, and the outlier's row is still right
    to e4m3's precision."""
    x, w, g = _inputs(2, scale=1e6)
    x = x.at[0, 0, 0].set(1e9)
    y, pull = jax.vjp(lambda x, w: fp8.matmul(EQ, x, w, recipe), x, w)
    dx, dw = pull(g * 1e5)
    for a in (y, dx, dw):
        assert bool(jnp.all(jnp.isfinite(a)))
    exact = jnp.einsum(EQ, x, w)[0, 0]
    assert float(jnp.max(jnp.abs(y[0, 0] - exact))) < 0.1 * float(jnp.max(jnp.abs(exact)))


@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_a_trained_weight_takes_the_same_fp8_rule(recipe):
    """ops.dense with fp8 on a Weight (the step's path: the weight gradient reduced in its
    rule) gives fp8.matmul's output and gradients."""
    x, w, g = _inputs(3)
    red = Reduce()

    def through_weight(x, sink):
        weight = Weight.make(w, sink, None, red)
        return dense(x, weight, EQ, jnp.float32, fp8_recipe=recipe)

    y, pull = jax.vjp(through_weight, x, jnp.zeros_like(w))
    dx, dw = pull(g)
    y_ref, pull_ref = jax.vjp(lambda x, w: fp8.matmul(EQ, x, w, recipe), x, w)
    dx_ref, dw_ref = pull_ref(g)
    for a, b in ((y, y_ref), (dx, dx_ref), (dw, dw_ref)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_the_train_step_multiplies_e4m3_and_e5m2(recipe):
    """model.fp8: the lowered step (before XLA:CPU converts FP8 to fp32 for its dots)
    multiplies e4m3 operands in the forward and e5m2 ones in the backward; with
    model.fp8=none it has no FP8 at all."""
    from ultrajax.tools import analyze

    cfg, devices = harness.make(f"model.fp8={recipe}", "model.dtype=bfloat16")
    text = analyze.lower_step(cfg, devices[:1]).as_text()
    dots = [line for line in text.splitlines() if "dot_general" in line]
    assert any("f8E4M3FN" in line and "f8E5M2" not in line for line in dots)
    assert any("f8E5M2" in line for line in dots)
    plain = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, fp8="none"))
    assert "f8E4M3FN" not in analyze.lower_step(plain, devices[:1]).as_text()


def _f8_dot_flops(jaxpr, times=1) -> float:
    """FLOPs of the dots with an FP8 operand in a jaxpr, each loop's body times its trip
    count (scan lengths; a step's other sub-jaxprs run once)."""
    total = 0.0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            lhs, rhs = (v.aval for v in eqn.invars)
            if any(jnp.dtype(a.dtype).itemsize == 1 for a in (lhs, rhs)):
                (contract, _), _ = eqn.params["dimension_numbers"]
                k = np.prod([lhs.shape[d] for d in contract])
                total += 2.0 * np.prod(eqn.outvars[0].aval.shape) * k * times
        inner = times * eqn.params.get("length", 1) if eqn.primitive.name == "scan" else times
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            total += _f8_dot_flops(sub, inner)
    return total


@pytest.mark.parametrize(
    "chosen", [("model.fp8=tensorwise",), ("model.fp8=delayed", "model.fp8_layers=[wq,w_down]")]
)
def test_fp8_flops_are_the_fp8_dots_of_the_step(chosen):
    """flops.fp8_flops_per_token x tokens equals the FLOPs of the step's dots that take
    e4m3/e5m2 operands (forward, dx and dw of the chosen weights, 3 layers, 2
    micro-batches), read off the traced step: all 7, or model.fp8_layers' 2."""
    from ultrajax.cost import flops
    from ultrajax.tools import analyze

    cfg, devices = harness.make(
        *chosen, "model.dtype=bfloat16", "model.n_layers=3",
        "train.grad_accum=2", "model.remat=none",
    )  # fmt: skip
    mesh = analyze.mesh_lib.make_mesh(cfg, devices[:1])
    rules = analyze.mesh_lib.rules(cfg)
    tx, schedule = analyze.optim.optimizer(cfg), analyze.optim.lr_schedule(cfg)
    state, batch, shardings, batch_sh = analyze.abstract_inputs(cfg, mesh, rules, tx)
    with jax.set_mesh(mesh):
        step = analyze.jit_train_step(cfg, mesh, rules, tx, schedule, shardings, batch_sh)
        jaxpr = step.trace(state, batch).jaxpr
    want = flops.fp8_flops_per_token(cfg.model) * cfg.tokens_per_step
    assert want > 0
    assert _f8_dot_flops(jaxpr.jaxpr) == pytest.approx(want, rel=1e-9)


def _delayed(x, w, seen):
    """(y, dx, dw, the amax sink's cotangent) of ops.dense under model.fp8=delayed."""

    def through_weight(x, sink, amax_sink):
        weight = Weight.make(w, sink, None, Reduce(), (seen, amax_sink))
        return dense(x, weight, EQ, jnp.float32, fp8_recipe="delayed")

    y, pull = jax.vjp(through_weight, x, jnp.zeros_like(w), jnp.zeros(3))
    return y, pull


def test_delayed_scales_by_the_history_and_records_the_amaxes():
    """model.fp8=delayed: each operand scaled by the history's amax, not its own (w's
    history below its amax: clipped to e4m3's largest, never inf); the amax sink's
    cotangent is this step's amaxes of x, w and g, exactly."""
    x, w, g = _inputs(4)
    own = [float(jnp.max(jnp.abs(a))) for a in (x, w, g)]
    seen = jnp.array([2 * own[0], 0.5 * own[1], 3 * own[2]])
    y, pull = _delayed(x, w, seen)
    dx, dw, amaxes = pull(g)
    xd, wd, gd = ((q.astype(jnp.float32) / s) for q, s in (
        fp8.quantize(x, fp8.E4M3, seen[0]), fp8.quantize(w, fp8.E4M3, seen[1]),
        fp8.quantize(g, fp8.E5M2, seen[2])))  # fmt: skip
    assert float(jnp.max(jnp.abs(wd))) == pytest.approx(0.5 * own[1])  # clipped, finite
    np.testing.assert_allclose(y, jnp.einsum(EQ, xd, wd), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx, jnp.einsum("btf,df->btd", gd, wd), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, jnp.einsum("btd,btf->df", xd, gd), rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(amaxes, np.array(own, np.float32))


def test_delayed_without_history_scales_as_tensorwise():
    """An empty history (the first step) scales each tensor by its own amax: the same
    values as tensorwise."""
    x, w, g = _inputs(5)
    y, pull = _delayed(x, w, jnp.zeros(3))
    got = (y, *pull(g)[:2])
    y_ref, pull_ref = jax.vjp(lambda x, w: fp8.matmul(EQ, x, w, "tensorwise"), x, w)
    for a, b in zip(got, (y_ref, *pull_ref(g)), strict=True):
        np.testing.assert_array_equal(a, b)


def test_the_history_keeps_the_newest_amaxes_first():
    hist = fp8.history(2, 3)
    for step in (1.0, 5.0, 2.0, 3.0):
        hist = fp8.record(hist, jnp.full((2, 3), step))
    np.testing.assert_array_equal(hist[0, 0], [3.0, 2.0, 5.0])  # the 1 has left
    np.testing.assert_array_equal(fp8.seen(hist), np.full((2, 3), 5.0))


@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_fp8_matmuls_under_a_saving_remat_policy(recipe):
    """A layer loop under jax.checkpoint with a policy that saves every residual (ZeRO-3
    without recomputation runs one) gives the plain loop's loss and gradient. JAX rounds
    saved float residuals through reduce_precision, which turned e4m3 values above 240
    into NaN until the operands were kept as bytes (fp8.kept)."""
    x, _, _ = _inputs(6, scale=40.0)
    w = jax.random.normal(jax.random.key(7), (3, 32, 32)) / np.sqrt(32)

    def loss(w, policy):
        layer = lambda x, w: fp8.matmul("btd,df->btf", x, w, recipe)  # noqa: E731
        if policy is not None:
            layer = jax.checkpoint(layer, policy=policy)
        y, _ = jax.lax.scan(lambda x, w: (layer(x, w), None), x, w)
        return jnp.sum(y**2)

    everything = lambda *_, **__: True  # noqa: E731
    got = jax.jit(jax.value_and_grad(lambda w: loss(w, everything)))(w)
    want = jax.jit(jax.value_and_grad(lambda w: loss(w, None)))(w)
    assert np.isfinite(got[0]) and bool(jnp.all(jnp.isfinite(got[1])))
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    np.testing.assert_allclose(
        got[1], want[1], rtol=1e-5, atol=1e-6 * float(jnp.abs(want[1]).max())
    )


@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_zero_bubbles_split_backward_gives_the_same_fp8_gradients(recipe):
    """A weight whose backward is split (zero bubble: dx now, dw later from the (x, g)
    pair, ops.Deferred) gets the unsplit rule's dx and dw exactly: quantising the same
    tensors again gives the same operands. Delayed: with a history's amaxes (the pair
    carries them to the weight step) and the same recorded amaxes."""
    from ultrajax.model.ops import Deferred

    x, w, g = _inputs(8)
    own = [float(jnp.max(jnp.abs(a))) for a in (x, w, g)]
    seen = jnp.array([2 * own[0], 0.5 * own[1], 3 * own[2]])
    red = Reduce(defer=Deferred())

    def split(x, pair, amax_sink):
        scales = (seen, amax_sink) if recipe == "delayed" else None
        weight = Weight.make(w, jnp.zeros_like(w), pair, red, scales)
        return dense(x, weight, EQ, fp8_recipe=recipe)

    split(x, None, jnp.zeros(3))  # the shape trace
    y, pull = jax.vjp(split, x, red.defer.zeros(), jnp.zeros(3))
    dx, pair, amaxes = pull(g)
    dw = red.defer.weight_gradient(pair, dataclasses.replace(red, defer=None))
    if recipe == "delayed":
        y_ref, pull_ref = _delayed(x, w, seen)
        dx_ref, dw_ref, amaxes_ref = pull_ref(g)
        np.testing.assert_array_equal(amaxes, amaxes_ref)
    else:
        y_ref, pull_ref = jax.vjp(lambda x, w: fp8.matmul(EQ, x, w, recipe), x, w)
        dx_ref, dw_ref = pull_ref(g)
    for a, b in ((y, y_ref), (dx, dx_ref), (dw, dw_ref)):
        np.testing.assert_array_equal(a, b)
