"""Tokenize a corpus once into token shards (data/shards.py) that training reads by slicing.

    python -m ultrajax.data prepare --input GLOB [--input GLOB ...] --tokenizer bytes|PATH \
        --out DIR [--workers N] [--strict] [--shard-mib M] [--overwrite]

The inputs are cut into pieces: runs of whole files in sorted order, and large JSONL files
into byte ranges of about --shard-mib MiB aligned to line starts. Each piece becomes one
shard, written by a worker process; the pieces depend only on the files and --shard-mib,
so the output is byte-identical whatever --workers. Everything is streamed: memory holds
one document (plus a shard's offsets), never a file or the corpus.

Nothing is dropped silently: bad lines (invalid JSON, no "text", not an object, invalid
UTF-8) are counted by kind with file:line, printed and kept in the manifest; --strict
makes the first one an error. The result is written beside DIR and renamed into place at
the end, so an interrupted run never leaves a directory that looks complete.

This module imports no JAX at load time: its workers are spawned processes.
"""

from __future__ import annotations

import glob
import json
import math
import multiprocessing
import os
import shutil
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from ultrajax.config.schema import ConfigError
from ultrajax.data import records, tokenizer
from ultrajax.data.shards import FORMAT, MANIFEST, VERSION, ShardWriter, sha256, token_dtype
from ultrajax.data.tokenizer import document

FIRST_PROBLEMS = 100  # kept in the manifest (and per piece: enough to know the first overall)
PRINTED_PROBLEMS = 20


# --------------------------------------------------------------------------- inputs


def find_inputs(patterns: Sequence[str], exclude: Sequence[Path] = ()) -> list[tuple[str, int]]:
    """(path, bytes) of every file the patterns name, sorted, each file once.

    A pattern is a file, a directory (every file below it) or a glob (`**` recursive).
    Each pattern must match something: a typo in one of several must not go unnoticed.
    Files under `exclude` (the output directory) are left out."""

    excluded = [os.path.realpath(p) for p in exclude]
    found: dict[str, str] = {}  # real path -> the path as matched
    for pattern in patterns:
        if os.path.isfile(pattern):
            paths = [pattern]
        elif os.path.isdir(pattern):
            paths = [str(p) for p in Path(pattern).rglob("*") if p.is_file()]
        elif any(ch in pattern for ch in "*?["):
            paths = [p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p)]
        else:
            raise ConfigError(f"--input {pattern!r} does not exist")
        real = {p: os.path.realpath(p) for p in paths}
        paths = [
            p
            for p in paths
            if not any(real[p] == e or real[p].startswith(e + os.sep) for e in excluded)
        ]
        if not paths:
            raise ConfigError(f"--input {pattern!r} matches no files")
        for p in paths:
            found.setdefault(real[p], os.path.normpath(p))
    paths = sorted(set(found.values()))
    return [(p, os.path.getsize(p)) for p in paths]


