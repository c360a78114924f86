"""noise: the two-batch-size estimator of the gradient noise scale, against a linear
regression whose per-example gradient covariance is known in closed form. numpy only."""

import json
import math

import numpy as np
import pytest

from ultrajax.train.noise import NoiseScale, estimate

# l(w) = 0.5 (x.w - y)^2, x ~ N(0, diag(D)), y = x.w* + eps, eps ~ N(0, SIGMA2). At w with
# delta = w - w*, the per-example gradient is g = r x with r = x.delta - eps.
DIM = 16
D = np.linspace(0.5, 2.0, DIM)
SIGMA2 = 6.0
DELTA = np.random.default_rng(0).normal(size=DIM) * 0.15


def exact(delta=DELTA):
    """(|G|^2, tr(Sigma)) in closed form: G = D delta, and by Isserlis' theorem
    E|g|^2 = (delta'D delta + sigma^2) tr(D) + 2|D delta|^2, so
    tr(Sigma) = E|g|^2 - |G|^2 = (delta'D delta + sigma^2) tr(D) + |D delta|^2."""
    grad = D * delta
    grad_sq = grad @ grad
    return grad_sq, (delta @ (D * delta) + SIGMA2) * D.sum() + grad_sq


def sample(rng, shape):
    """Per-example residuals r and inputs x, shape + (DIM,) for x."""
    x = rng.standard_normal(size=(*shape, DIM)) * np.sqrt(D)
    r = x @ DELTA - rng.standard_normal(size=shape) * np.sqrt(SIGMA2)
    return r, x


def test_closed_form_matches_a_large_sample():
    """The reference itself: 1e6 examples' mean gradient and covariance trace."""
    rng = np.random.default_rng(1)
    n, total, total_sq = 0, np.zeros(DIM), 0.0
    for _ in range(5):  # 5 x 2e5 examples, summed as they come
        r, x = sample(rng, (200_000,))
        g = r[:, None] * x
        n, total, total_sq = n + len(g), total + g.sum(0), total_sq + np.einsum("nd,nd->", g, g)
    mean = total / n
    grad_sq, trace = exact()
    assert mean @ mean == pytest.approx(grad_sq, rel=0.02)
    assert total_sq / n - mean @ mean == pytest.approx(trace, rel=0.01)


def test_smoothed_noise_scale_recovers_the_true_one():
    """The trainer's measurement simulated 2000 times: b_big examples as m micro-batches of
    b_small; small_sq the mean of |g_i|^2, big_sq |mean g_i|^2."""
    grad_sq, trace = exact()
    true_b = trace / grad_sq
    b_small, m, measurements = 32, 8, 2000
    assert 50 < true_b < 500 and b_small < true_b < b_small * m * 2  # a realistic regime
    rng = np.random.default_rng(2)
    r, x = sample(rng, (measurements, m, b_small))
    g_i = np.einsum("tmb,tmbd->tmd", r, x) / b_small  # micro-batch mean gradients
    small_sq = (g_i**2).sum(-1).mean(1)
    big_sq = (g_i.mean(1) ** 2).sum(-1)
    ns = NoiseScale(decay=0.995)
    for s, b in zip(small_sq, big_sq, strict=True):
        value = ns.update(s, b_small, b, b_small * m)
    assert value == ns.b_simple
    assert value == pytest.approx(true_b, rel=0.10)
    assert ns.grad_sq == pytest.approx(grad_sq, rel=0.10)
    assert ns.trace == pytest.approx(trace, rel=0.10)


def test_estimate_inverts_the_expectations_exactly():
    grad_sq, trace = 0.37, 52.0
    for b_small, b_big in [(32, 256), (1, 2), (4096, 65536)]:
        small = grad_sq + trace / b_small
        big = grad_sq + trace / b_big
        got = estimate(small, b_small, big, b_big)
        assert got == pytest.approx((grad_sq, trace), rel=1e-12)
    with pytest.raises(ValueError, match="b_small < b_big"):
        estimate(1.0, 64, 0.5, 64)


def test_first_value_is_not_pulled_toward_zero_and_weights_decay():
    """Bias correction (as in Adam): after one update the averages are the estimate
    itself; after two with decay 0.5, (0.25 e1 + 0.5 e2) / 0.75."""
    ns = NoiseScale(decay=0.5)
    assert ns.b_simple is None and ns.grad_sq is None
    e1 = estimate(2.0, 10, 1.2, 50)
    ns.update(2.0, 10, 1.2, 50)
    assert (ns.grad_sq, ns.trace) == pytest.approx(e1, rel=1e-12)
    assert ns.b_simple == pytest.approx(e1[1] / e1[0], rel=1e-12)
    e2 = estimate(3.0, 10, 1.0, 50)
    ns.update(3.0, 10, 1.0, 50)
    want = [(0.25 * a + 0.5 * b) / 0.75 for a, b in zip(e1, e2, strict=True)]
    assert [ns.grad_sq, ns.trace] == pytest.approx(want, rel=1e-12)


def test_no_value_while_an_average_is_not_positive():
    ns = NoiseScale()
    # big_sq much smaller than small_sq * b_small / b_big: the |G|^2 estimate is negative
    assert ns.update(1.0, 10, 0.01, 20) is None
    assert ns.grad_sq < 0 and ns.b_simple is None
    ns = NoiseScale()
    assert ns.update(1.0, 10, 1.5, 20) is None  # big above small: tr(Sigma) < 0
    assert ns.trace < 0


def test_state_round_trip_and_non_finite_inputs():
    rng = np.random.default_rng(3)
    inputs = [(1.0 + rng.random(), 16, 0.8 + 0.1 * rng.random(), 128) for _ in range(20)]
    a = NoiseScale(decay=0.8)
    for x in inputs[:10]:
        a.update(*x)
    b = NoiseScale()  # another decay: load must restore it too
    b.load(json.loads(json.dumps(a.state())))
    assert b.state() == a.state()
    for x in inputs[10:]:
        assert b.update(*x) == a.update(*x)  # bit-identical, not approximately
    before = a.state()
    current = a.b_simple
    assert current is not None
    bad_inputs = [(math.nan, 16, 0.9, 128), (1.5, 16, math.inf, 128), (1.5, 16, 0.9, math.nan)]
    bad_inputs.append((1e308, 16, 1e308, 128))  # finite inputs, an overflowing estimate
    for bad in bad_inputs:
        assert a.update(*bad) == current
    assert a.state() == before
    fresh = NoiseScale()
    assert fresh.update(math.nan, 16, 0.9, 128) is None
    assert fresh.state()["count"] == 0
