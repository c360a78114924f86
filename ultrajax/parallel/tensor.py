"""Tensor parallelism (Megatron-LM) and sequence parallelism, for per-device code.

The train step runs the model inside `shard_map` over the whole mesh, so every
array the block sees is this device's shard: heads, kv heads, d_ff and the
vocabulary split `tensor` ways. A TP region (attention, MLP, LM head) starts
with `enter` and ends with `exit` (Shoeybi et al. 2019, the `f` and `g`
operators; Korthikanti et al. 2022 for the sequence-parallel pair):

                     forward                      backward
  TP   enter  identity                     all-reduce
       exit   all-reduce                   identity
  SP   enter  all-gather along sequence    reduce-scatter along sequence
       exit   reduce-scatter along seq.    all-gather along sequence

With sequence parallelism the residual stream and the norms between regions
hold 1/tp of the sequence, so their activations shrink by tp, for the same
communication volume (an all-reduce is a reduce-scatter plus an all-gather).

Each operator is a `custom_vjp`, so the backward pass is exactly the table
above, independent of how shard_map would transpose a bare collective.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from ultrajax.model.nn import cross_entropy, cross_entropy_grad
from ultrajax.model.ops import lookup
from ultrajax.parallel.axes import TENSOR

SEQ = 1  # activations are (batch, length, ...)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def copy_to_region(x, axis):
    return jax.lax.pcast(x, axis, to="varying")  # same values; each rank now goes its own way


copy_to_region.defvjp(
    lambda x, axis: (copy_to_region(x, axis), None), lambda axis, _, g: (jax.lax.psum(g, axis),)
)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def reduce_from_region(x, axis):
    return jax.lax.psum(x, axis)


reduce_from_region.defvjp(
    lambda x, axis: (jax.lax.psum(x, axis), None),
    lambda axis, _, g: (jax.lax.pcast(g, axis, to="varying"),),  # the input varied
)


def _gather(x, axis):
    return jax.lax.all_gather(x, axis, axis=SEQ, tiled=True)


def _scatter(x, axis):
    return jax.lax.psum_scatter(x, axis, scatter_dimension=SEQ, tiled=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def gather_sequence(x, axis):
    return _gather(x, axis)


gather_sequence.defvjp(
    lambda x, axis: (_gather(x, axis), None), lambda axis, _, g: (_scatter(g, axis),)
)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def scatter_sequence(x, axis):
    return _scatter(x, axis)


scatter_sequence.defvjp(
    lambda x, axis: (_scatter(x, axis), None), lambda axis, _, g: (_gather(g, axis),)
)


@dataclass(frozen=True)
class TensorParallel:
    """The TP boundaries for code running per device under shard_map over `axis`."""

    size: int
    sequence_parallel: bool = False
    axis: str = TENSOR
    join_inputs = False  # each rank sums its input gradients before one collective anyway

    def enter(self, x):
        """Residual stream -> input of a TP region (whole sequence, same on every rank)."""
        if self.size == 1:
            return x
        if self.sequence_parallel:
            return gather_sequence(x, self.axis)
        return copy_to_region(x, self.axis)

    def exit(self, x):
        """Partial sums of a row-parallel matmul -> residual stream."""
        if self.size == 1:
            return x
        if self.sequence_parallel:
            return scatter_sequence(x, self.axis)
        return reduce_from_region(x, self.axis)

    def sum(self, x):
        """Sum of per-rank parts (vocabulary-parallel loss terms); backward: identity."""
        return x if self.size == 1 else reduce_from_region(x, self.axis)

    def max(self, x):
        """Max over ranks; used only for numerical stability, so no gradient."""
        x = jax.lax.stop_gradient(x)
        return x if self.size == 1 else jax.lax.pmax(x, self.axis)

    def vocab_start(self, local_vocab: int):
        return 0 if self.size == 1 else jax.lax.axis_index(self.axis) * local_vocab

    def constrain(self, x, names):
        """Per-device code: every array is already this device's shard."""
        return x

    def embed(self, table, tokens, dtype):
        """Vocabulary-parallel lookup: each rank owns a slice of rows; others give zeros."""
        if self.size == 1:
            return lookup(table, tokens, dtype)
        rows = table.shape[0]
        local = tokens - self.vocab_start(rows)
        mine = (local >= 0) & (local < rows)
        x = jnp.where(mine[..., None], lookup(table, jnp.clip(local, 0, rows - 1), dtype), 0)
        return self.exit(x.astype(dtype))

    def cross_entropy(self, logits, targets):
        return cross_entropy(logits, targets, self)

    def cross_entropy_grad(self, logits, targets, mask, dtype):
        return cross_entropy_grad(logits, targets, mask, self, dtype)
