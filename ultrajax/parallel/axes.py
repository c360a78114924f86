"""The mesh axes, named once: the six, in order from the slowest links to the
fastest, and the groups of them the step reads (docs/parallelism.md).

  data      pure replicas (typically across nodes)
  fsdp      the ZeRO axis: the batch and, by stage, optimizer state, gradients, weights
  pipeline  stages of the layer stack
  expert    expert parallelism: an MoE layer's experts split over it, its tokens sent to
            them and back (all-to-all); everything else sees it as one more data axis
  sequence  context parallelism (ring attention)
  tensor    Megatron tensor parallelism (+ sequence parallelism of the norms)
"""

from __future__ import annotations

DATA, FSDP, PIPELINE, EXPERT, SEQUENCE, TENSOR = AXES = (
    "data",
    "fsdp",
    "pipeline",
    "expert",
    "sequence",
    "tensor",
)

DATA_AXES = (DATA, FSDP, EXPERT)  # the rows of a micro-batch are split over these
SEQUENCE_AXIS = SEQUENCE  # and each row along its length over this (context parallelism)
TOKEN_AXES = (*DATA_AXES, SEQUENCE_AXIS)  # every token lives on one of these shards
