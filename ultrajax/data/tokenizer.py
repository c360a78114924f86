"""Tokenizers: bytes (no vocabulary file) or a local Hugging Face tokenizer.json.

Kept apart from the data pipeline so that `prepare`'s worker processes load no JAX.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from ultrajax.config.schema import ConfigError


class ByteTokenizer:
    """UTF-8 bytes plus BOS/EOS/PAD: needs no vocabulary file."""

    BOS, EOS, PAD = 256, 257, 258
    size = 259
    digest = "bytes"  # what names the tokenizer across hosts (HFTokenizer: its file's)
    path = None  # no file to keep

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
            relative = (
                f" here ({Path.cwd()}): a relative path is read from the directory a command "
                "starts in, so start this one where the run was started, or give the "
                "tokenizer's absolute path"
                if not Path(path).is_absolute()
                else ""
            )
            raise ConfigError(f"data.tokenizer: file {path!r} does not exist{relative}")
        self.path = path  # kept beside the run's checkpoints (Checkpoints.keep_tokenizer)
        self.digest = digest_of(Path(path).read_bytes())
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


def digest_of(data: bytes) -> str:
    """What names a tokenizer.json: across hosts, in a checkpoint's data position, and as
    the name of the copy a run keeps beside its checkpoints."""
    return hashlib.sha256(data).hexdigest()[:12]


def padded_vocab(size: int, multiple: int = 128) -> int:
    """Vocabulary rounded up so the embedding splits evenly and matmuls tile well."""
    return -(-size // multiple) * multiple


def document(tok, text: str) -> np.ndarray:
    """A document as the model reads it: [BOS] ids [EOS] (no BOS when the tokenizer has
    none), int32. Text sources build it when they pack; `prepare` stores it."""
    bos = [] if tok.BOS is None else [tok.BOS]
    return np.concatenate(
        [np.asarray(bos, np.int32), tok.encode(text).astype(np.int32, copy=False), [tok.EOS]]
    ).astype(np.int32, copy=False)
