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

import functools
from dataclasses import dataclass

from ultrajax.config.schema import ConfigError, DataConfig
from ultrajax.data import streams as streams_lib
from ultrajax.data.prefetch import Prefetcher
from ultrajax.data.shards import PreparedCorpus
from ultrajax.data.sources import (
    Problems,
    TextReader,
    data_paths,
    load_docs,
    make_tokenizer,
    split_ids,
    split_indices,
)
from ultrajax.data.tokenizer import ByteTokenizer, HFTokenizer, document, padded_vocab  # noqa: F401


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
    corpora: str = ""  # what is read: each corpus, its documents, a prepared one's manifest
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

    def eval_count(self, n: int) -> tuple[int, str | None]:
        """How many of `n` eval batches the held-out documents fill without repeating
        (at least one), and a line saying so when fewer: a small held-out split was
        read again and again to fill train.eval_batches, without a word."""
        if not self.eval_docs or n == 0:
            return 0, None
        per_batch = self.batch_size * (self.seq_len + 1)
        need, have = n * per_batch, 0
        for s in self.eval_sources:  # the documents' tokens, read only as far as needed
            if s.tokens is not None:
                have += s.tokens
            else:
                for i in s.ids:
                    have += len(s.read(int(i)))
                    if have >= need:
                        break
            if have >= need:
                return n, None
        fill = have // per_batch
        how = (
            f"evaluating on {fill}, so that no document counts twice"
            if fill
            else "evaluating on 1, in which they repeat (data.eval_fraction holds out more)"
        )
        docs = f"{self.eval_docs:,} held-out document" + ("s" if self.eval_docs > 1 else "")
        return max(fill, 1), (
            f"eval: the {docs} ({have:,} tokens) fill {have / per_batch:.2g} batches of "
            f"{per_batch:,} tokens, of the {n} asked for (train.eval_batches); {how}"
        )

    def feed(self, place, depth: int) -> Prefetcher:
        """Train batches made `depth` ahead on a thread: `place(packed, rows, grad_accum)`
        puts this process's rows (their global numbers `rows`) on the devices."""
        self.close()
        self._place, self._depth = place, depth
        t = self.train
        self._feed = Prefetcher(lambda: place(next(t), t.rows, t.grad_accum), t.get_state, depth)
        return self._feed

    def regroup(self, grad_accum: int) -> Prefetcher:
        """A new batch size from the next step on (ultrajax/train/ramp.py): the batches made ahead
        at the old size are dropped and the streams go back to the last one trained on."""
        consumed = self._feed.state() if self._feed else self.train.get_state()
        self.close()
        self.train.set_state(consumed)
        self.train.grad_accum = grad_accum
        return self.feed(self._place, self._depth)

    def state(self) -> dict:
        """The position after the last batch trained on, every process's streams in one,
        with `progress` (the batch ramp's state, ultrajax/train/ramp.py) beside it."""
        local = self._feed.state() if self._feed else self.train.get_state()
        gathered = streams_lib.gather_state(local)
        return dict(gathered, progress=self.progress, tokenizer=self.tokenizer.digest)

    def restore(self, state: dict) -> None:
        """Continue a saved position, in the checkpoint's stream count where the default
        count has changed since (ultrajax/data/streams.py). With the tokenizer it was saved
        with: a tokenizer.json replaced at the same path gave the model other ids for the
        same text, without a word (checkpoints from before the digest was saved pass)."""
        saved = state.get("tokenizer")
        if saved is not None and saved != self.tokenizer.digest:
            raise ConfigError(
                f"the tokenizer differs from the one this run was trained with (digest "
                f"{saved}, now {self.tokenizer.digest}): the same text would be other ids; "
                "put the run's tokenizer back at data.tokenizer, or start a new run"
            )
        self.close()
        before = self.train.describe()
        self.train.set_state(state)
        self.summary = self.summary.replace(before, self.train.describe())
        self.progress = state.get("progress")

    def close(self) -> None:
        if self._feed is not None:
            self._feed.close()
            self._feed = None


