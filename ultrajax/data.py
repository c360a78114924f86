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
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import grain
import numpy as np

from ultrajax.config import ConfigError, DataConfig

# --------------------------------------------------------------------------- tokenizers


class ByteTokenizer:
    """UTF-8 bytes plus BOS/EOS/PAD: needs no vocabulary file."""

    BOS, EOS, PAD = 256, 257, 258
    size = 259

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8", errors="replace"), np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A local Hugging Face `tokenizer.json`, through the `tokenizers` package."""

    BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "[BOS]")
    EOS_NAMES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "[EOS]")

    def __init__(self, path: str):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ConfigError(
                "data.tokenizer: the 'tokenizers' package is needed; pip install tokenizers"
            ) from None
        if not Path(path).is_file():
            raise ConfigError(f"data.tokenizer: file {path!r} does not exist")
        try:
            self._tok = Tokenizer.from_file(path)
        except Exception as e:  # the library raises a bare Exception on bad JSON
            raise ConfigError(f"data.tokenizer: {path!r} is not a tokenizer.json ({e})") from None
        self.size = self._tok.get_vocab_size(with_added_tokens=True)
        self.BOS = self._first_id(self.BOS_NAMES)
        self.EOS = self._first_id(self.EOS_NAMES)
        if self.EOS is None:
            raise ConfigError(
                f"data.tokenizer: {path!r} has no end-of-text token (looked for "
                f"{', '.join(self.EOS_NAMES)}); documents need a separator"
            )
        self.PAD = self.EOS

    def _first_id(self, names):
        for name in names:
            i = self._tok.token_to_id(name)
            if i is not None:
                return i
        return None

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, np.int32)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])


def make_tokenizer(cfg: DataConfig):
    return ByteTokenizer() if cfg.tokenizer == "bytes" else HFTokenizer(cfg.tokenizer)


def padded_vocab(size: int, multiple: int = 128) -> int:
    """Vocabulary rounded up so the embedding splits evenly and matmuls tile well."""
    return -(-size // multiple) * multiple


# --------------------------------------------------------------------------- sources


@dataclass(frozen=True)
class Doc:
    """A document: a whole file, or one JSONL record (its text kept inline)."""

    key: str
    path: str | None = None
    text: str | None = None

    def read(self) -> str:
        if self.text is not None:
            return self.text
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
    docs = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                raise ConfigError(f"data.path: {path} line {i + 1} is not valid JSON") from None
            text = record.get("text") if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise ConfigError(f"data.path: {path} line {i + 1} has no string field 'text'")
            if text:
                docs.append(Doc(key=f"{path}:{i}", text=text))
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
    if eval_fraction <= 0:
        return docs, []
    cut = int(eval_fraction * 2**32)
    train = [d for d in docs if zlib.crc32(d.key.encode()) >= cut]
    held = [d for d in docs if zlib.crc32(d.key.encode()) < cut]
    if not held and len(train) > 1:
        held, train = train[-1:], train[:-1]
    if not train:
        raise ConfigError(
            f"data.eval_fraction={eval_fraction} leaves no training documents "
            f"out of {len(docs)}; lower it"
        )
    return train, held


def load_docs(cfg: DataConfig) -> list[Doc]:
    return stdlib_docs() if cfg.source == "stdlib" else file_docs(cfg.path)


# --------------------------------------------------------------------------- pipeline


class _Encode(grain.transforms.Map):
    def __init__(self, tokenizer):
        self.tok = tokenizer

    def map(self, doc: Doc):
        ids = self.tok.encode(doc.read())
        parts = ([[self.tok.BOS]] if self.tok.BOS is not None else []) + [ids, [self.tok.EOS]]
        return {"tokens": np.concatenate([np.asarray(p, np.int32) for p in parts])}


class _Finalize(grain.transforms.Map):
    """Rename packing outputs; without cross-doc masking, one segment per row."""

    def __init__(self, cross_doc_mask: bool):
        self.cross_doc_mask = cross_doc_mask

    def map(self, batch):
        tokens = batch["tokens"]
        seg = batch["tokens_segment_ids"].astype(np.int32)
        pos = batch["tokens_positions"].astype(np.int32)
        if not self.cross_doc_mask:
            seg = (seg > 0).astype(np.int32)
            pos = np.broadcast_to(np.arange(tokens.shape[-1], dtype=np.int32), tokens.shape)
        return {"tokens": tokens.astype(np.int32), "segment_ids": seg, "positions": np.array(pos)}


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
    """Batches of {tokens, segment_ids, positions}, each (batch_size, seq_len + 1), forever.

    Every process builds the same global stream (docs/multihost.md)."""
    ds = grain.MapDataset.source(docs)
    if shuffle:
        ds = ds.shuffle(seed=seed)
    ds = ds.repeat(None)  # reshuffled every epoch
    ds = ds.map(_Encode(tokenizer)).to_iter_dataset()
    ds = grain.experimental.ConcatThenSplitIterDataset(ds, length_struct={"tokens": seq_len + 1})
    ds = ds.batch(batch_size, drop_remainder=True)
    return ds.map(_Finalize(cross_doc_mask))


@dataclass
class Data:
    """The run's train iterator (checkpointable) and a factory for the fixed eval batches."""

    tokenizer: object
    train_docs: list[Doc]
    eval_docs: list[Doc]
    train: grain.DatasetIterator
    make_eval: object

    def eval_batches(self, n: int):
        if not self.eval_docs or n == 0:
            return []
        it = iter(self.make_eval())
        return [next(it) for _ in range(n)]

    def state(self) -> dict:
        return self.train.get_state()

    def restore(self, state: dict) -> None:
        self.train.set_state(state)


def build(
    cfg: DataConfig,
    *,
    seq_len: int,
    batch_size: int,
    seed: int,
    vocab_size: int,
) -> Data:
    """Everything the train loop reads, with bad input reported as ConfigError."""
    tokenizer = make_tokenizer(cfg)
    if tokenizer.size > vocab_size:
        raise ConfigError(
            f"model.vocab_size ({vocab_size}) is smaller than the tokenizer's "
            f"{tokenizer.size} tokens; set model.vocab_size={padded_vocab(tokenizer.size)}"
        )
    train_docs, eval_docs = split_docs(load_docs(cfg), cfg.eval_fraction)
    common = dict(
        seq_len=seq_len,
        batch_size=batch_size,
        cross_doc_mask=cfg.cross_doc_mask,
    )
    train = iter(packed_dataset(train_docs, tokenizer, seed=seed, **common))

    def make_eval():
        return packed_dataset(eval_docs, tokenizer, seed=seed, shuffle=False, **common)

    return Data(tokenizer, train_docs, eval_docs, train, make_eval)
