"""Prepared shards as a training source: the same batches as tokenizing the files directly,
mixtures of prepared directories, the tokenizer they carry, and their errors."""

import json

import numpy as np
import pytest

from ultrajax.config import parse
from ultrajax.config.schema import ConfigError, DataConfig
from ultrajax.data import loader as data
from ultrajax.data import prepare, sources, tokenizer


def _corpus(root, prefix, n):
    root.mkdir(parents=True)
    lines = [json.dumps({"text": f"<{prefix}{i}> " + "word " * (3 + i % 9)}) for i in range(n)]
    (root / "a.jsonl").write_text("\n".join(lines[: n // 2]) + "\n")
    (root / "b.jsonl").write_text("\n".join(lines[n // 2 :]) + "\n")
    (root / "c.txt").write_text(f"<{prefix}txt> a whole file is one document\n")
    return root


def _prepared(tmp_path, prefix="p", n=60):
    src = _corpus(tmp_path / f"{prefix}-text", prefix, n)
    out = tmp_path / f"{prefix}-shards"
    prepare.prepare([str(src)], "bytes", out, workers=1)
    return src, out


def _build(cfg, batch=8):
    return data.build(cfg, seq_len=31, batch_size=batch, seed=3, vocab_size=384)


def test_prepared_batches_equal_tokenizing_the_files_directly(tmp_path):
    src, out = _prepared(tmp_path)
    files = _build(DataConfig(source="files", path=str(src), eval_fraction=0.0))
    shards = _build(DataConfig(source="prepared", path=str(out), eval_fraction=0.0))
    for _ in range(12):  # past an epoch: the same order, the same packing
        a, b = next(files.train), next(shards.train)
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])
    assert "tokens" in shards.summary and "61 train / 0 eval documents" in shards.summary
    # a held-out split by index: disjoint, stable, about the fraction asked for
    split = _build(DataConfig(source="prepared", path=str(out), eval_fraction=0.2))
    train, held = split.train_sources[0].ids, split.eval_sources[0].ids
    assert not set(train) & set(held) and len(train) + len(held) == 61 and 4 <= len(held) <= 25
    assert len(split.eval_batches(2)) == 2


def test_a_run_that_repeats_its_corpus_or_eval_split_says_so(tmp_path):
    """A corpus smaller than the run was read several times and a small held-out split
    repeated to fill train.eval_batches, with nothing said: now the passes are counted
    (prepared directories know their tokens) and the eval batches stop at one pass."""
    from ultrajax.train import report

    src, out = _prepared(tmp_path)
    split = _build(DataConfig(source="prepared", path=str(out), eval_fraction=0.2))
    train, held = split.train_sources[0], split.eval_sources[0]
    lengths = [len(split.train_sources[0].read(int(i))) for i in range(61)]
    assert train.tokens == sum(lengths[int(i)] for i in train.ids)  # from the offsets alone
    assert held.tokens == sum(lengths[int(i)] for i in held.ids)
    per_batch = 8 * 32  # rows of seq_len + 1
    fill = held.tokens // per_batch
    count, note = split.eval_count(fill + 3)
    assert count == fill >= 1 and f"evaluating on {fill}, so that no document" in note
    assert split.eval_count(fill) == (fill, None)
    steps = 3 * train.tokens // (4 * 64) + 1  # a little over 3 passes of 4 x 64 tokens a step
    cfg = parse.load(None, [f"train.steps={steps}", "train.micro_batch_size=4",
                            "model.seq_len=64", "optim.warmup_steps=0"])  # fmt: skip
    line = report.passes(cfg, split.train_sources)
    assert line.startswith(f"data: the run's {steps * 256:,} tokens are about 3.0 passes over ")
    assert f"the {train.tokens:,} train tokens of {out}" in line
    cfg = parse.load(None, ["train.steps=1", "optim.warmup_steps=0"])
    assert report.passes(cfg, split.train_sources) is None  # less than a pass: nothing said
    # text sources count the eval documents they read (tokenized), not the train ones
    files = _build(DataConfig(source="files", path=str(src), eval_fraction=0.2))
    assert files.train_sources[0].tokens is None and report.passes(cfg, files.train_sources) is None
    have = sum(len(files.eval_sources[0].read(int(i))) for i in files.eval_sources[0].ids)
    assert files.eval_count(have // per_batch + 1)[0] == max(have // per_batch, 1)
    tiny = _build(DataConfig(source="files", path=str(src), eval_fraction=0.2), batch=64)
    count, note = tiny.eval_count(2)  # less than one batch: one, said to repeat
    assert count == 1 and note.endswith("evaluating on 1, in which they repeat "
                                        "(data.eval_fraction holds out more)")  # fmt: skip


def test_mixture_of_prepared_directories_by_weight(tmp_path):
    _, a = _prepared(tmp_path, "a")
    _, b = _prepared(tmp_path, "b")
    cfg = parse.load(
        None,
        [
            "data.source=prepared",
            f"data.mixture=[{{path: {a}, weight: 3}}, {{path: {b}, weight: 1}}]",
        ],
    )
    assert [m.weight for m in cfg.data.mixture] == [3.0, 1.0]
    d = _build(cfg.data, batch=16)
    tok = tokenizer.ByteTokenizer()
    rows = [tok.decode(r) for _ in range(40) for r in next(d.train)["tokens"]]
    tagged = [r for r in rows if "<a" in r or "<b" in r]
    assert not any("<a" in r and "<b" in r for r in rows)  # a row holds one source
    share = np.mean(["<a" in r for r in tagged])
    assert abs(share - 0.75) < 0.05, share
    assert "weight 3" in d.summary and "weight 1" in d.summary


def test_prepared_data_brings_its_tokenizer_and_errors_say_what_to_do(tmp_path):
    _, out = _prepared(tmp_path)
    cfg = DataConfig(source="prepared", path=str(out))
    assert isinstance(sources.make_tokenizer(cfg), tokenizer.ByteTokenizer)
    with pytest.raises(ConfigError, match=r"model.vocab_size=384"):
        data.build(cfg, seq_len=31, batch_size=8, seed=0, vocab_size=128)
    with pytest.raises(ConfigError, match="not a prepared directory .* ultrajax.data prepare"):
        _build(DataConfig(source="prepared", path=str(tmp_path)))
    (out / "shard-00000.offsets").write_bytes(b"\0" * 16)
    with pytest.raises(ConfigError, match="does not match the manifest"):
        _build(cfg)
    with pytest.raises(ConfigError, match="data.path is required when data.source is prepared"):
        parse.load(None, ["data.source=prepared"])
    with pytest.raises(ConfigError, match="data.mixture replaces data.path"):
        parse.load(None, ["data.source=prepared", "data.path=x", "data.mixture=[{path: y}]"])
    for weight in ("0", ".inf"):  # infinity crashed the loader with a traceback
        with pytest.raises(ConfigError, match=r"data.mixture\[0\].weight must be positive and"):
            mixture = f"data.mixture=[{{path: y, weight: {weight}}}]"
            parse.load(None, ["data.source=prepared", mixture])


def test_a_prepared_directory_read_as_text_is_refused_and_mixture_entries_named(tmp_path):
    """data.source=files on a prepared directory trained on its shard files' bytes (and
    its manifest) as if they were text; now one line says to read it as prepared. A
    mixture entry's error names the entry, not data.path."""
    _, out = _prepared(tmp_path)
    with pytest.raises(ConfigError, match=rf"{out} is a prepared directory .*source=prepared"):
        _build(DataConfig(source="files", path=str(out)))
    with pytest.raises(ConfigError, match="is a prepared directory"):  # in a glob, in a mixture
        _build(DataConfig(source="files", path=f"{tmp_path}/**/*"))
    mixture = [f"data.mixture=[{{path: {out}, weight: 3}}, {{path: {tmp_path}/no, weight: 1}}]"]
    cfg = parse.load(None, ["data.source=prepared", *mixture])
    with pytest.raises(ConfigError, match=r"^data.mixture\[1\].path='.*/no' is not a prepared"):
        _build(cfg.data)
