"""Text -> packed training sequences, on grain.

Documents are tokenized as [BOS] text [EOS], concatenated and split into
sequences of seq_len + 1 tokens (grain's ConcatThenSplit packing: no padding,
so no compute is wasted). Packing records which document every token came from
(`segment_ids`) and its position inside that document (`positions`); with
`data.cross_doc_mask` the model uses them to keep attention and rotary
positions inside each document. A document split across two sequences starts
again at position 0 in the second one.

The default corpus is the running interpreter's own standard library: real
text on every machine, nothing downloaded.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import sysconfig
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import grain
import numpy as np
from tqdm import tqdm

from ultrajax import streams as streams_lib
from ultrajax.config import ConfigError, DataConfig
from ultrajax.prefetch import Prefetcher
from ultrajax.shards import PreparedCorpus
from ultrajax.tokenizer import ByteTokenizer, HFTokenizer, document, padded_vocab  # noqa: F401


def make_tokenizer(cfg: DataConfig):
    """data.tokenizer, or for prepared data the tokenizer its directory was made with."""
    if cfg.source == "prepared":
        return prepared_tokenizer(data_paths(cfg)[0])
    return ByteTokenizer() if cfg.tokenizer == "bytes" else HFTokenizer(cfg.tokenizer)


def prepared_tokenizer(path: str):
    """The tokenizer a prepared directory names (its tokenizer.json is copied inside)."""
    info = PreparedCorpus(path).tokenizer
    if info["kind"] == "bytes":
        return ByteTokenizer()
    return HFTokenizer(str(Path(path) / "tokenizer.json"))


# --------------------------------------------------------------------------- sources


@dataclass(frozen=True)
class Doc:
    """A document: a whole file, one JSONL record (by its byte offset: the text is read when
    the document is packed, never kept), or text given inline (tests)."""

    key: str
    path: str | None = None
    text: str | None = None
    offset: int | None = None  # a JSONL record: where its line starts

    def read(self) -> str:
        if self.text is not None:
            return self.text
        if self.offset is not None:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                line = f.readline()
            return json.loads(line.decode("utf-8", errors="replace"))["text"]
        return Path(self.path).read_text(encoding="utf-8", errors="replace")


def stdlib_docs() -> list[Doc]:
    """The interpreter's standard library .py files (no site-packages), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts and rel.parts[0] in ("site-packages", "dist-packages"):
            continue
        if path.is_file() and path.stat().st_size > 0:
            docs.append(Doc(key=str(rel), path=str(path)))
    if not docs:
        raise ConfigError(f"data.source=stdlib: no .py files found under {root}")
    return docs


def _jsonl_docs(path: str) -> list[Doc]:
    """One Doc per non-empty record, checked line by line and kept as an offset: the file is
    streamed, never held (`python -m ultrajax.data prepare` is the way for large corpora)."""
    docs, offset = [], 0
    with open(path, "rb") as f:
        for i, raw in enumerate(f):
            start, offset = offset, offset + len(raw)
            if not raw.strip():
                continue
            try:
                record = json.loads(raw.decode("utf-8", errors="replace"))
            except json.JSONDecodeError:
                raise ConfigError(f"data.path: {path} line {i + 1} is not valid JSON") from None
            text = record.get("text") if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise ConfigError(f"data.path: {path} line {i + 1} has no string field 'text'")
            if text:
                docs.append(Doc(key=f"{path}:{i}", path=path, offset=start))
    return docs


def file_docs(pattern: str) -> list[Doc]:
    """A file, a directory (every file below it) or a glob; .jsonl files hold one doc a line."""
    if any(ch in pattern for ch in "*?["):
        paths = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
        if not paths:
            raise ConfigError(f"data.path: the glob {pattern!r} matches no files")
    elif os.path.isdir(pattern):
        paths = sorted(str(p) for p in Path(pattern).rglob("*") if p.is_file())
        if not paths:
            raise ConfigError(f"data.path: the directory {pattern!r} holds no files")
    elif os.path.isfile(pattern):
        paths = [pattern]
    else:
        raise ConfigError(f"data.path: {pattern!r} does not exist")
    docs = []
    for p in paths:
        if p.endswith(".jsonl"):
            docs.extend(_jsonl_docs(p))
        elif os.path.getsize(p) > 0:
            docs.append(Doc(key=p, path=p))
    if not docs:
        raise ConfigError(f"data.path: {pattern!r} holds no text (every document is empty)")
    return docs


