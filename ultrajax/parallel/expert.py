"""An MoE layer's boundary on a mesh (model/boundaries.py `ExpertBoundary`): the balance
losses are over the micro-batch's tokens on every rank that splits them, so the counts
they read are summed over the manual data axes (the partitioner's arrays are global
already). Expert parallelism's dispatch over an `expert` axis will live here."""

from __future__ import annotations

from dataclasses import dataclass

import jax

from ultrajax.model.boundaries import ExpertBoundary


@dataclass(frozen=True)
class Experts(ExpertBoundary):
    token_axes: tuple[str, ...] = ()  # the manual axes that split the micro-batch's tokens

    def tokens(self, x):
        return jax.lax.psum(x, self.token_axes) if self.token_axes else x
