"""The mesh axes, named once: the five, in order from the slowest links to the
fastest, and the groups of them the step reads (docs/parallelism.md).

  data      pure replicas (typically across nodes)
  fsdp      the ZeRO axis: the batch and, by stage, optimizer state, gradients, weights
  pipeline  stages of the layer stack
  sequence  context parallelism (ring attention)
  tensor    Megatron tensor parallelism (+ sequence parallelism of the norms)
"""

from __future__ import annotations

DATA, FSDP, PIPELINE, SEQUENCE, TENSOR = AXES = ("data", "fsdp", "pipeline", "sequence", "tensor")

DATA_AXES = (DATA, FSDP)  # the rows of a micro-batch are split over these
SEQUENCE_AXIS = SEQUENCE  # and each row along its length over this (context parallelism)
TOKEN_AXES = (*DATA_AXES, SEQUENCE_AXIS)  # every token lives on one of these shards
