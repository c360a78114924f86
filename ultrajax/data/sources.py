"""Documents: the standard library's source, text and JSONL files, prepared token
shards; the tokenizer each needs; the train/eval split by document."""

from __future__ import annotations

import glob
import os
import sysconfig
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ultrajax.config.schema import ConfigError, DataConfig
from ultrajax.data import records
from ultrajax.data.shards import MANIFEST, PreparedCorpus, prepared_manifest
from ultrajax.data.tokenizer import ByteTokenizer, HFTokenizer, document, padded_vocab  # noqa: F401


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
                text = records.read_line(f.readline()).text  # as checked when listed
            if text is None:
                raise ConfigError(f"data.path: {self.key} changed since the run started")
            return text
        return Path(self.path).read_text(encoding="utf-8", errors="replace")


def stdlib_docs() -> list[Doc]:
    """The interpreter's standard library .py files (no site-packages), sorted as paths.

    Walked with site-packages left out, not globbed and filtered: an environment with
    torch and transformers installed holds tens of thousands of files there, and the
    glob cost every run's start 0.9 s (the same list: no symbolic link followed)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = []
    for top, dirs, files in os.walk(root):
        if Path(top) == root:
            dirs[:] = [d for d in dirs if d not in ("site-packages", "dist-packages")]
        paths += [Path(top, f) for f in files if f.endswith(".py")]
    docs = []
    for path in sorted(paths):
        if path.is_file() and path.stat().st_size > 0:
            docs.append(Doc(key=str(path.relative_to(root)), path=str(path)))
    if not docs:
        raise ConfigError(f"data.source=stdlib: no .py files found under {root}")
    return docs


class Problems:
    """The bad lines of a text source (data/records.py: what `prepare` counts), counted by
    kind with the first few as file:line; data.strict makes the first one an error."""

    SHOWN = 5

    def __init__(self, strict: bool = False):
        self.strict, self.kinds, self.first, self.last = strict, Counter(), [], None

    def add(self, path: str, line: int, problem: records.Problem) -> None:
        where = f"{path}:{line}: {problem.reason}"
        if self.strict:
            raise ConfigError(
                f"data.strict: {where}; set data.strict=false to skip bad lines (bad "
                "characters: replaced) and report them"
            )
        self.kinds[problem.kind] += 1
        self.last = where
        if len(self.first) < self.SHOWN:
            self.first.append(where)

    def report(self) -> str | None:
        """What the run prints once at start, or None: no problems."""
        if not self.kinds:
            return None
        note = (
            ", JSONL lines without text skipped and bad characters replaced (data.strict=true "
            "refuses them)"
        )
        return "data: " + records.describe(self.kinds, self.first, self.SHOWN, note)


def _jsonl_docs(path: str, problems: Problems) -> list[Doc]:
    """One Doc per line with text, checked line by line and kept as an offset: the file is
    streamed, never held (`python -m ultrajax.data prepare` is the way for large corpora)."""
    docs, offset = [], 0
    with open(path, "rb") as f:
        for i, raw in enumerate(f):
            start, offset = offset, offset + len(raw)
            record = records.read_line(raw)
            for p in record.problems:
                problems.add(path, i + 1, p)
            if record.text is not None:
                docs.append(Doc(key=f"{path}:{i}", path=path, offset=start))
    return docs


READ_SAID = 256 * 2**20  # bytes of text from which reading them is said before, with a bar


def _reading(paths: list[str], pattern: str):
    """Every file is read before the first step (about 50 MB/s): on a large corpus that
    was minutes without a word. From READ_SAID bytes on, process 0 says so first, and
    shows a bar on a terminal; below, a bar that shows nothing."""
    import jax
    from tqdm import tqdm

    total = sum(os.path.getsize(p) for p in paths)
    lead = jax.process_index() == 0
    if total >= READ_SAID and lead:
        print(
            f"data: reading {len(paths):,} file{'s' * (len(paths) > 1)} "
            f"({total / 2**30:.2f} GiB) of {pattern} for their documents (python -m "
            "ultrajax.data prepare does it once, ahead)",
            flush=True,
        )
    show = total >= READ_SAID and lead
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="data",
                leave=False, disable=None if show else True)  # fmt: skip


def file_docs(pattern: str, problems: Problems | None = None) -> list[Doc]:
    """A file, a directory (every file below it) or a glob; .jsonl files hold one doc a line.
    Bad lines go to `problems` (None: left out or repaired, unreported), as `prepare`
    counts them: every file is read once here."""
    problems = Problems() if problems is None else problems
    before = sum(problems.kinds.values())
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
    for p in paths:  # token shards read as text would train on their bytes
        if Path(p).name == MANIFEST and prepared_manifest(p):
            raise ConfigError(
                f"data.path: {Path(p).parent} is a prepared directory (python -m ultrajax.data "
                "prepare made it), not text: read it with data.source=prepared"
            )
    docs = []
    with _reading(paths, pattern) as bar:
        for p in paths:
            if p.endswith(".jsonl"):
                docs.extend(_jsonl_docs(p, problems))
            elif os.path.getsize(p) > 0:
                _, problem = records.decode(Path(p).read_bytes())  # kept, with U+FFFD
                if problem is not None:
                    problems.add(p, problem.line, problem)
                docs.append(Doc(key=p, path=p))
            bar.update(os.path.getsize(p))
    bad = sum(problems.kinds.values()) - before
    if not docs and bad:
        raise ConfigError(
            f"data.path: {pattern!r} holds no usable text ({bad:,} bad JSONL "
            f"line{'s' * (bad > 1)}; the last: {problems.last})"
        )
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


def load_docs(
    cfg: DataConfig, path: str | None = None, problems: Problems | None = None
) -> list[Doc]:
    """The documents of data.source (stdlib or files), bad JSONL lines into `problems`."""
    if cfg.source == "stdlib":
        return stdlib_docs()
    return file_docs(path or cfg.path, Problems(cfg.strict) if problems is None else problems)


# --------------------------------------------------------------------------- reading


class TextReader:
    """Document i of a text source as [BOS] ids [EOS], tokenized when it is packed."""

    def __init__(self, docs: list[Doc], tokenizer):
        self.docs, self.tok = docs, tokenizer

    def __call__(self, i: int) -> np.ndarray:
        return document(self.tok, self.docs[i].read())
