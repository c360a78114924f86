"""Data: tokenizers, file sources and their errors, packing, determinism, state, eval split."""

import hashlib
import json
import re
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from ultrajax.config.schema import ConfigError, DataConfig
from ultrajax.data import loader as data
from ultrajax.data import sources, streams, tokenizer

TOK = tokenizer.ByteTokenizer()
BOS, EOS = TOK.BOS, TOK.EOS


def _docs(n, length=lambda i: 3 + (i * 7) % 11):
    """n documents with distinct, recognisable text: doc i is `<i>` plus filler."""
    return [sources.Doc(key=f"doc{i}", text=f"<{i}>" + "x" * length(i)) for i in range(n)]


def _packed(docs, *, seq_len=15, batch_size=2, seed=0, cross_doc_mask=True, shuffle=True):
    """Batches of {tokens, segment_ids, positions}, each (batch_size, seq_len + 1),
    forever: one stream over `docs` (no row shuffle), batched."""
    source = streams.Source(np.arange(len(docs)), sources.TextReader(docs, TOK))
    ds = streams.stream(
        [source], k=0, n=1, seed=seed, seq_len=seq_len, cross_doc_mask=cross_doc_mask,
        shuffle=shuffle,
    )  # fmt: skip
    return ds.batch(batch_size, drop_remainder=True)


def _take(it, n):
    return [next(it) for _ in range(n)]


def _stream(batches, key="tokens"):
    return np.concatenate([row for b in batches for row in b[key]])


def _split_stream(stream):
    """Cut a token stream into documents at EOS; each must look like [BOS] text [EOS]."""
    ends = np.flatnonzero(stream == EOS)
    out, start = [], 0
    for end in ends:
        piece = stream[start : end + 1]
        assert piece[0] == BOS and piece[-1] == EOS, piece
        assert not np.isin(piece[1:-1], [BOS, EOS]).any(), piece
        out.append(TOK.decode(piece[1:-1]))
        start = end + 1
    return out


# --------------------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trip_and_specials():
    text = "def f(x):\n    return 'héllo ✓'\n"
    ids = TOK.encode(text)
    assert ids.dtype == np.int32 and ids.max() < 256
    assert TOK.decode(ids) == text
    assert TOK.decode([BOS, *ids, EOS, TOK.PAD]) == text
    assert len({TOK.BOS, TOK.EOS, TOK.PAD}) == 3 and TOK.size == 259


def test_padded_vocab():
    assert tokenizer.padded_vocab(259) == 384
    assert tokenizer.padded_vocab(256) == 256
    assert tokenizer.padded_vocab(1) == 128


def test_hf_tokenizer_from_local_file(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    hf = sources.make_tokenizer(DataConfig(tokenizer=str(path)))
    assert (hf.BOS, hf.EOS, hf.size) == (1, 2, 5)
    np.testing.assert_array_equal(hf.encode("hello world hello"), [3, 4, 3])
    # what the hosts of a run hold against each other (Data.corpora): the file's digest
    assert hf.digest == hashlib.sha256(path.read_bytes()).hexdigest()[:12]
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("hello world")
    cfg = DataConfig(source="files", path=str(tmp_path / "docs"), tokenizer=str(path))
    built = data.build(cfg, seq_len=3, batch_size=1, seed=0, vocab_size=128)
    assert built.corpora.endswith(f"; tokenizer {hf.digest}")
    # a resume holds it against the checkpoint's: a tokenizer.json replaced at the same
    # path gave the model other ids for the same text, without a word
    state = built.state()
    assert state["tokenizer"] == hf.digest
    vocab["world"], vocab["hello"] = 3, 4
    other = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    other.save(str(path))
    rebuilt = data.build(cfg, seq_len=3, batch_size=1, seed=0, vocab_size=128)
    with pytest.raises(ConfigError, match=f"tokenizer differs .* \\(digest {hf.digest}, now "):
        rebuilt.restore(state)
    rebuilt.restore({k: v for k, v in state.items() if k != "tokenizer"})  # saved before it

    no_eos = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0, "a": 1}, "<unk>"))
    bad = tmp_path / "no_eos.json"
    no_eos.save(str(bad))
    with pytest.raises(ConfigError, match="end-of-text"):
        sources.make_tokenizer(DataConfig(tokenizer=str(bad)))


