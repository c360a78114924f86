"""The gradient noise scale B_simple = tr(Sigma) / |G|^2 (McCandlish et al. 2018, "An
Empirical Model of Large-Batch Training", appendix A.1): the batch size, in tokens, past
which a bigger batch mostly averages away noise instead of buying progress.

The trainer measures two squared gradient norms on the same parameters: the mean over
micro-batches of |g_i|^2 (b_small tokens each) and |G_step|^2 of the whole step (b_big
tokens). Since E|g_B|^2 = |G|^2 + tr(Sigma)/B, two batch sizes give unbiased estimates of
|G|^2 and tr(Sigma); each alone is noisy (and may be negative), so they are averaged apart
and divided last.

Tokens of one sequence are not independent examples, so B here counts tokens as if they
were: compare it with tokens per step, as the trainer does, not with sequences.

numpy-free and JAX-free: plain floats, so the trainer can call it on host values.
"""

from __future__ import annotations

import math


def estimate(small_sq: float, b_small: float, big_sq: float, b_big: float) -> tuple[float, float]:
    """Unbiased (|G|^2, tr(Sigma)) from two batch sizes:
    |G|^2 = (b_big*big_sq - b_small*small_sq)/(b_big - b_small),
    tr(Sigma) = (small_sq - big_sq)/(1/b_small - 1/b_big).

    Solves E|g_B|^2 = |G|^2 + tr(Sigma)/B at B = b_small and b_big."""
    if not 0 < b_small < b_big:
        raise ValueError(f"need 0 < b_small < b_big, got b_small={b_small}, b_big={b_big}")
    grad_sq = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
    trace = (small_sq - big_sq) / (1.0 / b_small - 1.0 / b_big)
    return grad_sq, trace


class NoiseScale:
    """Exponential moving averages of the two estimates, kept apart (the ratio of averages,
    not the average of ratios: each estimate alone is noisy and may be negative), and
    B_simple = tr(Sigma)/|G|^2 in tokens.

    The averages are bias-corrected like Adam's moments, so the first values are not pulled
    toward 0. An update whose inputs or estimates are not finite is ignored: one overflowed
    measurement must not poison the average for the rest of the run."""

    def __init__(self, decay: float = 0.9):
        if not 0 <= decay < 1:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        self.decay = float(decay)
        self._grad_sq = 0.0  # raw (uncorrected) averages, as Adam keeps them
        self._trace = 0.0
        self._count = 0  # updates taken: the bias correction's exponent

    def update(self, small_sq: float, b_small: float, big_sq: float, b_big: float) -> float | None:
        """Fold in one measurement; returns the current B_simple (see b_simple)."""
        inputs = (small_sq, b_small, big_sq, b_big)
        if not all(math.isfinite(float(v)) for v in inputs):
            return self.b_simple
        grad_sq, trace = estimate(*(float(v) for v in inputs))
        if not (math.isfinite(grad_sq) and math.isfinite(trace)):
            return self.b_simple
        d = self.decay
        self._grad_sq = d * self._grad_sq + (1 - d) * grad_sq
        self._trace = d * self._trace + (1 - d) * trace
        self._count += 1
        return self.b_simple

    def _corrected(self, raw: float) -> float | None:
        if self._count == 0:
            return None
        return raw / (1 - self.decay**self._count)

    @property
    def grad_sq(self) -> float | None:
        """The smoothed |G|^2 (None before the first update)."""
        return self._corrected(self._grad_sq)

    @property
    def trace(self) -> float | None:
        """The smoothed tr(Sigma) (None before the first update)."""
        return self._corrected(self._trace)

    @property
    def b_simple(self) -> float | None:
        """tr(Sigma)/|G|^2 in tokens; None until both averages are positive (a negative
        ratio is no batch size, and would break a log-log fit of it)."""
        if self._count == 0 or self._grad_sq <= 0 or self._trace <= 0:
            return None
        return self._trace / self._grad_sq  # the bias corrections cancel

    def state(self) -> dict:
        """JSON-able; floats round-trip exactly through json, so a resume is exact."""
        return {
            "decay": self.decay,
            "grad_sq": self._grad_sq,
            "trace": self._trace,
            "count": self._count,
        }

    def load(self, state: dict) -> None:
        self.decay = float(state["decay"])
        self._grad_sq = float(state["grad_sq"])
        self._trace = float(state["trace"])
        self._count = int(state["count"])
