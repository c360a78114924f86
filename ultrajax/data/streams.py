"""Logical streams: the global batch read as S independent packed streams, so that each
process packs only the rows its own devices hold.

A global batch is grad_accum micro-batches of n rows (n = micro_batch_size x dp). Row j
of every micro-batch belongs to stream k = j // (n / S): stream k gives n / S consecutive
rows of each micro-batch, grad_accum x n / S rows a step. Data parallelism splits the n
rows of a micro-batch over processes, so with S a multiple of the process count each
process holds whole streams, whatever grad_accum is. Stream k reads documents k, k + S,
k + 2S, ... of the corpus's shuffled order (one permutation per epoch, by index: no
document is loaded to shuffle), packs them into rows of seq_len + 1 tokens, and shuffles
its rows within a window, so a long document's rows land in different batches. A stream
depends only on (seed, k, S, sources): the global batch is the same whatever the number
of processes, a process runs only the streams holding its devices' rows, and a
checkpoint's stream positions resume on any process count. S is `data.streams`, by
default gcd(n, 64).
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grain
import jax
import numpy as np
from jax.experimental import multihost_utils

from ultrajax.config.schema import ConfigError

MAX_STREAMS = 64
STATE_FORMAT = "streams"


def stream_count(micro_rows: int, streams: int | None) -> int:
    """data.streams, or gcd(n, 64) for micro-batches of n rows: as many streams as split
    a micro-batch evenly."""
    if streams is None:
        return math.gcd(micro_rows, MAX_STREAMS)
    if streams < 1 or micro_rows % streams:
        raise ConfigError(
            f"data.streams={streams} must divide the rows of a micro-batch "
            f"({micro_rows} = train.micro_batch_size x data-parallel degree); leave it null "
            f"for gcd(rows, {MAX_STREAMS})"
        )
    return streams


def data_parallel_rows(p: int, processes: int, batch_size: int, grad_accum: int) -> list[int]:
    """The rows process p of `processes` holds under pure data parallelism: its share of
    each micro-batch (what batch.rows_needed gives there; for `data bench` and tests)."""
    per = batch_size // grad_accum
    if per % processes:
        raise ConfigError(f"{processes} processes do not split micro-batches of {per} rows evenly")
    share = per // processes
    return [a * per + j for a in range(grad_accum) for j in range(p * share, (p + 1) * share)]


@dataclass(frozen=True)
class Source:
    """One corpus's documents, by index: which to read (train or eval) and how to read
    one as [BOS] ids [EOS] int32 tokens. `weight`: its share of rows in a mixture."""

    ids: np.ndarray
    read: Callable[[int], np.ndarray]
    weight: float = 1.0
    name: str = ""


class _Read(grain.transforms.Map):
    def __init__(self, read):
        self.read = read

    def map(self, i):
        return {"tokens": self.read(int(i))}


class Finalize(grain.transforms.Map):
    """Name the packing outputs; without cross-document masking, one segment per row."""

    def __init__(self, cross_doc_mask: bool):
        self.cross_doc_mask = cross_doc_mask

    def map(self, row):
        tokens = row["tokens"]
        seg = row["tokens_segment_ids"].astype(np.int32)
        pos = row["tokens_positions"].astype(np.int32)
        if not self.cross_doc_mask:
            seg = (seg > 0).astype(np.int32)
            pos = np.broadcast_to(np.arange(tokens.shape[-1], dtype=np.int32), tokens.shape)
        return {"tokens": tokens.astype(np.int32), "segment_ids": seg, "positions": np.array(pos)}


class _WindowShuffle(grain.IterDataset):
    """Rows shuffled within consecutive windows of `window`, a fresh permutation a window.

    grain's WindowShuffleIterDataset does the same but draws each position through
    index_shuffle (~1.7 ms a row here); one numpy permutation a window costs microseconds.
    Resuming re-reads the window from its start (its parent's state is kept), so a
    checkpoint holds no rows."""

    def __init__(self, parent: grain.IterDataset, window: int, seed: int):
        super().__init__(parent)
        self.window, self.seed = window, seed

    def __iter__(self):
        return _WindowShuffleIterator(self._parent.__iter__(), self.window, self.seed)


class _WindowShuffleIterator(grain.DatasetIterator):
    def __init__(self, parent, window: int, seed: int):
        super().__init__(parent)
        self.window, self.seed = window, seed
        self._index, self._pos, self._rows = 0, 0, []
        self._start = copy.deepcopy(self._parent.get_state())

    def _fill(self) -> None:
        rows = [next(self._parent) for _ in range(self.window)]
        order = np.random.default_rng([self.seed, self._index]).permutation(len(rows))
        self._rows = [rows[i] for i in order]

    def __next__(self):
        if self._pos == len(self._rows):
            if self._rows:
                self._index += 1
            self._start = copy.deepcopy(self._parent.get_state())
            self._fill()
            self._pos = 0
        self._pos += 1
        return self._rows[self._pos - 1]

    def get_state(self):
        # `_start` is already a copy, never changed in place; Streams.get_state copies the whole
        return {"start": self._start, "window": self._index, "pos": self._pos}

    def set_state(self, state):
        self._start = copy.deepcopy(state["start"])
        self._index, self._pos = state["window"], state["pos"]
        self._parent.set_state(copy.deepcopy(self._start))
        self._fill()


def _packed(source: Source, *, seed: int, k: int, n: int, seq_len: int, shuffle: bool):
    """Documents k, k + n, ... of the source's (shuffled, repeated) order, packed into rows."""
    ds = grain.MapDataset.source(source.ids)
    if shuffle:
        ds = ds.shuffle(seed=seed)  # a new permutation every epoch
    ds = ds.repeat(None)
    if n > 1:
        ds = ds[k::n]
    # no read-ahead threads: a read is a slice of a memory map or one document's tokens,
    # and the whole batch is already made on a thread of its own (ultrajax/data/prefetch.py)
    ds = ds.map(_Read(source.read)).to_iter_dataset(grain.ReadOptions(num_threads=0))
    return grain.experimental.ConcatThenSplitIterDataset(ds, length_struct={"tokens": seq_len + 1})


def stream(
    sources: Sequence[Source],
    *,
    k: int,
    n: int,
    seed: int,
    seq_len: int,
    cross_doc_mask: bool,
    window: int = 0,
    shuffle: bool = True,
) -> grain.IterDataset:
    """Stream k of n: rows {tokens, segment_ids, positions}, each (seq_len + 1,), forever.

    Several sources are packed apart and mixed row by row in proportion to their weights
    (grain's deterministic mixing): a row holds one source's documents, so the weights
    are shares of tokens."""
    parts = [
        _packed(s, seed=seed + 1_000_003 * i, k=k, n=n, seq_len=seq_len, shuffle=shuffle)
        for i, s in enumerate(sources)
    ]
    ds = parts[0] if len(parts) == 1 else grain.IterDataset.mix(parts, [s.weight for s in sources])
    if shuffle and window > 1:
        ds = _WindowShuffle(ds, window, seed * MAX_STREAMS * 1024 + k)
    return ds.map(Finalize(cross_doc_mask))


class Streams:
    """This process's streams, stepped together. `next()` gives the rows of each global
    batch that it holds: a dict of (len(rows), seq_len + 1) arrays, where `rows` lists
    their global row numbers (a * n + j for micro-batch a, row j: whole streams, a
    superset of the rows asked for)."""

    def __init__(
        self,
        sources: Sequence[Source],
        *,
        batch_size: int,
        grad_accum: int,
        streams: int,
        seed: int,
        seq_len: int,
        cross_doc_mask: bool,
        window: int = 0,
        rows: Sequence[int] | None = None,
    ):
        n = batch_size // grad_accum
        if batch_size % grad_accum or n % streams:
            raise ConfigError(f"{streams} streams do not split micro-batches of {n} rows")
        self.grad_accum, self.count, self.n = grad_accum, streams, n
        self.per = n // streams  # rows of each micro-batch a stream gives
        wanted = range(batch_size) if rows is None else rows
        self.owned = sorted({int(r) % n // self.per for r in wanted})
        common = dict(n=streams, seed=seed, seq_len=seq_len, cross_doc_mask=cross_doc_mask)
        self._its = {k: iter(stream(sources, k=k, window=window, **common)) for k in self.owned}

    @property
    def rows(self) -> np.ndarray:
        """The global row numbers of what `next()` gives, at the current grad_accum (which a
        batch ramp changes between steps: more micro-batches of the same rows)."""
        n, per = self.n, self.per
        return np.array(
            [
                a * n + k * per + i
                for k in self.owned
                for a in range(self.grad_accum)
                for i in range(per)
            ]
        )

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        step = self.grad_accum * self.per
        out = [next(self._its[k]) for k in self.owned for _ in range(step)]
        return {key: np.stack([row[key] for row in out]) for key in out[0]}

    def get_state(self) -> dict:
        """A copy: the iterators go on (on the prefetch thread) without changing it."""
        return {
            "format": STATE_FORMAT,
            "streams": self.count,
            "positions": {str(k): copy.deepcopy(it.get_state()) for k, it in self._its.items()},
        }

    def set_state(self, state: dict) -> None:
        if state.get("format") != STATE_FORMAT:
            raise ConfigError(
                "the checkpoint's data position is from an older data pipeline (one stream "
                "packed by every process) and cannot be continued; resume from a newer "
                "checkpoint, or start the data over with checkpoint.init_from (parameters only)"
            )
        if state["streams"] != self.count:
            raise ConfigError(
                f"the checkpoint's data was read as {state['streams']} streams, this config "
                f"makes {self.count}: set data.streams={state['streams']} to continue the "
                "same data (it must divide the global batch)"
            )
        missing = [k for k in self.owned if str(k) not in state["positions"]]
        if missing:
            raise ConfigError(f"the checkpoint's data state lacks streams {missing}")
        for k, it in self._its.items():
            it.set_state(_from_json(state["positions"][str(k)]))


def _from_json(state):
    """Undo what a JSON round trip (the checkpoint) does to grain's packing state: its
    slices are tuples, compared with (-1, -1), and come back as lists, which would read
    as "a partly used document is pending" and skip or repeat tokens."""
    if isinstance(state, dict):
        return {
            k: {f: tuple(v) for f, v in sl.items()} if k == "remainder_slices" else _from_json(sl)
            for k, sl in state.items()
        }
    return state


def gather_state(local: dict) -> dict:
    """Every process's stream positions in one state (each process holds only its own
    streams): what a checkpoint saves, so that any process count can resume it."""

    if jax.process_count() == 1:
        return local

    blob = np.frombuffer(json.dumps(local["positions"]).encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.array([blob.size]))).reshape(-1)
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[: blob.size] = blob
    every = np.asarray(multihost_utils.process_allgather(padded))
    positions = {}
    for size, row in zip(sizes, every, strict=True):
        positions.update(json.loads(row[: int(size)].tobytes().decode()))
    return dict(local, positions=dict(sorted(positions.items(), key=lambda kv: int(kv[0]))))
