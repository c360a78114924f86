"""One device's view from inside the tick loop, training or evaluating: its
micro-batches and layer chunks, the type of the residual stream between stages, its row
of the plan at a tick, and its neighbours on the ring.

Every device runs the same program but its own branch at each tick, so everything a
tick touches is typed as varying over `pipeline` once, here, before the loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax

from ultrajax.config.schema import Config
from ultrajax.kernels.varying import vary, vma
from ultrajax.model.stack import embed
from ultrajax.parallel.axes import PIPELINE
from ultrajax.parallel.partitioned import RESIDUAL
from ultrajax.parallel.pipeline.buffers import buffer, read
from ultrajax.parallel.pipeline.plan import COLUMNS, FWD, FWD_FIRST, FWD_LAST

AXIS = PIPELINE


@dataclass(frozen=True, eq=False)
class Stream:
    """The residual stream between stages. Every value that stands for it (embedded,
    received, a branch's zeros) gets this one type: both branches of a conditional must
    agree, and under the partitioner its layout too."""

    struct: jax.ShapeDtypeStruct
    axes: tuple[str, ...]  # its varying axes: the embedding's and `pipeline`
    tp: object  # layout.tp: the tensor-parallel constraints

    def vary(self, x):
        return vary(x, self.axes)

    def residual(self, x):
        return self.tp.constrain(vary(x, self.axes), RESIDUAL)

    def zeros(self, lead=()):
        return buffer(self.struct, self.axes, lead)


@dataclass(frozen=True, eq=False)
class Device:
    """What one device reads at every tick: its micro-batches and compute weights (typed
    as varying over `pipeline`), its layers as its v chunks, its place on the ring."""

    cfg: Config
    tp: object  # layout.tp
    index: jax.Array  # this device's position on `pipeline`
    batch: object  # the step's micro-batches (train.batch.Batch), leading axis m
    segments: jax.Array | None  # the batch's segment ids, with cross-document masking
    cparams: dict  # the compute copy; its layers hold this device's chunks in turn
    chunks: dict  # cparams["layers"] as (v, layers per chunk, ...)
    stream: Stream

    @classmethod
    def make(cls, cfg: Config, layout, cparams: dict, batch, v: int) -> Device:
        """Per device, inside the step's shard_map; `cparams`' layers in `layer_order`."""
        index = jax.lax.axis_index(AXIS)
        batch = jax.tree.map(lambda a: vary(a, (AXIS,)), batch)
        cparams = jax.tree.map(lambda a: vary(a, (AXIS,)), cparams)
        segments = batch.segment_ids if cfg.data.cross_doc_mask else None
        chunks = jax.tree.map(
            lambda a: a.reshape(v, a.shape[0] // v, *a.shape[1:]), cparams["layers"]
        )
        x0 = jax.eval_shape(lambda: embed(cfg.model, cparams, batch.inputs[0], tp=layout.tp))
        axes = tuple(sorted(vma(x0) | {AXIS}))
        stream = Stream(jax.ShapeDtypeStruct(x0.shape, x0.dtype), axes, layout.tp)
        return cls(cfg, layout.tp, index, batch, segments, cparams, chunks, stream)

    @property
    def n_chunks(self) -> int:
        """v: the chunks (virtual stages) this device holds."""
        return jax.tree.leaves(self.chunks)[0].shape[0]

    def micro(self, i):
        """(micro-batch i, its segment ids or None)."""
        mb = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, False), self.batch)
        seg = self.segments
        return mb, None if seg is None else jax.lax.dynamic_index_in_dim(seg, i, 0, False)

    def stage_input(self, branch, act_buf, slot, mb):
        """A forward's input: the embedded tokens on the first stage, else the activation
        that arrived from the stage before (slot `slot` of `act_buf`)."""
        return jax.lax.cond(
            branch == FWD_FIRST,
            lambda: self.stream.residual(
                embed(self.cfg.model, self.cparams, mb.inputs, tp=self.tp)
            ),
            lambda: self.stream.residual(read(act_buf, slot)),
        )

    def row(self, rows) -> dict:
        """This device's row of the plan at a tick, by column name."""
        mine = jax.lax.dynamic_index_in_dim(rows, self.index, 0, False)
        return {c: mine[k] for k, c in enumerate(COLUMNS)}


def forwards(branch):
    """Whether the branch is a forward (the first and last stages' included)."""
    return (branch == FWD) | (branch == FWD_FIRST) | (branch == FWD_LAST)


def ring(p: int, step: int) -> list[tuple[int, int]]:
    """ppermute pairs: every device sends to the one `step` places along the ring."""
    return [(k, (k + step) % p) for k in range(p)]


def send(flag, x, pairs):
    """x moved along `pairs` at a tick where any device sends (`flag`), else kept."""
    return jax.lax.cond(flag, lambda a: jax.lax.ppermute(a, AXIS, pairs), lambda a: a, x)