def split_docs(docs: list[Doc], eval_fraction: float) -> tuple[list[Doc], list[Doc]]:
    """Held-out split by document, stable under adding files (hash of the document key)."""
    train, held = split_ids([d.key for d in docs], eval_fraction)
    return [docs[i] for i in train], [docs[i] for i in held]


def split_ids(keys: list[str], eval_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """split_docs by index: (train, eval) positions in `keys`."""
    cut = int(eval_fraction * 2**32)
    held = np.array([zlib.crc32(k.encode()) < cut for k in keys], bool)
    return _keep_one(held, eval_fraction)


def split_indices(n: int, eval_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """The held-out split of n documents known by index only (prepared shards): a hash of
    the index, vectorised, so 25 million documents split in a moment."""
    x = np.arange(n, dtype=np.uint64)
    with np.errstate(over="ignore"):  # a 64-bit mixer (splitmix64's finaliser) wraps on purpose
        x ^= x >> np.uint64(33)
        x *= np.uint64(0xFF51AFD7ED558CCD)
        x ^= x >> np.uint64(33)
        x *= np.uint64(0xC4CEB9FE1A85EC53)
        x ^= x >> np.uint64(33)
    held = (x >> np.uint64(32)) < np.uint64(int(eval_fraction * 2**32))
    return _keep_one(held, eval_fraction)


def _keep_one(held: np.ndarray, eval_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    if eval_fraction <= 0:
        held[:] = False
    elif not held.any() and len(held) > 1:
        held[-1] = True
    train, evals = np.flatnonzero(~held), np.flatnonzero(held)
    if not len(train):
        raise ConfigError(
            f"data.eval_fraction={eval_fraction} leaves no training documents "
            f"out of {len(held)}; lower it"
        )
    return train, evals


def data_paths(cfg: DataConfig) -> list[str]:
    """data.path, or the paths of data.mixture."""
    return [m.path for m in cfg.mixture] if cfg.mixture else [cfg.path]


def load_docs(cfg: DataConfig, path: str | None = None) -> list[Doc]:
    return stdlib_docs() if cfg.source == "stdlib" else file_docs(path or cfg.path)


# --------------------------------------------------------------------------- pipeline


class _TextReader:
    """Document i of a text source as [BOS] ids [EOS], tokenized when it is packed."""

    def __init__(self, docs: list[Doc], tokenizer):
        self.docs, self.tok = docs, tokenizer

    def __call__(self, i: int) -> np.ndarray:
        return document(self.tok, self.docs[i].read())


def packed_dataset(
    docs: list[Doc],
    tokenizer,
    *,
    seq_len: int,
    batch_size: int,
    seed: int,
    cross_doc_mask: bool,
    shuffle: bool = True,
) -> grain.IterDataset:
    """Batches of {tokens, segment_ids, positions}, each (batch_size, seq_len + 1), forever:
    one stream over `docs` (no row shuffle), batched."""
    source = streams_lib.Source(np.arange(len(docs)), _TextReader(docs, tokenizer))
    ds = streams_lib.stream(
        [source], k=0, n=1, seed=seed, seq_len=seq_len, cross_doc_mask=cross_doc_mask,
        shuffle=shuffle,
    )  # fmt: skip
    return ds.batch(batch_size, drop_remainder=True)


@dataclass
class Data:
    """The run's train streams (checkpointable; this process's rows only), the fixed eval
    batches (every process the same, whole), and the background feed of train batches."""

    tokenizer: object
    train: streams_lib.Streams
    train_sources: list[streams_lib.Source]
    eval_sources: list[streams_lib.Source]
    batch_size: int
    seq_len: int
    seed: int
    cross_doc_mask: bool
    summary: str
    progress: dict | None = None  # what the train loop saves beside the data position
    _feed: Prefetcher | None = None
    _place: object = None
    _depth: int = 0

    @property
    def eval_docs(self) -> int:
        return sum(len(s.ids) for s in self.eval_sources)

    def eval_batches(self, n: int) -> list[dict]:
        if not self.eval_docs or n == 0:
            return []
        ds = streams_lib.stream(
            self.eval_sources, k=0, n=1, seed=self.seed, seq_len=self.seq_len,
            cross_doc_mask=self.cross_doc_mask, shuffle=False,
        )  # fmt: skip
        it = iter(ds.batch(self.batch_size, drop_remainder=True))
        return [next(it) for _ in range(n)]

    def feed(self, place, depth: int) -> Prefetcher:
        """Train batches made `depth` ahead on a thread: `place(packed, rows, grad_accum)`
        puts this process's rows (their global numbers `rows`) on the devices."""
        self.close()
        self._place, self._depth = place, depth
        t = self.train
        self._feed = Prefetcher(lambda: place(next(t), t.rows, t.grad_accum), t.get_state, depth)
        return self._feed

    def regroup(self, grad_accum: int) -> Prefetcher:
        """A new batch size from the next step on (ultrajax/ramp.py): the batches made ahead
        at the old size are dropped and the streams go back to the last one trained on."""
        consumed = self._feed.state() if self._feed else self.train.get_state()
        self.close()
        self.train.set_state(consumed)
        self.train.grad_accum = grad_accum
        return self.feed(self._place, self._depth)

    def state(self) -> dict:
        """The position after the last batch trained on, every process's streams in one,
        with `progress` (the batch ramp's state, ultrajax/ramp.py) beside it."""
        local = self._feed.state() if self._feed else self.train.get_state()
        return dict(streams_lib.gather_state(local), progress=self.progress)

    def restore(self, state: dict) -> None:
        self.close()
        self.train.set_state(state)
        self.progress = state.get("progress")

    def close(self) -> None:
        if self._feed is not None:
            self._feed.close()
            self._feed = None


def _sources(cfg: DataConfig, tokenizer) -> tuple[list, list, list[str]]:
    """(train sources, eval sources, one description per corpus)."""
    weights = [m.weight for m in cfg.mixture] if cfg.mixture else [1.0]
    train, evals, names = [], [], []
    first = None
    for path, weight in zip(data_paths(cfg), weights, strict=True):
        if cfg.source == "prepared":
            corpus = PreparedCorpus(path)
            info = {k: corpus.tokenizer.get(k) for k in ("kind", "sha256", "size")}
            first = first or (path, info)
            if info != first[1]:
                raise ConfigError(
                    f"data.mixture: {path} was prepared with another tokenizer than {first[0]} "
                    f"({info} vs {first[1]}); prepare both with the same one"
                )
            t, e = split_indices(len(corpus), cfg.eval_fraction)
            read, size = corpus.__getitem__, f"{corpus.tokens:,} tokens"
        else:
            docs = load_docs(cfg, path)
            t, e = split_ids([d.key for d in docs], cfg.eval_fraction)
            read, size = _TextReader(docs, tokenizer), "tokenized as read"
        name = path or cfg.source
        train.append(streams_lib.Source(t, read, weight, name))
        evals.append(streams_lib.Source(e, read, weight, name))
        share = f", weight {weight:g}" if cfg.mixture else ""
        names.append(f"{name} ({len(t):,} train / {len(e):,} eval documents, {size}{share})")
    if all(not len(e.ids) for e in evals):
        evals = []
    else:
        evals = [e for e in evals if len(e.ids)]
    return train, evals, names


def build(
    cfg: DataConfig,
    *,
    seq_len: int,
    batch_size: int,
    seed: int,
    vocab_size: int,
    grad_accum: int = 1,
    rows=None,
) -> Data:
    """Everything the train loop reads, with bad input reported as ConfigError.

    `rows`: the global batch rows this process's devices hold (None: all of them); only
    the streams holding them are read and packed here."""
    tokenizer = make_tokenizer(cfg)
    if tokenizer.size > vocab_size:
        raise ConfigError(
            f"model.vocab_size ({vocab_size}) is smaller than the tokenizer's "
            f"{tokenizer.size} tokens; set model.vocab_size={padded_vocab(tokenizer.size)}"
        )
    train, evals, names = _sources(cfg, tokenizer)
    n = streams_lib.stream_count(batch_size // grad_accum, cfg.streams)
    streams = streams_lib.Streams(
        train, batch_size=batch_size, grad_accum=grad_accum, streams=n, seed=seed,
        seq_len=seq_len, cross_doc_mask=cfg.cross_doc_mask, window=cfg.shuffle_window,
        rows=rows,
    )  # fmt: skip
    per = batch_size // n
    mine = "" if len(streams.owned) == n else f"; this process packs {len(streams.owned)} of them"
    summary = f"data: {'; '.join(names)}; {n} streams of {per} row{'s' * (per > 1)} a step{mine}"
    return Data(
        tokenizer, streams, train, evals, batch_size, seq_len, seed, cfg.cross_doc_mask, summary
    )


# --------------------------------------------------------------------------- command line


def bench(argv: list[str]) -> int:
    """`python -m ultrajax.data bench --config FILE [--steps N] [--processes P] [overrides]`:
    the pipeline alone (no model, no devices), as one process of P data-parallel ones."""
    from ultrajax import cli

    p = cli.parser("python -m ultrajax.data bench", bench.__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="timed batches (default 20)")
    p.add_argument(
        "--processes", type=int, default=1, help="pack the rows of 1 of P processes (default 1)"
    )
    args = p.parse_args(argv)
    cfg = cli.load_config(args)
    if any(v == -1 for v in cfg.mesh.sizes().values()):
        cli.fail("data bench needs concrete mesh sizes (the global batch depends on them)")
    b, t = cfg.global_batch, cfg.train
    rows = streams_lib.data_parallel_rows(0, args.processes, b, t.grad_accum)
    t0 = time.perf_counter()
    d = build(cfg.data, seq_len=cfg.model.seq_len, batch_size=b, seed=t.seed,
              vocab_size=cfg.model.vocab_size, grad_accum=t.grad_accum, rows=rows)  # fmt: skip
    opened = time.perf_counter() - t0
    print(d.summary)
    for _ in range(2):  # warm-up: first reads, page cache
        next(d.train)
    t0 = time.perf_counter()
    for _ in tqdm(range(args.steps), desc="batches", leave=False):
        next(d.train)
    seconds = time.perf_counter() - t0
    made = len(d.train.rows) * (cfg.model.seq_len + 1) * args.steps
    rate = made / seconds
    need = len(rows) * cfg.model.seq_len
    print("| process | rows packed / needed | tokens/s | ms per batch | opened in |")
    print("|---|---|---|---|---|")
    print(
        f"| 1 of {args.processes} | {len(d.train.rows)} / {len(rows)} of {b} | {rate:,.0f} | "
        f"{1e3 * seconds / args.steps:.1f} | {opened:.1f} s |"
    )
    print(
        f"a step trains on {need:,} tokens of this process's rows: the pipeline makes them in "
        f"{1e3 * need / rate:.1f} ms; a step slower than that never waits for data"
    )
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    usage = "usage: python -m ultrajax.data {prepare,bench} ... (--help after either)"
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        print("  prepare  tokenize a corpus once into shards (data.source=prepared)")
        print("  bench    time the data pipeline of a config alone, tokens/s per process")
        return 0
    if argv[0] == "prepare":
        from ultrajax import prepare

        return prepare.main(argv[1:])
    if argv[0] == "bench":
        return bench(argv[1:])
    print(f"error: unknown command {argv[0]!r} ({usage})", file=sys.stderr)
    return 2


if __name__ == "__main__":
    from ultrajax import cli

    cli.run(main)
