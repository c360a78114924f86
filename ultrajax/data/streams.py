"""Logical streams: the global batch read as S independent packed streams, so that each
process packs only the rows its own devices hold, and so that the rows of a step depend
only on the seed, the data config, the global batch and the position.

A step's global batch of B rows is read as S streams (S divides B), each giving B / S
rows a step. S is `data.streams`, by default gcd(64, B): a function of the global batch
alone (of every global batch of a batch ramp), never of how it is split into grad_accum
micro-batches of n rows (n = micro_batch_size x dp) or over devices and processes. So
`8 x 1`, `2 x 4` and `mesh.data=2` read the same rows each step; the split only decides
which micro-batch each row goes to (`Tiling`), and the loss, summed over the step and
divided by its target count, is the same.

Stream k reads documents k, k + S, k + 2S, ... of the corpus's shuffled order (one
permutation per epoch, by index: no document is loaded to shuffle), packs them into rows
of seq_len + 1 tokens, and shuffles its rows within a window, so a long document's rows
land in different batches. A stream depends only on (seed, k, S, sources): the global
batch is the same whatever the number of processes, a process runs only the streams
holding its devices' rows, and a checkpoint's stream positions resume on any split.
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
# the global batch's size in config keys, none of them part of the run's identity
BATCH_KEYS = "train.micro_batch_size x data-parallel degree x train.grad_accum"


def stream_count(batches: Sequence[int], streams: int | None) -> int:
    """data.streams, or gcd(64, every global batch of the run in rows): the default reads
    the same rows whatever the micro-batch split, and is a multiple of every power-of-two
    process count that splits the batch, so each process packs whole streams."""
    if streams is None:
        return math.gcd(MAX_STREAMS, *batches)
    bad = [b for b in batches if streams < 1 or b % streams]
    if bad:
        raise ConfigError(
            f"data.streams={streams} does not split a global batch of {bad[0]} rows: make "
            f"every global batch ({BATCH_KEYS}) a multiple of {streams}"
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
class Tiling:
    """Where each stream's rows sit in a step of `grad_accum` micro-batches of n rows.

    A micro-batch's n rows are cut into gcd(S, n) blocks of consecutive rows (what a
    data-parallel split keeps together); the S / blocks streams sharing a block take
    equal runs of micro-batches in it. Stream k holds block k % blocks in micro-batches
    (k // blocks) x span onwards, row by row: with S = B every split puts stream k at
    row k, with grad_accum 1 stream k holds rows k x B / S onwards, and with S dividing
    n this is the layout older checkpoints were read with. A process holding whole
    blocks holds whole streams: every process does when S is a multiple of their number."""

    streams: int
    n: int  # rows of a micro-batch

    @property
    def blocks(self) -> int:
        return math.gcd(self.streams, self.n)

    @property
    def width(self) -> int:
        return self.n // self.blocks

    def span(self, grad_accum: int) -> int:
        """Micro-batches each stream fills in its block."""
        share = self.streams // self.blocks
        if grad_accum % share:
            raise ConfigError(
                f"{self.streams} streams do not split a global batch of {grad_accum * self.n} "
                f"rows: make it ({BATCH_KEYS}) a multiple of {self.streams}"
            )
        return grad_accum // share

    def stream_of(self, row: int, grad_accum: int) -> int:
        a, j = divmod(int(row), self.n)
        return a // self.span(grad_accum) * self.blocks + j // self.width

    def rows_of(self, k: int, grad_accum: int) -> list[int]:
        """Stream k's rows of a step, in the order it gives them."""
        span, (m, b) = self.span(grad_accum), divmod(k, self.blocks)
        start = b * self.width
        return [
            a * self.n + start + i
            for a in range(m * span, (m + 1) * span)
            for i in range(self.width)
        ]


@dataclass(frozen=True)
class Source:
    """One corpus's documents, by index: which to read (train or eval) and how to read
    one as [BOS] ids [EOS] int32 tokens. `weight`: its share of rows in a mixture."""

    ids: np.ndarray
    read: Callable[[int], np.ndarray]
    weight: float = 1.0
    name: str = ""
    tokens: int | None = None  # of all its documents, where known without reading them


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
    superset of the rows asked for).

    `default`: the count is the default, not data.streams, so a resume may continue a
    checkpoint's other count. `batch_sizes`: the run's other global batches (a ramp)."""

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
        default: bool = False,
        batch_sizes: Sequence[int] = (),
    ):
        if batch_size % grad_accum:
            raise ConfigError(f"{grad_accum} micro-batches do not split {batch_size} rows")
        self.n, self.default = batch_size // grad_accum, default
        self.batches = sorted({batch_size, *batch_sizes})
        self._asked = (grad_accum, range(batch_size) if rows is None else [int(r) for r in rows])
        self._grad_accum = grad_accum
        self._stream = dict(
            sources=sources, window=window, seed=seed, seq_len=seq_len,
            cross_doc_mask=cross_doc_mask,
        )  # fmt: skip
        self._configure(streams)

    def _configure(self, count: int) -> None:
        """Read the data as `count` streams: the tiling, the streams owned, their iterators."""
        self.tiling = Tiling(count, self.n)
        for b in self.batches:
            self.tiling.span(b // self.n)  # refuses a count that does not split a batch
        ga, wanted = self._asked
        self.owned = sorted({self.tiling.stream_of(r, ga) for r in wanted})
        self._its = {k: iter(stream(k=k, n=count, **self._stream)) for k in self.owned}

    @property
    def count(self) -> int:
        return self.tiling.streams

    @property
    def grad_accum(self) -> int:
        return self._grad_accum

    @grad_accum.setter
    def grad_accum(self, value: int) -> None:
        """A batch ramp's new size: more micro-batches of the same n rows, the same streams."""
        self.tiling.span(value)
        self._grad_accum = value

    @property
    def rows(self) -> np.ndarray:
        """The global row numbers of what `next()` gives, at the current grad_accum."""
        return np.array([r for k in self.owned for r in self.tiling.rows_of(k, self.grad_accum)])

    def describe(self) -> str:
        """The start line's account: how many streams, their rows a step, this process's share."""
        per = self.grad_accum * self.n // self.count
        mine = len(self.owned)
        some = "" if mine == self.count else f"; this process packs {mine} of them"
        return f"{self.count} streams of {per} row{'s' * (per > 1)} a step{some}"

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        step = self.grad_accum * self.n // self.count
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
            self._adopt(int(state["streams"]))
        missing = [k for k in self.owned if str(k) not in state["positions"]]
        if missing:
            raise ConfigError(f"the checkpoint's data state lacks streams {missing}")
        for k, it in self._its.items():
            it.set_state(_from_json(state["positions"][str(k)]))

    def _adopt(self, saved: int) -> None:
        """Continue a checkpoint read as `saved` streams (another default: an older one, or
        another global batch). Its advice names no setting of the run's identity
        (config/parse.py), which would move the run to a directory of its own."""
        if not self.default:
            raise ConfigError(
                f"the checkpoint's data was read as {saved} streams and data.streams asks for "
                f"{self.count}: a resume continues the streams it saved, so resume it with the "
                "config that wrote it, or start the data over from its parameters with "
                "checkpoint.init_from"
            )
        bad = [b for b in self.batches if b % saved]
        if bad:
            raise ConfigError(
                f"the checkpoint's data was read as {saved} streams, which do not split a "
                f"global batch of {bad[0]} rows: to continue the same data, make every global "
                f"batch ({BATCH_KEYS}) a multiple of {saved}; or start the data over from its "
                "parameters with checkpoint.init_from"
            )
        self._configure(saved)


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
