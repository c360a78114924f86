"""Measuring the gradient noise scale during a run (`train.noise_every`).

Every noise_every steps, before the step, each micro-batch's gradient norm alone, at the
parameters the step is about to use (the small batch); the step's own gradient norm is
the big batch. The norms stay on the devices until the next host sync (a log step), where
they are folded into the NoiseScale of train/noise.py: measuring costs no extra sync.
"""

from __future__ import annotations

import jax
import numpy as np

from ultrajax.config.schema import Config
from ultrajax.train import batch as batch_lib
from ultrajax.train.noise import NoiseScale
from ultrajax.train.setup import RunParts
from ultrajax.train.step import jit_grad_norm


class NoiseProbe:
    """The compiled one-micro-batch gradient norm, the measurements waiting for a host
    sync, and the NoiseScale they feed (restored from a checkpoint's `progress`)."""

    def __init__(self, cfg: Config, parts: RunParts, state: dict, progress: dict | None):
        t = cfg.train
        self.every = t.noise_every
        self.scale = NoiseScale()
        if progress and progress.get("noise"):
            self.scale.load(progress["noise"])
        self._pending = []  # (micro-batch norms and targets, step norm, step targets)
        self._probe = None
        if self.every:  # compiled ahead, like the step: a measurement never stops to compile
            params_sh = {"params": jax.tree.map(lambda a: a.sharding, state["params"])}
            grad_norm = jit_grad_norm(cfg, parts.mesh, parts.rules, params_sh, parts.batch_sh)
            rows = t.micro_batch_size * cfg.dp
            one = batch_lib.abstract(1, rows, cfg.model.seq_len, parts.batch_sh)
            self._probe = grad_norm.lower(state["params"], one).compile()
        self._take = jax.jit(
            lambda b, i: batch_lib.Batch(*(jax.lax.dynamic_index_in_dim(a, i, 0) for a in b)),
            out_shardings=parts.batch_sh,
        )

    @property
    def b_simple(self) -> float | None:
        return self.scale.b_simple

    def state(self) -> dict:
        return self.scale.state()

    def measure(self, params, batch: batch_lib.Batch, grad_accum: int, step: int):
        """Each micro-batch's (gradient norm, targets) when a measurement is due at `step`,
        else None. One micro-batch has no smaller batch to compare with."""
        if self._probe is None or grad_accum <= 1 or step % self.every != 0:
            return None
        return [self._probe(params, self._take(batch, i)) for i in range(grad_accum)]

    def keep(self, small, out: dict) -> None:
        """Hold `measure`'s norms with the step's own, on the devices, until `fold`."""
        if small is not None:
            self._pending.append((small, out["grad_norm"], out["n_targets"]))

    def fold(self) -> None:
        """At a host sync: every waiting measurement into the noise scale."""
        for parts, big, b_big in jax.device_get(self._pending):
            small_sq = float(np.mean([float(n) ** 2 for n, _ in parts]))
            b_small = float(np.mean([float(c) for _, c in parts]))
            self.scale.update(small_sq, b_small, float(big) ** 2, float(b_big))
        self._pending.clear()
