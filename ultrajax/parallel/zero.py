"""ZeRO (Rajbhandari et al. 2020): which copies of the model are sharded over `fsdp`.

  stage  optimizer state + master  gradients          compute-dtype weights
  0      whole                     whole              whole
  1      sharded                   whole, scattered   whole (gathered once a step)
                                   at the last micro-batch
  2      sharded                   sharded: scattered whole (gathered once a step)
                                   every micro-batch
  3      sharded                   sharded, likewise  sharded: each layer gathered in
                                                      the forward and again backward,
                                                      one layer ahead (`prefetches`)

Every array is sharded along its `embed` dimension (present in every weight but an MoE
router's bias, E numbers a layer, which stays whole).
This file is the one place that knows what a stage means; the rules table, the
step, the memory model and the analyzer ask it.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax

from ultrajax.model import units
from ultrajax.model.prefetch import MIN_LAYERS
from ultrajax.parallel.axes import FSDP

AXIS = FSDP


@dataclass(frozen=True)
class Zero:
    stage: int
    size: int = 1  # the fsdp axis size

    @property
    def shards_state(self) -> bool:
        return self.stage >= 1

    @property
    def shards_grads(self) -> bool:
        """Gradients are reduce-scattered every micro-batch into a sharded accumulator."""
        return self.stage >= 2

    @property
    def shards_params(self) -> bool:
        return self.stage >= 3

    @property
    def active(self) -> int:
        """The stage that matters: on a one-wide fsdp axis every stage is plain DP."""
        return self.stage if self.size > 1 else 0

    def scatter(self, names, last: bool):
        """(axis, dimension) of this micro-batch's reduce-scatter for a weight with these
        logical names, or None: every micro-batch from stage 2, the last from stage 1."""
        if self.size == 1 or self.stage == 0 or (self.stage == 1 and not last):
            return None
        if "embed" not in names:
            return None
        return (AXIS, names.index("embed"))

    def gather(self, w, names):
        """Per-device code: the whole weight from this rank's shard (compute dtype)."""
        if self.size == 1 or "embed" not in names:
            return w
        return jax.lax.all_gather(w, AXIS, axis=names.index("embed"), tiled=True)


def prefetches(cfg) -> bool:
    """Whether the layer scan gathers each layer one iteration ahead (model/prefetch.py):
    ZeRO-3 on a wider-than-one fsdp axis, parallel.prefetch, and a layer (a unit of dense
    and MoE layers: model/units.py) to fetch ahead.
    The step, the memory model and the planner ask here."""
    z = Zero(cfg.parallel.zero, cfg.mesh.fsdp)
    return (
        z.shards_params
        and bool(z.active)
        and cfg.parallel.prefetch
        and (units.count(cfg.model) >= MIN_LAYERS)
    )
