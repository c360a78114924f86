"""An MoE layer's boundary on a mesh (model/boundaries.py `ExpertBoundary`).

Tensor parallelism: its ranks hold the same tokens (the MoE layer runs between the
block's `enter` and `exit`) and each its slice of every expert's hidden size; they route
alike, attach a 1/tp share of each balance loss, and report their statistics as one.

Counts: the balance losses and the capacity rule are over the micro-batch's tokens on
every rank that splits them, so the counts they read are summed (`tokens`) or prefixed
(`before`) over the manual token axes, in the batch's row order (the partitioner's
arrays are global already).

Expert parallelism (`mesh.expert`, docs/moe.md): rank r of the `expert` axis holds
experts [r·E/n, (r+1)·E/n). An MoE layer's assignments, sorted by expert, are therefore
sorted by the rank that holds their expert: one all-to-all sends each rank its rows
(with each row's local expert), the rank regroups what it received by local expert and
runs its experts' grouped matmuls, and a second all-to-all brings the outputs home. The
transpose of an all-to-all is the reverse all-to-all, so the backward pass moves the
same bytes the other way.

The exchange has static shapes: each rank sends every other a slot of T·k rows (its
whole micro-batch's assignments, the most one rank can receive from it when no token
is dropped), so the bytes on the wire are n·T·k·d per rank and direction, whatever the
routing. A ragged all-to-all (`jax.lax.ragged_all_to_all`, not implemented on XLA:CPU)
would move only the rows routed elsewhere: (n-1)/n·T·k·d when balanced.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from ultrajax.model.boundaries import ExpertBoundary
from ultrajax.parallel.axes import EXPERT


@dataclass(frozen=True)
class Experts(ExpertBoundary):
    token_axes: tuple[str, ...] = ()  # the manual axes that split the micro-batch's tokens
    expert_ranks: int = 1  # mesh.expert, when this code is manual over it
    copy_axis: str | None = None  # the manual axis whose ranks hold the same tokens (tensor)

    def same(self, x):
        return jax.lax.pmean(x, self.copy_axis) if self.copy_axis else x

    def tokens(self, x):
        return jax.lax.psum(x, self.token_axes) if self.token_axes else x

    def before(self, counts):
        if not self.token_axes:
            return jnp.zeros_like(counts)
        every = jax.lax.all_gather(counts, self.token_axes)  # (ranks, ...) in row order
        me = jax.lax.axis_index(self.token_axes)
        return (jnp.cumsum(every, axis=0) - every)[me]

    def experts(self, mlp, xs, sorted_e, sizes):
        n = self.expert_ranks
        if n == 1:
            return mlp(xs, sizes)
        rows, local = xs.shape[0], sizes.shape[0] // n
        # out: each row to the rank of its expert, at its place among that rank's rows
        dest = sorted_e // local
        first = (jnp.cumsum(sizes) - sizes)[::local]  # each rank's first row
        slot = jnp.arange(rows) - first[dest]
        send = jnp.zeros((n, rows, xs.shape[1]), xs.dtype).at[dest, slot].set(xs)
        ids = jnp.full((n, rows), local, jnp.int32).at[dest, slot].set(sorted_e % local)
        got = jax.lax.all_to_all(send, EXPERT, 0, 0).reshape(n * rows, -1)
        got_ids = jax.lax.all_to_all(ids, EXPERT, 0, 0).reshape(-1)  # `local`: an empty slot
        # here: the received rows grouped by local expert (empty slots last, in no group)
        order = jnp.argsort(got_ids, stable=True)
        counts = jnp.bincount(got_ids, length=local).astype(jnp.int32)
        ys = mlp(got[order], counts)
        back = jnp.zeros_like(order).at[order].set(jnp.arange(n * rows, dtype=order.dtype))
        home = jax.lax.all_to_all(ys[back].reshape(n, rows, -1), EXPERT, 0, 0)
        return home[dest, slot]