def test_missing_tokenizer_file(tmp_path, monkeypatch):
    pytest.importorskip("tokenizers")
    with pytest.raises(ConfigError, match="data.tokenizer") as e:
        sources.make_tokenizer(DataConfig(tokenizer=str(tmp_path / "none.json")))
    assert str(e.value).endswith("none.json' does not exist")
    # a relative path, as a run saved it, read by generate started elsewhere: said
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        sources.make_tokenizer(DataConfig(tokenizer="tok/none.json"))
    assert f"does not exist here ({tmp_path}): a relative path is read from" in str(e.value)


# --------------------------------------------------------------------------- sources


def test_stdlib_source_finds_python_files():
    docs = sources.stdlib_docs()
    assert len(docs) > 100
    assert all(d.key.endswith(".py") for d in docs)
    assert not any(d.key.startswith(("site-packages", "dist-packages")) for d in docs)
    assert any(d.key == "os.py" for d in docs)
    assert "import" in next(d for d in docs if d.key == "os.py").read()
    # the files a glob finds, less site-packages, in the glob's order (the walk prunes it)
    root = Path(sysconfig.get_paths()["stdlib"])
    globbed = [
        str(p.relative_to(root))
        for p in sorted(root.rglob("*.py"))
        if p.relative_to(root).parts[0] not in ("site-packages", "dist-packages")
        and p.is_file()
        and p.stat().st_size > 0
    ]
    assert [d.key for d in docs] == globbed


