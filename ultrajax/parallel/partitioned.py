"""Tensor and sequence parallelism left to XLA's partitioner (`parallel.collectives: gspmd`).

The same boundaries as parallel/tensor.py, but each one only says where an
activation should live, in logical names that the rules table (ultrajax/parallel/mesh.py)
maps to mesh axes; XLA's SPMD partitioner then inserts the collectives that
get it there (Xu et al. 2021, "GSPMD"). Entering a TP region asks for the
whole sequence; leaving it asks for the residual-stream layout, which with
sequence parallelism is split over `tensor` too: the partitioner turns the
row-parallel matmul's partial sums into an all-reduce, or a reduce-scatter
under SP, and the column-parallel input into an all-gather under SP.

The vocabulary-parallel loss needs nothing here: the logits are constrained to
`vocab` over `tensor`, and the partitioner reduces the log-sum-exp's max and
sum across ranks as scalars per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax

from ultrajax.model.nn import cross_entropy
from ultrajax.model.ops import lookup
from ultrajax.parallel.mesh import Rules

RESIDUAL = ("batch", "norm_length", "embed")  # between TP regions (SP splits the length)
REGION = ("batch", "length", "embed")  # input of a TP region: the whole sequence


@dataclass(frozen=True)
class Partitioned:
    """Sharding constraints at the TP/SP boundaries; the partitioner does the rest."""

    rules: Rules
    size: int = 1  # single-device semantics for code that asks (the loss)

    def constrain(self, x, names):
        return jax.lax.with_sharding_constraint(x, self.rules.spec(names))

    def enter(self, x):
        return self.constrain(x, REGION)

    def exit(self, x):
        return self.constrain(x, RESIDUAL)

    def embed(self, table, tokens, dtype):
        return self.exit(lookup(table, tokens, dtype))

    def cross_entropy(self, logits, targets):
        return cross_entropy(logits, targets, None)
