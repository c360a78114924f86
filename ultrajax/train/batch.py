"""The batch the step reads: inputs and targets already shifted, built in one place.

Packing gives rows of seq_len + 1 tokens. Shifting them into inputs and next-token
targets here, once, on the host, means no device ever needs its neighbour's token:
once the sequence is split across devices (context parallelism) a slice's last
target would live on the next device. The loss mask (which targets count) is
decided here too, so the step only multiplies and sums.

Every field is (grad_accum, rows, seq_len): micro-batches along the first axis,
the rows of one micro-batch over all data-parallel ranks along the second.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from ultrajax.parallel.axes import DATA_AXES, SEQUENCE_AXIS


class Batch(NamedTuple):
    inputs: np.ndarray  # token ids the model reads
    targets: np.ndarray  # the token after each input
    segment_ids: np.ndarray  # document of each input (packing), 0 = padding
    positions: np.ndarray  # position of each input inside its document
    loss_mask: np.ndarray  # 1 where the target counts, else 0


def target_mask(segment_ids, cross_doc_mask: bool):
    """Which next-token targets count, from the segment ids of seq_len + 1 tokens: not
    padding (segment 0) and, with cross-document masking, not the first token of the
    next document."""
    seg_in, seg_tgt = segment_ids[..., :-1], segment_ids[..., 1:]
    valid = seg_tgt > 0
    if cross_doc_mask:
        valid &= seg_tgt == seg_in
    return valid


def make(packed: dict, cross_doc_mask: bool, grad_accum: int | None = None, order=None) -> Batch:
    """Packed rows {tokens, segment_ids, positions}, each (..., seq_len + 1) -> Batch.

    With `grad_accum`, rows (n, seq_len + 1) are split into (grad_accum, n / grad_accum)
    micro-batches; without it the leading axes are kept as they are. `order` permutes the
    sequence after the shift (context parallelism's zig-zag layout, parallel/context.py):
    every field moves alike, so a token keeps its target, position and document."""
    tokens = np.asarray(packed["tokens"], np.int32)
    seg = np.asarray(packed["segment_ids"], np.int32)
    pos = np.asarray(packed["positions"], np.int32)
    out = Batch(
        inputs=tokens[..., :-1],
        targets=tokens[..., 1:],
        segment_ids=seg[..., :-1],
        positions=pos[..., :-1],
        loss_mask=target_mask(seg, cross_doc_mask).astype(np.int32),
    )
    if order is not None:
        out = Batch(*(a[..., order] for a in out))
    if grad_accum is not None:
        out = Batch(*(a.reshape(grad_accum, -1, a.shape[-1]) for a in out))
    return Batch(*(np.ascontiguousarray(a) for a in out))


def random_packed(n_rows: int, seq_len: int, vocab_size: int, rng, documents: int = 1) -> dict:
    """Packed rows of random tokens (benchmarks: nothing to read): `documents` a row, of
    uneven lengths (cut at distinct random places), ids rising from 1 along the row and
    positions counted from each document's start, as the data pipeline packs them."""
    shape = (n_rows, seq_len + 1)
    if not 1 <= documents <= seq_len + 1:
        raise ValueError(f"documents must be in 1..{seq_len + 1} a row, got {documents}")
    tokens = rng.integers(0, vocab_size, size=shape, dtype=np.int32)
    seg = np.ones(shape, np.int32)
    pos = np.broadcast_to(np.arange(seq_len + 1, dtype=np.int32), shape).copy()
    for row in range(n_rows if documents > 1 else 0):
        cuts = np.sort(rng.choice(np.arange(1, seq_len + 1), documents - 1, replace=False))
        for cut in cuts:
            seg[row, cut:] += 1
            pos[row, cut:] -= pos[row, cut]
    return {"tokens": tokens, "segment_ids": seg, "positions": pos}


SPEC = PartitionSpec(None, DATA_AXES, SEQUENCE_AXIS)


def specs() -> Batch:
    """Every field's PartitionSpec: rows split over data x fsdp, length over sequence."""
    return Batch(*(SPEC for _ in Batch._fields))


def sharding(mesh) -> NamedSharding:
    """(grad_accum, rows, length): rows split over data x fsdp, length over sequence."""
    return NamedSharding(mesh, SPEC)


def place(batch: Batch, sharding_: NamedSharding) -> Batch:
    """Host arrays -> global jax arrays. Every process holds the same global batch
    (docs/multihost.md); each of its devices copies only its own slice."""
    return Batch(
        *(jax.make_array_from_callback(a.shape, sharding_, lambda idx, a=a: a[idx]) for a in batch)
    )


def rows_needed(sharding_: NamedSharding, grad_accum: int, rows: int, seq_len: int) -> list[int]:
    """The packed rows (0..rows-1 of a global batch) that this process's devices hold.

    A packed row r is micro-batch r // (rows / grad_accum), row r % (rows / grad_accum) of
    it (`make`); the sharding says which of those each local device holds."""
    per = rows // grad_accum
    shape = (grad_accum, per, seq_len)
    out = set()
    for idx in sharding_.addressable_devices_indices_map(shape).values():
        for a in range(grad_accum)[idx[0]]:
            out.update(a * per + j for j in range(per)[idx[1]])
    return sorted(out)


def place_rows(batch: Batch, rows: np.ndarray, total: int, grad_accum: int, sharding_) -> Batch:
    """This process's packed rows (len(rows), seq_len) -> global (grad_accum, total /
    grad_accum, seq_len) arrays. `rows` gives each local row's global number; every
    device must find all of its rows among them (`rows_needed`)."""
    where = np.full(total, -1, np.int64)
    where[np.asarray(rows)] = np.arange(len(rows))
    where = where.reshape(grad_accum, total // grad_accum)

    def piece(idx, a):
        sel = where[idx[0], idx[1]]
        if (sel < 0).any():
            raise ValueError("a device asked for a row this process did not make")
        return a[sel][..., idx[2]]

    shape = (grad_accum, total // grad_accum, batch.inputs.shape[-1])
    return Batch(
        *(jax.make_array_from_callback(shape, sharding_, lambda i, a=a: piece(i, a)) for a in batch)
    )


def abstract(grad_accum: int, rows: int, seq_len: int, sharding_=None) -> Batch:
    """ShapeDtypeStructs of a batch (analysis: nothing allocated)."""
    shape = (grad_accum, rows, seq_len)
    return Batch(
        *(jax.ShapeDtypeStruct(shape, np.int32, sharding=sharding_) for _ in Batch._fields)
    )