def plan_pieces(files: Sequence[tuple[str, int]], piece_bytes: int) -> list[list[tuple]]:
    """Cut the files into pieces of about `piece_bytes`, in input order.

    A piece is a list of segments (path, start, end): small files are grouped until the
    group reaches `piece_bytes`; a larger JSONL file gets pieces of its own, equal byte
    ranges (no tiny last shard). Empty files make no segment. Deterministic: it depends
    only on the file list, their sizes and `piece_bytes`."""
    pieces: list[list[tuple]] = []
    group: list[tuple] = []
    group_bytes = 0
    for path, size in files:
        if size == 0:
            continue
        if path.endswith(".jsonl") and size > piece_bytes:
            if group:
                pieces.append(group)
                group, group_bytes = [], 0
            n = math.ceil(size / piece_bytes)
            pieces.extend([(path, size * k // n, size * (k + 1) // n)] for k in range(n))
            continue
        group.append((path, 0, size))
        group_bytes += size
        if group_bytes >= piece_bytes:
            pieces.append(group)
            group, group_bytes = [], 0
    if group:
        pieces.append(group)
    return pieces


# --------------------------------------------------------------------------- workers


def load_tokenizer(spec: str):
    """`bytes` or a tokenizer.json path -> the tokenizer (ultrajax.tokenizer: no JAX)."""

    if spec == "bytes":
        return tokenizer.ByteTokenizer()
    if not os.path.isfile(spec):
        raise ConfigError(f"--tokenizer: file {spec!r} does not exist (or use --tokenizer bytes)")
    return tokenizer.HFTokenizer(spec)


class _Piece:
    """One piece's reading state: the shard being written, line counts and problems."""

    def __init__(self, tokenizer, writer: ShardWriter, strict: bool):
        self.tok, self.writer, self.strict = tokenizer, writer, strict
        self.problems: list[tuple[int, int, str, str]] = []  # (segment, line, kind, reason)
        self.kinds: Counter = Counter()
        self.skipped: Counter = Counter()

    @property
    def stop(self) -> bool:
        return self.strict and bool(self.kinds)

    def problem(self, segment: int, line: int, kind: str, reason: str) -> None:
        self.kinds[kind] += 1
        if len(self.problems) < FIRST_PROBLEMS:
            self.problems.append((segment, line, kind, reason))

    def add(self, text: str) -> None:
        """[BOS] ids [EOS], as a text source builds it when it packs (tokenizer.document)."""
        doc = document(self.tok, text)
        if int(doc.max()) >= self.tok.size:
            raise ConfigError(
                f"the tokenizer produced id {int(doc.max())} for a vocabulary of "
                f"{self.tok.size}: its tokenizer.json is inconsistent"
            )
        self.writer.add(doc)

    def text_file(self, segment: int, path: str) -> None:
        """A whole file is one document, decoded as ultrajax.data.Doc.read does (UTF-8
        with replacement, universal newlines)."""
        raw = Path(path).read_bytes()
        if not raw:  # emptied since it was planned
            self.skipped["empty file"] += 1
            return
        text, bad = records.decode(raw)
        if bad is not None:
            self.problem(segment, bad.line, bad.kind, bad.reason)
        self.add(text.replace("\r\n", "\n").replace("\r", "\n"))

    def jsonl_range(
        self, segment: int, path: str, start: int, end: int, progress: Callable | None
    ) -> int:
        """Every line that starts inside [start, end): one document each. Returns the
        number of lines read, so line numbers of later pieces of the file can be known."""
        lines, reported = 0, start
        with open(path, "rb", buffering=1 << 20) as f:
            if start > 0:
                f.seek(start - 1)
                f.readline()  # the end of a line that started before `start`: not ours
            pos = f.tell()
            while pos < end and not self.stop:
                raw = f.readline()
                if not raw:
                    break
                pos += len(raw)
                lines += 1
                if progress is not None and pos - reported >= 1 << 23:
                    progress(min(pos, end) - reported)
                    reported = min(pos, end)
                self._record(segment, lines, raw)
        if progress is not None:
            progress(end - reported)
        return lines

    def _record(self, segment: int, line: int, raw: bytes) -> None:
        """One JSONL line, checked as the files source checks it (data/records.py)."""
        record = records.read_line(raw)
        for p in record.problems:
            self.problem(segment, line, p.kind, p.reason)
        if record.text is not None:
            self.add(record.text)
        elif record.skipped is not None:
            self.skipped[record.skipped] += 1


def _run_piece(task: tuple, progress: Callable | None = None) -> dict:
    """Tokenize one piece into the shard `piece-<index>` of `directory` (in a worker)."""
    index, segments, tokenizer, directory, dtype, strict = task
    piece = _Piece(
        load_tokenizer(tokenizer), ShardWriter(directory, f"piece-{index:05d}", dtype), strict
    )
    lines = []
    for s, (path, start, end) in enumerate(segments):
        try:
            if path.endswith(".jsonl"):
                lines.append(piece.jsonl_range(s, path, start, end, progress))
            else:
                piece.text_file(s, path)
                lines.append(0)
                if progress is not None:
                    progress(end - start)
        except OSError as e:  # unreadable input, full disk: one line, not a traceback
            raise ConfigError(f"while reading {path}: {e}") from None
        if piece.stop:
            break
    return {
        "shard": piece.writer.close(),
        "bytes": sum(end - start for _, start, end in segments),
        "lines": lines,
        "problems": piece.problems,
        "kinds": dict(piece.kinds),
        "skipped": dict(piece.skipped),
    }


# --------------------------------------------------------------------------- prepare


def prepare(
    inputs: Sequence[str],
    tokenizer: str,
    out: str | Path,
    *,
    workers: int | None = None,
    strict: bool = False,
    shard_mib: float = 256,
    overwrite: bool = False,
    command: Sequence[str] | None = None,
) -> dict:
    """Tokenize `inputs` with `tokenizer` (`bytes` or a tokenizer.json) into the prepared
    directory `out`; returns its manifest. Raises ConfigError on bad input (with --strict,
    on the first problem), leaving nothing at `out`."""
    return tokenize_corpus(inputs, tokenizer, out, workers, strict, shard_mib, overwrite, command)[
        0
    ]


def tokenize_corpus(inputs, tokenizer, out, workers, strict, shard_mib, overwrite, command):
    """(the manifest, the number of worker processes used): `prepare` and the command."""
    if not 0 < shard_mib < math.inf:
        raise ConfigError(f"--shard-mib must be > 0, got {shard_mib}")
    if workers is not None and workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {workers}")
    out = Path(out)
    _check_out(out, overwrite)
    tok = load_tokenizer(tokenizer)
    files = find_inputs(inputs, exclude=[out])
    pieces = plan_pieces(files, max(1, int(shard_mib * 2**20)))
    dtype = token_dtype(tok.size)
    n_workers = max(1, min(workers or os.cpu_count() or 1, len(pieces)))

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f"{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        tasks = [(i, p, tokenizer, str(tmp), dtype.str, strict) for i, p in enumerate(pieces)]
        results = _results(tasks, n_workers, sum(size for _, size in files))
        try:
            manifest = _collect(results, pieces, tmp, strict)
        finally:
            results.close()  # on an error: stops the workers at once
        empty = sum(size == 0 for _, size in files)
        if empty:
            manifest["skipped"] = dict(sorted({**manifest["skipped"], "empty file": empty}.items()))
        if not manifest["documents"]:
            kinds = ", ".join(f"{n:,} {k}" for k, n in manifest["problems"]["kinds"].items())
            raise ConfigError(
                f"no documents in the {len(files)} input file(s): "
                + (f"every one has a problem ({kinds})" if kinds else "all are empty")
            )
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "tokenizer": {
                "kind": "bytes" if tokenizer == "bytes" else "hf",
                "path": None if tokenizer == "bytes" else str(tokenizer),
                "sha256": None if tokenizer == "bytes" else sha256(Path(tokenizer)),
                "size": int(tok.size),
                "bos": None if tok.BOS is None else int(tok.BOS),
                "eos": int(tok.EOS),
            },
            "dtype": dtype.str,
            **manifest,
            "inputs": [{"path": p, "bytes": size} for p, size in files],
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
            "command": list(command) if command is not None else None,
        }
        if tokenizer != "bytes":
            shutil.copyfile(tokenizer, tmp / "tokenizer.json")
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        _replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _print_problems(manifest["problems"])
    return manifest, n_workers


def _check_out(out: Path, overwrite: bool) -> None:
    """Refuse to write over data: an existing non-empty DIR needs --overwrite, and even
    then must be a prepared directory (never delete a directory of something else)."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {str(out)!r} is a file, not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise ConfigError(
                f"--out {str(out)!r} exists and is not empty; pass --overwrite to replace it"
            )
        if not (out / MANIFEST).is_file():
            raise ConfigError(
                f"--out {str(out)!r} is not a prepared directory (no {MANIFEST}); "
                "refusing to replace it even with --overwrite"
            )


def _replace(tmp: Path, out: Path) -> None:
    """Move the finished directory into place; an old one is moved aside first and
    removed after, so `out` is at every moment either the old or the new directory."""
    old = None
    if out.is_dir():
        if any(out.iterdir()):
            old = out.parent / f"{out.name}.old-{os.getpid()}"
            os.rename(out, old)
        else:
            out.rmdir()
    os.rename(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _results(tasks: list[tuple], n_workers: int, total: int) -> Iterator[dict]:
    """Every piece's result, in order, as soon as it and those before it are done. One
    worker runs in this process (no start-up cost); more are spawned processes (never
    forked: the parent may hold JAX). Closing the generator stops them."""
    from tqdm import tqdm

    with tqdm(
        total=total, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr, disable=None
    ) as bar:
        if n_workers == 1:
            for task in tasks:
                yield _run_piece(task, bar.update)
            return
        with multiprocessing.get_context("spawn").Pool(n_workers) as pool:
            pending = [
                pool.apply_async(_run_piece, (task,), callback=lambda r: bar.update(r["bytes"]))
                for task in tasks
            ]
            for p in pending:
                yield p.get()


def _collect(results: Iterable[dict], pieces: list[list[tuple]], tmp: Path, strict: bool) -> dict:
    """Merge the pieces' results in order: shards renamed to shard-00000, ... (empty ones
    dropped), line numbers made absolute, problems counted and the first ones kept."""
    shards, kinds, skipped, first = [], Counter(), Counter(), []
    line_base: Counter = Counter()  # lines of each JSONL file in earlier pieces
    for result, segments in zip(results, pieces, strict=True):
        bases = []
        for (path, _, _), lines in zip(segments, result["lines"], strict=False):
            bases.append(line_base[path])
            line_base[path] += lines
        for segment, line, _, reason in result["problems"]:
            where = f"{segments[segment][0]}:{bases[segment] + line}: {reason}"
            if strict:
                raise ConfigError(f"{where} (--strict)")
            if len(first) < FIRST_PROBLEMS:
                first.append(where)
        kinds.update(result["kinds"])
        skipped.update(result["skipped"])
        entry = result["shard"]
        old = entry["name"]
        if entry["documents"] == 0:
            for suffix in ("tokens", "offsets"):
                (tmp / f"{old}.{suffix}").unlink()
            continue
        entry["name"] = f"shard-{len(shards):05d}"
        for suffix in ("tokens", "offsets"):
            os.rename(tmp / f"{old}.{suffix}", tmp / f"{entry['name']}.{suffix}")
        shards.append(entry)
    return {
        "documents": sum(s["documents"] for s in shards),
        "tokens": sum(s["tokens"] for s in shards),
        "shards": shards,
        "problems": {
            "count": sum(kinds.values()),
            "kinds": dict(sorted(kinds.items())),
            "first": first,
        },
        "skipped": dict(sorted(skipped.items())),
    }


def _print_problems(problems: dict) -> None:
    if problems["count"]:
        text = records.describe(problems["kinds"], problems["first"], PRINTED_PROBLEMS)
        print(text, file=sys.stderr)


# --------------------------------------------------------------------------- command line


def _si(x: float, unit: str = "") -> str:
    """2.7M, or with a unit 12.3 MB."""
    space = " " if unit else ""
    for prefix, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.1f}{space}{prefix}{unit}"
    return f"{x:.0f}{space}{unit}"


def summary(manifest: dict, out: str | Path, seconds: float, workers: int) -> str:
    """The one line a finished prepare prints."""
    dtype = np.dtype(manifest["dtype"])
    n_shards = len(manifest["shards"])
    bytes_in = sum(i["bytes"] for i in manifest["inputs"])
    bytes_out = manifest["tokens"] * dtype.itemsize + 8 * (manifest["documents"] + n_shards)
    rate = manifest["tokens"] / max(seconds, 1e-9)
    return (
        f"prepared {manifest['documents']:,} documents, {manifest['tokens']:,} tokens in "
        f"{n_shards} shard{'s' * (n_shards != 1)} ({dtype.name}, {_si(bytes_out, 'B')}) from "
        f"{_si(bytes_in, 'B')} in {seconds:.1f} s ({_si(rate)} tokens/s, {workers} "
        f"worker{'s' * (workers != 1)}) -> {out}"
    )
