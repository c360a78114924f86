"""The mesh axes, named once: the five, in order from the slowest links to the
fastest, and the groups of them the step reads."""

from __future__ import annotations

AXES = ("data", "fsdp", "pipeline", "sequence", "tensor")  # slowest to fastest links

DATA_AXES = ("data", "fsdp")  # the rows of a micro-batch are split over these
SEQUENCE_AXIS = "sequence"  # and each row along its length over this (context parallelism)
TOKEN_AXES = (*DATA_AXES, SEQUENCE_AXIS)  # every token lives on one of these shards