def test_text_file(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("first document\n")
    docs = sources.file_docs(str(path))
    assert len(docs) == 1 and docs[0].read() == "first document\n"


def test_directory_reads_every_nonempty_file_sorted(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_text("bee")
    (tmp_path / "sub" / "a.md").write_text("ay")
    (tmp_path / "empty.txt").write_text("")
    docs = sources.file_docs(str(tmp_path))
    assert [d.read() for d in docs] == ["bee", "ay"]  # sorted by path, empty file skipped


def test_glob(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("one")
    (tmp_path / "b.log").write_text("not me")
    (tmp_path / "sub" / "c.txt").write_text("two")
    assert [d.read() for d in sources.file_docs(str(tmp_path / "*.txt"))] == ["one"]
    deep = sources.file_docs(str(tmp_path / "**" / "*.txt"))
    assert sorted(d.read() for d in deep) == ["one", "two"]


def test_jsonl_text_field(tmp_path):
    path = tmp_path / "corpus.jsonl"
    lines = [
        json.dumps({"text": "alpha", "id": 1}),
        "",
        json.dumps({"text": ""}),  # empty documents are skipped
        json.dumps({"text": "beta\nwith a newline"}),
    ]
    path.write_text("\n".join(lines) + "\n")
    docs = sources.file_docs(str(path))
    assert [d.read() for d in docs] == ["alpha", "beta\nwith a newline"]
    assert len({d.key for d in docs}) == 2


@pytest.mark.parametrize(
    "setup, pattern",
    [
        (lambda p: None, "missing.txt"),
        (lambda p: None, "*.nothing"),
        (lambda p: (p / "d").mkdir(), "d"),
        (lambda p: ((p / "d").mkdir(), (p / "d" / "e.txt").write_text("")), "d"),
        (lambda p: (p / "e.txt").write_text(""), "e.txt"),
        (lambda p: (p / "x.jsonl").write_text('{"body": "no text field"}\n'), "x.jsonl"),
        (lambda p: (p / "x.jsonl").write_text('{"text": 3}\n'), "x.jsonl"),
        (lambda p: (p / "x.jsonl").write_text("{not json\n"), "x.jsonl"),
        (lambda p: (p / "x.jsonl").write_text('{"text": ""}\n'), "x.jsonl"),
    ],
    ids=[
        "missing",
        "glob-nothing",
        "empty-dir",
        "dir-of-empty-files",
        "empty-file",
        "jsonl-no-text",
        "jsonl-text-not-string",
        "jsonl-bad-json",
        "jsonl-only-empty",
    ],
)
def test_bad_sources_are_one_line_config_errors(tmp_path, setup, pattern):
    setup(tmp_path)
    with pytest.raises(ConfigError) as info:
        sources.file_docs(str(tmp_path / pattern))
    message = str(info.value)
    assert message.startswith("data.path") and "\n" not in message


def _bad_corpus(root):
    """A JSONL file with each kind of bad line `prepare` counts, and a text file with an
    invalid byte on its second line."""
    (root / "a.jsonl").write_bytes(
        b'{"text": "good one"}\n'
        b"{not json\n"  # line 2
        b'{"body": "no text"}\n'
        b"[1, 2]\n"
        b'{"text": "caf\xe9"}\n'  # line 5: kept, U+FFFD
        b"\n"
        b'{"text": ""}\n'
        b'{"text": "good two"}\n'
    )
    (root / "b.txt").write_bytes(b"fine\nbad \xff here\n")
    return root


def test_files_source_skips_bad_lines_and_reports_them_once_at_start(tmp_path):
    """As `prepare`: lines without text are left out, invalid UTF-8 is replaced, and the
    problems are counted by kind with file:line in the data summary the run prints."""
    root = _bad_corpus(tmp_path)
    cfg = DataConfig(source="files", path=str(root), eval_fraction=0.0)
    d = data.build(cfg, seq_len=15, batch_size=2, seed=0, vocab_size=384)
    docs = sources.file_docs(str(root))
    assert [x.read() for x in docs] == [
        "good one",
        "caf\ufffd",
        "good two",
        "fine\nbad \ufffd here\n",
    ]
    assert len(d.train_sources[0].ids) == 4
    head, *listed = d.summary.splitlines()[1:]
    kinds = "(1 invalid JSON, 2 invalid UTF-8, 1 no text, 1 not an object)"
    assert head.startswith(f"data: 5 problems {kinds}, JSONL lines without text skipped")
    assert "data.strict=true refuses them" in head and head.endswith(":")
    a, b = root / "a.jsonl", root / "b.txt"
    want = [f"{a}:2: invalid JSON (", f'{a}:3: "text" is missing', f"{a}:4: a JSON array",
            f"{a}:5: invalid UTF-8 (byte 0xe9", f"{b}:2: invalid UTF-8 (byte 0xff"]  # fmt: skip
    assert len(listed) == len(want)
    for got, start in zip(listed, want, strict=True):
        assert got.startswith(f"  {start}"), (got, start)


def test_files_source_lists_the_first_few_problems(tmp_path):
    (tmp_path / "a.jsonl").write_text("nope\n" * 7 + '{"text": "ok"}\n')
    # no evaluation split: with one document, which side it lands on hangs on the hash of
    # its path (tmp_path's), and a held-out only document leaves nothing to train on
    only = DataConfig(source="files", path=str(tmp_path), eval_fraction=0.0)
    d = data.build(only, seq_len=15, batch_size=2, seed=0, vocab_size=384)
    head, *listed = d.summary.splitlines()[1:]
    assert head.startswith("data: 7 problems (7 invalid JSON)") and head.endswith("; the first 5:")
    assert listed == [f"  {tmp_path / 'a.jsonl'}:{i}: invalid JSON (Expecting value, column 1)"
                      for i in range(1, 6)]  # fmt: skip


def test_files_source_without_problems_reports_none(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "ok"}\n')
    # no evaluation split: with one document, which side it lands on hangs on the hash of
    # its path (tmp_path's), and a held-out only document leaves nothing to train on
    only = DataConfig(source="files", path=str(tmp_path), eval_fraction=0.0)
    d = data.build(only, seq_len=15, batch_size=2, seed=0, vocab_size=384)
    assert "\n" not in d.summary


@pytest.mark.parametrize("bad", ["a.jsonl", "b.txt"])
def test_strict_refuses_the_first_bad_line_in_one_line(tmp_path, bad):
    root = _bad_corpus(tmp_path)
    if bad == "b.txt":
        (root / "a.jsonl").write_text('{"text": "good"}\n')
    cfg = DataConfig(source="files", path=str(root), strict=True)
    with pytest.raises(ConfigError) as info:
        data.build(cfg, seq_len=15, batch_size=2, seed=0, vocab_size=384)
    message = str(info.value)
    assert message.startswith(f"data.strict: {root / bad}:2: invalid ") and "\n" not in message
    assert "set data.strict=false to skip bad lines" in message


def test_a_corpus_of_bad_lines_only_names_one(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": 3}\n[]\n')
    with pytest.raises(ConfigError) as info:
        sources.file_docs(str(tmp_path))
    message = str(info.value)
    assert message.startswith("data.path") and "2 bad JSONL lines" in message
    assert f"{tmp_path / 'a.jsonl'}:2: a JSON array, not an object" in message


# --------------------------------------------------------------------------- packing


def test_documents_are_bos_text_eos_and_each_epoch_is_a_permutation():
    docs = _docs(8)
    it = iter(_packed(docs))
    texts = _split_stream(_stream(_take(it, 24)))  # ~4 epochs of ~120 tokens
    expected = sorted(d.text for d in docs)
    assert len(texts) >= 16
    first, second = texts[:8], texts[8:16]
    assert sorted(first) == expected and sorted(second) == expected
    assert first != second  # reshuffled every epoch
    assert first != [d.text for d in docs]  # shuffled at all


def test_without_shuffle_documents_keep_their_order():
    docs = _docs(5)
    texts = _split_stream(_stream(_take(iter(_packed(docs, shuffle=False)), 6)))
    assert texts[:5] == [d.text for d in docs]


def test_batch_shapes_and_no_padding():
    b = next(iter(_packed(_docs(6), seq_len=15, batch_size=3)))
    assert set(b) == {"tokens", "segment_ids", "positions"}
    for v in b.values():
        assert v.shape == (3, 16) and v.dtype == np.int32
    assert (b["segment_ids"] > 0).all()  # concat-then-split packing wastes nothing


def test_segment_ids_and_positions_follow_documents():
    for batch in _take(iter(_packed(_docs(10), seq_len=15, batch_size=2)), 6):
        for tokens, seg, pos in zip(
            batch["tokens"], batch["segment_ids"], batch["positions"], strict=True
        ):
            assert seg[0] == 1 and pos[0] == 0
            for j in range(1, len(tokens)):
                new_doc = tokens[j] == BOS
                assert seg[j] == seg[j - 1] + int(new_doc), (tokens, seg)
                assert pos[j] == (0 if new_doc else pos[j - 1] + 1), (tokens, pos)


def test_a_row_has_several_documents():
    batches = _take(iter(_packed(_docs(10), seq_len=31, batch_size=2)), 3)
    assert max(int(b["segment_ids"].max()) for b in batches) >= 3


def test_without_cross_doc_mask_one_segment_per_row():
    masked = _take(iter(_packed(_docs(10), cross_doc_mask=True)), 3)
    plain = _take(iter(_packed(_docs(10), cross_doc_mask=False)), 3)
    for m, p in zip(masked, plain, strict=True):
        np.testing.assert_array_equal(m["tokens"], p["tokens"])
        assert (p["segment_ids"] == 1).all()
        np.testing.assert_array_equal(p["positions"], np.broadcast_to(np.arange(16), (2, 16)))


def test_same_seed_same_batches_different_seed_different():
    docs = _docs(30)
    a = _stream(_take(iter(_packed(docs, seed=1)), 4))
    b = _stream(_take(iter(_packed(docs, seed=1)), 4))
    c = _stream(_take(iter(_packed(docs, seed=2)), 4))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_iterator_state_round_trip():
    docs = _docs(12)
    it = iter(_packed(docs))
    _take(it, 5)
    state = it.get_state()
    after = _take(it, 4)
    it.set_state(state)
    again = _take(it, 4)
    fresh = iter(_packed(docs))  # a new process resuming from the saved state
    fresh.set_state(state)
    resumed = _take(fresh, 4)
    for key in ("tokens", "segment_ids", "positions"):
        np.testing.assert_array_equal(_stream(after, key), _stream(again, key))
        np.testing.assert_array_equal(_stream(after, key), _stream(resumed, key))
    assert not np.array_equal(_stream(after), _stream(_take(iter(_packed(docs)), 4)))


# --------------------------------------------------------------------------- eval split


def test_split_by_document_is_disjoint_and_stable():
    docs = _docs(200)
    train, held = sources.split_docs(docs, 0.2)
    keys_t, keys_h = {d.key for d in train}, {d.key for d in held}
    assert not keys_t & keys_h
    assert keys_t | keys_h == {d.key for d in docs}
    assert 10 <= len(held) <= 80
    # adding documents does not move existing ones between the splits
    more_t, more_h = sources.split_docs(docs + _docs(300)[200:], 0.2)
    assert keys_h <= {d.key for d in more_h} and keys_t <= {d.key for d in more_t}
    assert sources.split_docs(docs, 0.0) == (docs, [])


def test_split_keeps_one_eval_document_when_the_hash_picks_none():
    docs = _docs(3)
    train, held = sources.split_docs(docs, 1e-9)
    assert len(held) == 1 and len(train) == 2


def test_build_from_files_eval_batches_hold_only_eval_documents(tmp_path):
    for i in range(40):
        (tmp_path / f"f{i:02d}.txt").write_text(f"<{i}>" + "y" * (5 + i % 7))
    cfg = DataConfig(source="files", path=str(tmp_path), eval_fraction=0.25)
    d = data.build(cfg, seq_len=15, batch_size=2, seed=0, vocab_size=384)
    docs = sources.file_docs(str(tmp_path))

    def file_ids(source):
        return {int(re.search(r"f(\d+)", docs[i].key).group(1)) for i in source.ids}

    train_ids, eval_ids = file_ids(d.train_sources[0]), file_ids(d.eval_sources[0])
    assert eval_ids and train_ids and not train_ids & eval_ids
    assert train_ids | eval_ids == set(range(40))

    def ids_in(batches):
        text = "".join(TOK.decode(row) for b in batches for row in b["tokens"])
        return {int(m) for m in re.findall(r"<(\d+)>", text)}

    seen_eval = ids_in(d.eval_batches(4))
    assert seen_eval and seen_eval <= eval_ids
    seen_train = ids_in(_take(d.train, 8))
    assert seen_train and seen_train <= train_ids
    # eval batches are fixed: the same every time they are asked for
    np.testing.assert_array_equal(_stream(d.eval_batches(2)), _stream(d.eval_batches(4)[:2]))
    state = d.state()
    nxt = next(d.train)
    d.restore(state)
    np.testing.assert_array_equal(next(d.train)["tokens"], nxt["tokens"])


def test_reading_a_large_text_corpus_is_said_first(tmp_path, monkeypatch, capsys):
    """Every file of data.source=files is read at start (about 50 MB/s): a large corpus sat
    minutes without a word before the first line. From sources.READ_SAID bytes on, one
    line says what is being read first; below, nothing."""
    for i in range(3):
        (tmp_path / f"f{i}.txt").write_text("z" * 1000)
    sources.file_docs(str(tmp_path))
    assert capsys.readouterr().out == ""
    monkeypatch.setattr(sources, "READ_SAID", 3000)
    assert len(sources.file_docs(str(tmp_path))) == 3
    assert capsys.readouterr().out == (
        f"data: reading 3 files (0.00 GiB) of {tmp_path} for their documents (python -m "
        "ultrajax.data prepare does it once, ahead)\n"
    )


def test_build_rejects_a_vocabulary_smaller_than_the_tokenizer(tmp_path):
    (tmp_path / "a.txt").write_text("text")
    cfg = DataConfig(source="files", path=str(tmp_path / "a.txt"), eval_fraction=0.0)
    with pytest.raises(ConfigError, match=r"model\.vocab_size=384"):
        data.build(cfg, seq_len=15, batch_size=2, seed=0, vocab_size=256)


def test_build_reports_a_missing_path(tmp_path):
    cfg = DataConfig(source="files", path=str(tmp_path / "gone"))
    with pytest.raises(ConfigError, match="does not exist"):
        data.build(cfg, seq_len=15, batch_size=2, seed=0, vocab_size=384)
