"""Token shards: a corpus tokenized once, read by random access without loading it.

A prepared directory (written by `python -m ultrajax.data prepare`) holds

    manifest.json          what is inside: tokenizer, dtype, counts, checksums, problems
    shard-00000.tokens     the token ids of many documents, back to back, raw little-endian
    shard-00000.offsets    int64 little-endian: document i is tokens[offsets[i]:offsets[i+1]]
    ...

Each document is stored as the model reads it, [BOS] ids [EOS] (no BOS when the tokenizer
has none), so reading is a slice of a memory map: no tokenizer at training time, and a
process touches only the pages of the documents it packs. Raw files rather than .npy
because a shard is written as a stream whose length is known only at the end.
"""

from __future__ import annotations

import array
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ultrajax.config.schema import ConfigError

FORMAT = "ultrajax-tokens"
VERSION = 1
MANIFEST = "manifest.json"


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned type that holds every id: half the bytes for vocabularies
    under 65,536 (the byte tokenizer, most BPEs of 32k), uint32 for Llama 3's 128k."""
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


class ShardWriter:
    """Appends documents to one shard; `close()` writes the offsets and returns its
    manifest entry. Token ids go to disk as they come (hashed on the way: no second
    pass), so memory holds one document and 8 bytes an offset."""

    def __init__(self, directory: Path, name: str, dtype: np.dtype):
        self.directory, self.name, self.dtype = Path(directory), name, np.dtype(dtype)
        self._tokens = open(self.directory / f"{name}.tokens", "wb")
        self._hash = hashlib.sha256()
        self._offsets = array.array("q", [0])
        self._limit = np.iinfo(self.dtype).max

    def add(self, ids: np.ndarray) -> None:
        ids = np.asarray(ids)
        if len(ids) and (ids.min() < 0 or ids.max() > self._limit):
            raise ValueError(f"token ids outside {self.dtype} (0..{self._limit})")
        data = ids.astype(self.dtype, copy=False).tobytes()
        self._tokens.write(data)
        self._hash.update(data)
        self._offsets.append(self._offsets[-1] + len(ids))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if not self._tokens.closed:
            self._tokens.close()

    def close(self) -> dict:
        self._tokens.close()
        offsets = self.directory / f"{self.name}.offsets"
        data = np.frombuffer(self._offsets, np.int64).astype("<i8").tobytes()
        offsets.write_bytes(data)
        return {
            "name": self.name,
            "documents": len(self._offsets) - 1,
            "tokens": int(self._offsets[-1]),
            "sha256": {
                "tokens": self._hash.hexdigest(),
                "offsets": hashlib.sha256(data).hexdigest(),
            },
        }


@dataclass(frozen=True)
class Shard:
    tokens: np.memmap
    offsets: np.ndarray  # int64, documents + 1 (small: 8 bytes a document)


def prepared_manifest(path: str | Path) -> bool:
    """Whether the file at `path` is the manifest of a prepared directory."""
    try:
        return json.loads(Path(path).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):  # unreadable, not JSON, not an object
        return False


class PreparedCorpus:
    """The documents of a prepared directory, by global index, as int32 token arrays."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        manifest = self.path / MANIFEST
        if not manifest.is_file():
            raise ConfigError(
                f"data.path={str(path)!r} is not a prepared directory (no {MANIFEST}); make "
                "one with: python -m ultrajax.data prepare --input ... --out ..."
            )
        text = manifest.read_bytes()
        # names this corpus across hosts: the manifest lists every shard's checksums
        self.digest = hashlib.sha256(text).hexdigest()[:12]
        try:
            self.manifest = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{manifest} is not valid JSON ({e})") from None
        if self.manifest.get("format") != FORMAT or self.manifest.get("version") != VERSION:
            raise ConfigError(
                f"{manifest}: format {self.manifest.get('format')!r} version "
                f"{self.manifest.get('version')!r}, expected {FORMAT!r} version {VERSION}"
            )
        self.dtype = np.dtype(self.manifest["dtype"])
        self.shards = []
        for entry in self.manifest["shards"]:
            tokens_path = self.path / f"{entry['name']}.tokens"
            offsets_path = self.path / f"{entry['name']}.offsets"
            if not tokens_path.is_file() or not offsets_path.is_file():
                raise ConfigError(f"{self.path}: shard {entry['name']} is missing")
            offsets = np.fromfile(offsets_path, "<i8")
            size = tokens_path.stat().st_size // self.dtype.itemsize
            ok = (
                len(offsets) == entry["documents"] + 1
                and offsets[0] == 0
                and offsets[-1] == size == entry["tokens"]
                and bool(np.all(np.diff(offsets) >= 0))
            )
            if not ok:
                raise ConfigError(
                    f"{self.path}: shard {entry['name']} does not match the manifest "
                    f"({len(offsets) - 1} documents and {size} tokens on disk, "
                    f"{entry['documents']} and {entry['tokens']} listed): prepare it again"
                )
            tokens = (
                np.memmap(tokens_path, self.dtype, mode="r") if size else np.zeros(0, self.dtype)
            )
            self.shards.append(Shard(tokens, offsets))
        counts = [len(s.offsets) - 1 for s in self.shards]
        self._starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)

    @property
    def tokenizer(self) -> dict:
        return self.manifest["tokenizer"]

    @property
    def tokens(self) -> int:
        return int(sum(int(s.offsets[-1]) for s in self.shards))

    def __len__(self) -> int:
        return int(self._starts[-1])

    def tokens_of(self, ids) -> int:
        """The tokens of the documents numbered `ids`, from the offsets alone."""
        ids = np.asarray(ids, np.int64)
        shard = np.searchsorted(self._starts, ids, side="right") - 1
        total = 0
        for k in np.unique(shard):
            j = ids[shard == k] - self._starts[k]
            offsets = self.shards[int(k)].offsets
            total += int((offsets[j + 1] - offsets[j]).sum())
        return total

    def __getitem__(self, i: int) -> np.ndarray:
        i = int(i)
        if not 0 <= i < len(self):
            raise IndexError(f"document {i} of {len(self)}")
        s = int(np.searchsorted(self._starts, i, side="right")) - 1
        shard, j = self.shards[s], i - int(self._starts[s])
        return np.asarray(shard.tokens[shard.offsets[j] : shard.offsets[j + 1]], np.int32)

    def verify(self) -> list[str]:
        """Shards whose checksums differ from the manifest's (reads every byte)."""
        bad = []
        for entry in self.manifest["shards"]:
            for kind in ("tokens", "offsets"):
                if sha256(self.path / f"{entry['name']}.{kind}") != entry["sha256"][kind]:
                    bad.append(f"{entry['name']}.{kind}")
        return bad