def _sources(cfg: DataConfig, tokenizer, problems: Problems) -> tuple[list, list, list[str]]:
    """(train sources, eval sources, one description per corpus); the bad lines of the
    text sources go to `problems`."""
    weights = [m.weight for m in cfg.mixture] if cfg.mixture else [1.0]
    train, evals, names = [], [], []
    first = None
    for i, (path, weight) in enumerate(zip(data_paths(cfg), weights, strict=True)):
        try:
            train_i, eval_i, name_i, first = _source(cfg, path, weight, tokenizer, problems, first)
        except ConfigError as e:  # a mixture's entry is named as such, not as data.path
            if not cfg.mixture:
                raise
            raise ConfigError(str(e).replace("data.path", f"data.mixture[{i}].path", 1)) from None
        train.append(train_i)
        evals.append(eval_i)
        names.append(name_i)
    if all(not len(e.ids) for e in evals):
        evals = []
    else:
        evals = [e for e in evals if len(e.ids)]
    return train, evals, names


def _source(cfg: DataConfig, path, weight, tokenizer, problems: Problems, first):
    """One corpus of `_sources`: (train source, eval source, its description, the first
    prepared corpus's (path, tokenizer), which every other must share)."""
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
        size += f", manifest {corpus.digest}"  # its shards' checksums: the same data, every host
        held = corpus.tokens_of(e)
        counts = (corpus.tokens - held, held)
    else:
        docs = load_docs(cfg, path, problems)
        t, e = split_ids([d.key for d in docs], cfg.eval_fraction)
        read, size = TextReader(docs, tokenizer), "tokenized as read"
        counts = (None, None)
    name = path or cfg.source
    share = f", weight {weight:g}" if cfg.mixture else ""
    described = f"{name} ({len(t):,} train / {len(e):,} eval documents, {size}{share})"
    source = functools.partial(streams_lib.Source, read=read, weight=weight, name=name)
    return source(t, tokens=counts[0]), source(e, tokens=counts[1]), described, first


def build(
    cfg: DataConfig,
    *,
    seq_len: int,
    batch_size: int,
    seed: int,
    vocab_size: int,
    grad_accum: int = 1,
    rows=None,
    batch_sizes=(),
) -> Data:
    """Everything the train loop reads, with bad input reported as ConfigError.

    `rows`: the global batch rows this process's devices hold (None: all of them); only
    the streams holding them are read and packed here. `batch_sizes`: the run's other
    global batches, in rows (a batch ramp's stages): the stream count must split them all."""
    tokenizer = make_tokenizer(cfg)
    if tokenizer.size > vocab_size:
        raise ConfigError(
            f"model.vocab_size ({vocab_size}) is smaller than the tokenizer's "
            f"{tokenizer.size} tokens; set model.vocab_size={padded_vocab(tokenizer.size)}"
        )
    problems = Problems(cfg.strict)
    train, evals, names = _sources(cfg, tokenizer, problems)
    n = streams_lib.stream_count([batch_size, *batch_sizes], cfg.streams)
    streams = streams_lib.Streams(
        train, batch_size=batch_size, grad_accum=grad_accum, streams=n, seed=seed,
        seq_len=seq_len, cross_doc_mask=cfg.cross_doc_mask, window=cfg.shuffle_window,
        rows=rows, default=cfg.streams is None, batch_sizes=batch_sizes,
    )  # fmt: skip
    summary = f"data: {'; '.join(names)}; {streams.describe()}"
    report = problems.report()
    if report is not None:  # printed once, with the summary, before the first step
        summary += "\n" + report
    return Data(
        tokenizer, streams, train, evals, batch_size, seq_len, seed, cfg.cross_doc_mask, summary,
        "; ".join(names) + f"; tokenizer {tokenizer.digest}",
    )  # fmt: skip
