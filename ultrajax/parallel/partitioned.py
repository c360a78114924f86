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

from ultrajax.model.nn import cross_entropy, cross_entropy_grad
from ultrajax.model.ops import lookup
from ultrajax.parallel.mesh import Rules

RESIDUAL = ("batch", "norm_length", "embed")  # between TP regions (SP splits the length)
REGION = ("batch", "length", "embed")  # input of a TP region: the whole sequence


@dataclass(frozen=True)
class Partitioned:
    """Sharding constraints at the TP/SP boundaries; the partitioner does the rest."""

    rules: Rules
    size: int = 1  # single-device semantics for code that asks (the loss)
    # q, k, v (and gate, up) as one matmul: one reduction of their input gradient where
    # the partitioner reduces each matmul's partial sums on its own (5 a layer, not 2)
    join_inputs: bool = False

    def constrain(self, x, names):
        return jax.lax.with_sharding_constraint(x, self.rules.spec(names))

    def enter(self, x):
        """Forward: pinned in the residual layout first, so the all-gather moves x as it
        comes (the norm's output in the compute dtype), not the fp32 values before its
        cast. Backward: the region's input gradient (partial sums) goes straight to the
        residual layout: one reduce-scatter under SP, where a constraint to the region's
        layout first would all-reduce it and slice after."""

        @jax.custom_vjp
        def enter(x):
            return self.constrain(self.constrain(x, RESIDUAL), REGION)

        def fwd(x):
            return enter(x), None

        def bwd(_, g):
            return (self.constrain(g, RESIDUAL),)

        enter.defvjp(fwd, bwd)
        return enter(x)

    def exit(self, x):
        return self.constrain(x, RESIDUAL)

    def embed(self, table, tokens, dtype):
        return self.exit(lookup(table, tokens, dtype))

    def cross_entropy(self, logits, targets):
        return cross_entropy(logits, targets, None)

    def cross_entropy_grad(self, logits, targets, mask, dtype):
        return cross_entropy_grad(logits, targets, mask, None, dtype)
