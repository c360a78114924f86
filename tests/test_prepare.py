"""prepare: a corpus tokenized once into shards, equal to what the in-memory pipeline builds,
the same whatever the worker count, streamed, and never silently dropping bad input."""

import hashlib
import json
import os
import re
import subprocess
import sys
import textwrap
from datetime import datetime
from pathlib import Path

import jax
import numpy as np
import pytest

from ultrajax.config.schema import Config, DataConfig, ModelConfig
from ultrajax.data import prepare, sources, tokenizer
from ultrajax.data.shards import FORMAT, VERSION, PreparedCorpus
from ultrajax.tools import convert
from ultrajax.tools import data as command
from ultrajax.train import checkpoint

TOK = tokenizer.ByteTokenizer()
REPO = Path(__file__).resolve().parents[1]


def _byte_doc(text):
    return [TOK.BOS, *TOK.encode(text).tolist(), TOK.EOS]


def _docs(out):
    corpus = PreparedCorpus(out)
    return [corpus[i].tolist() for i in range(len(corpus))]


def _run(capsys, *args):
    """main() in this process -> (stdout, stderr)."""
    assert command.prepare_main([str(a) for a in args]) == 0
    return capsys.readouterr()


def _fails(capsys, *args):
    """main() must exit with status 2 and one line on stderr; returns that line."""
    with pytest.raises(SystemExit) as e:
        command.prepare_main([str(a) for a in args])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def _jsonl(path, records):
    path.write_text("".join(r if isinstance(r, str) else json.dumps(r) + "\n" for r in records))
    return path


def _no_leftovers(parent):
    """No temporary or moved-aside directory survives a run."""
    assert not [p.name for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def _hf_tokenizer(path, bos=True):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"<unk>": 0, "</s>": 1, "hello": 2, "world": 3, "again": 4, ".": 5}
    if bos:
        vocab["<s>"] = 6
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path


# --------------------------------------------------------------------------- round trip


def test_byte_round_trip_matches_the_pipeline(tmp_path, capsys):
    src = tmp_path / "in"
    (src / "sub").mkdir(parents=True)
    texts = ["hello", "héllo ✓ wörld\nsecond line", "x" * 300, "tab\there"]
    _jsonl(src / "a.jsonl", [{"text": texts[0]}, "\n", {"text": texts[1], "id": 7}, {"text": ""}])
    _jsonl(src / "sub" / "d.jsonl", [{"text": texts[2]}, {"text": texts[3]}])
    (src / "b.txt").write_bytes(b"plain\r\nfile\rend\n")  # read as Doc.read does: "\n"
    (src / "empty.txt").write_bytes(b"")
    (src / "sub" / "c.md").write_text("# title\n")
    out = tmp_path / "out"
    # the directory and a glob overlapping it: every file counts once
    _run(capsys, "--input", src, "--input", f"{src}/**/*.md", "--tokenizer", "bytes", "--out", out)

    expected = [
        _byte_doc(texts[0]),
        _byte_doc(texts[1]),
        _byte_doc("plain\nfile\nend\n"),
        _byte_doc("# title\n"),
        _byte_doc(texts[2]),
        _byte_doc(texts[3]),
    ]
    assert _docs(out) == expected
    # the documents of the in-memory text source (ultrajax.data), as it reads them
    pipeline = [_byte_doc(d.read()) for d in sources.file_docs(str(src))]
    assert _docs(out) == pipeline

    corpus = PreparedCorpus(out)
    assert corpus.verify() == []
    m = json.loads((out / "manifest.json").read_text())
    assert (m["format"], m["version"], m["dtype"]) == (FORMAT, VERSION, "<u2")
    assert m["tokenizer"] == {
        "kind": "bytes",
        "path": None,
        "sha256": None,
        "size": 259,
        "bos": 256,
        "eos": 257,
    }
    assert m["documents"] == 6 and m["tokens"] == sum(map(len, expected))
    assert [s["name"] for s in m["shards"]] == ["shard-00000"]
    shard = m["shards"][0]
    assert (shard["documents"], shard["tokens"]) == (6, m["tokens"])
    for kind in ("tokens", "offsets"):
        digest = hashlib.sha256((out / f"shard-00000.{kind}").read_bytes()).hexdigest()
        assert shard["sha256"][kind] == digest
    names = ["a.jsonl", "b.txt", "empty.txt", "sub/c.md", "sub/d.jsonl"]
    assert m["inputs"] == [{"path": str(src / n), "bytes": (src / n).stat().st_size} for n in names]
    assert m["problems"] == {"count": 0, "kinds": {}, "first": []}
    assert m["skipped"] == {"blank line": 1, "empty file": 1, "empty text": 1}
    assert datetime.fromisoformat(m["created"]).utcoffset().total_seconds() == 0
    assert m["command"][:2] == ["--input", str(src)]
    assert not (out / "tokenizer.json").exists()
    _no_leftovers(tmp_path)


def test_hf_tokenizer_round_trip_and_copy(tmp_path, capsys):
    path = _hf_tokenizer(tmp_path / "tok.json")
    hf = tokenizer.HFTokenizer(str(path))
    texts = ["hello world", "world hello again .", "hello unknown"]
    _jsonl(tmp_path / "a.jsonl", [{"text": t} for t in texts])
    out = tmp_path / "out"
    _run(capsys, "--input", tmp_path / "a.jsonl", "--tokenizer", path, "--out", out)
    assert _docs(out) == [[6, *hf.encode(t).tolist(), 1] for t in texts]
    assert _docs(out)[2] == [6, 2, 0, 1]  # unknown words are <unk>, not dropped
    m = PreparedCorpus(out).manifest
    assert m["tokenizer"] == {
        "kind": "hf",
        "path": str(path),
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "size": 7,
        "bos": 6,
        "eos": 1,
    }
    assert (out / "tokenizer.json").read_bytes() == path.read_bytes()
    assert PreparedCorpus(out).verify() == []
    # a model trained on it goes to Hugging Face with this tokenizer: orbax-to-hf wrote
    # the byte tokenizer's (data.tokenizer, unused by prepared data, is `bytes`)
    m = ModelConfig(vocab_size=128, d_model=16, n_layers=1, n_heads=2, d_ff=32, seq_len=16)
    cfg = Config(model=m, data=DataConfig(source="prepared", path=str(out)))
    zeros = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), checkpoint.abstract_params(m))
    convert.orbax_to_hf(checkpoint.write_params(tmp_path / "ck", zeros, cfg), tmp_path / "hf")
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == path.read_bytes()

    # no BOS in the vocabulary: documents are ids [EOS]
    no_bos = _hf_tokenizer(tmp_path / "no_bos.json", bos=False)
    out2 = tmp_path / "out2"
    _run(capsys, "--input", tmp_path / "a.jsonl", "--tokenizer", no_bos, "--out", out2)
    assert _docs(out2)[0] == [2, 3, 1]
    assert PreparedCorpus(out2).tokenizer["bos"] is None


# --------------------------------------------------------------------------- pieces


def test_split_boundaries_lose_and_repeat_no_line(tmp_path, capsys):
    """Ranges ending exactly on a line start, inside a line, and one per line."""
    texts = [f"line {i:02d} " + "y" * (i % 5) for i in range(12)]
    path = _jsonl(tmp_path / "a.jsonl", [{"text": t} for t in texts])
    size = path.stat().st_size
    expected = [_byte_doc(t) for t in texts]
    for n_bytes in (size, size // 2, 37, 30, 1):
        out = tmp_path / f"out{n_bytes}"
        _run(capsys, "--input", path, "--tokenizer", "bytes", "--out", out, "--workers", 1,
             "--shard-mib", n_bytes / 2**20)  # fmt: skip
        assert _docs(out) == expected, n_bytes
        shards = PreparedCorpus(out).manifest["shards"]
        assert [s["name"] for s in shards] == [f"shard-{i:05d}" for i in range(len(shards))]
    assert len(shards) == len(texts)  # 1-byte pieces: empty ones leave no shard


def test_one_and_two_workers_write_identical_output(tmp_path, capsys):
    texts = [f"document {i} " + "abcdefgh"[: i % 8] * (i % 50) for i in range(400)]
    records = [{"text": t} for t in texts]
    records.insert(350, "{broken\n")  # line 351, in a later piece of the file
    _jsonl(tmp_path / "big.jsonl", records)
    (tmp_path / "c.txt").write_text("a small file")
    (tmp_path / "d.txt").write_text("another small file")
    assert (tmp_path / "big.jsonl").stat().st_size > 3 * 0.01 * 2**20
    outs = {}
    for workers in (1, 2):
        outs[workers] = tmp_path / f"out{workers}"
        _, err = _run(capsys, "--input", tmp_path / "*.*", "--tokenizer", "bytes", "--out",
                      outs[workers], "--workers", workers, "--shard-mib", 0.01)  # fmt: skip
        assert f"{tmp_path / 'big.jsonl'}:351: invalid JSON" in err
    m1, m2 = (json.loads((outs[w] / "manifest.json").read_text()) for w in (1, 2))
    assert len(m1["shards"]) >= 4  # >= 3 pieces of the JSONL, and the two small files
    assert m1["problems"]["first"] == [
        f"{tmp_path / 'big.jsonl'}:351: invalid JSON (Expecting property name enclosed in "
        "double quotes, column 2)"
    ]
    for m in (m1, m2):
        del m["created"], m["command"]
    assert m1 == m2
    files = sorted(p.name for p in outs[1].iterdir())
    assert files == sorted(p.name for p in outs[2].iterdir())
    files.remove("manifest.json")  # compared above, less its time and command
    for name in files:
        assert (outs[1] / name).read_bytes() == (outs[2] / name).read_bytes(), name
    expected = [_byte_doc(t) for t in texts] + [_byte_doc("a small file")]
    expected.append(_byte_doc("another small file"))
    assert _docs(outs[2]) == expected


def test_plan_pieces_groups_small_files_and_splits_large_jsonl():
    files = [("a.txt", 10), ("b.jsonl", 30), ("c.txt", 0), ("d.txt", 95), ("e.jsonl", 250)]
    assert prepare.plan_pieces(files, 100) == [
        [("a.txt", 0, 10), ("b.jsonl", 0, 30), ("d.txt", 0, 95)],
        [("e.jsonl", 0, 83)],
        [("e.jsonl", 83, 166)],
        [("e.jsonl", 166, 250)],
    ]


# --------------------------------------------------------------------------- streaming


def test_memory_does_not_grow_with_the_file(tmp_path):
    """A 60 MB JSONL through one worker: peak memory grows by far less than the file
    (about 9 MB: a shard's checksum reads 4 MiB blocks, the reads 1 MiB buffers)."""
    line = (json.dumps({"text": "streamed text " * 280}) + "\n").encode()  # ~4 KB
    path = tmp_path / "big.jsonl"
    with open(path, "wb") as f:
        f.write(line * (60_000_000 // len(line)))
    size = path.stat().st_size
    # the peak is VmHWM, not ru_maxrss: on Linux a child's ru_maxrss starts at the peak of
    # the process it was forked from (here pytest, JAX loaded), carried across exec
    script = textwrap.dedent(
        """
        import sys
        import ultrajax.cli, ultrajax.tools.data, tqdm

        def status_kib(key):
            for line in open("/proc/self/status"):
                if line.startswith(key + ":"):
                    return int(line.split()[1])

        try:  # reset the peak to the current size (Linux >= 4.0)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass
        before = status_kib("VmRSS")
        ultrajax.tools.data.prepare_main(sys.argv[1:])
        print("growth", (status_kib("VmHWM") - before) * 1024)
        """
    )
    out = tmp_path / "out"
    args = ["--input", path, "--tokenizer", "bytes", "--out", out, "--workers", "1"]
    proc = subprocess.run(
        [sys.executable, "-c", script, *map(str, args)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    growth = int(re.search(r"^growth (-?\d+)", proc.stdout, re.M).group(1))
    assert growth < size / 4, (growth, size)
    m = PreparedCorpus(out).manifest
    assert m["documents"] == size // len(line)
    assert m["tokens"] == m["documents"] * (len(json.loads(line)["text"]) + 2)


# --------------------------------------------------------------------------- bad input


def _bad_corpus(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(
        b'{"text": "good one"}\n'
        b"{not json\n"
        b'{"id": 3}\n'
        b'["a", "list"]\n'
        b'{"text": "caf\xe9 latin-1"}\n'
        b'{"text": 5}\n'
        b'{"text": "good two"}\n'
    )
    (tmp_path / "z.txt").write_bytes(b"fine\nfine\nbad \xff here\n")
    return path


def test_problems_are_counted_with_file_and_line(tmp_path, capsys):
    bad = _bad_corpus(tmp_path)
    z = tmp_path / "z.txt"
    out = tmp_path / "out"
    _, err = _run(capsys, "--input", tmp_path / "*", "--tokenizer", "bytes", "--out", out)
    expected = [
        f"{bad}:2: invalid JSON",
        f'{bad}:3: "text" is missing, not a string',
        f"{bad}:4: a JSON array, not an object",
        f"{bad}:5: invalid UTF-8 (byte 0xe9",
        f'{bad}:6: "text" is a JSON number, not a string',
        f"{z}:3: invalid UTF-8 (byte 0xff",
    ]
    m = PreparedCorpus(out).manifest
    assert len(m["problems"]["first"]) == len(expected)
    for got, want in zip(m["problems"]["first"], expected, strict=True):
        assert got.startswith(want), (got, want)
        assert f"  {got}\n" in err
    assert m["problems"]["count"] == 6
    assert m["problems"]["kinds"] == {
        "invalid JSON": 1,
        "invalid UTF-8": 2,
        "no text": 2,
        "not an object": 1,
    }
    assert "6 problems (1 invalid JSON, 2 invalid UTF-8, 2 no text, 1 not an object)" in err
    # the good documents, and those with invalid UTF-8 (replaced, kept)
    assert _docs(out) == [
        _byte_doc("good one"),
        _byte_doc("caf\ufffd latin-1"),
        _byte_doc("good two"),
        _byte_doc("fine\nfine\nbad \ufffd here\n"),
    ]


def test_strict_fails_on_the_first_problem_and_writes_nothing(tmp_path, capsys):
    bad = _bad_corpus(tmp_path)
    out = tmp_path / "out"
    err = _fails(capsys, "--input", bad, "--tokenizer", "bytes", "--out", out, "--strict")
    assert f"{bad}:2: invalid JSON" in err
    assert not out.exists()
    _no_leftovers(tmp_path)

    # as a command: status 2, one line; a problem only in a later piece, with 2 workers
    good = _jsonl(tmp_path / "good.jsonl", [{"text": f"ok {i}"} for i in range(2000)])
    (tmp_path / "zz.txt").write_bytes(b"\xff")
    proc = subprocess.run(
        [sys.executable, "-m", "ultrajax.data", "prepare", "--input", good, "--input",
         tmp_path / "zz.txt", "--tokenizer", "bytes", "--out", out, "--strict",
         "--workers", "2", "--shard-mib", "0.005"],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"error: {tmp_path / 'zz.txt'}:1: invalid UTF-8")
    assert proc.stderr.count("\n") == 1 and proc.stdout == ""
    assert not out.exists()
    _no_leftovers(tmp_path)


def test_the_files_source_keeps_and_reports_what_prepare_does(tmp_path, capsys):
    """One set of line checks (ultrajax/data/records.py): a corpus trained from its files
    and the same corpus prepared hold the same documents and name the same lines."""
    _bad_corpus(tmp_path)
    out = tmp_path / "out"
    _run(capsys, "--input", tmp_path / "*", "--tokenizer", "bytes", "--out", out)
    problems = sources.Problems()
    docs = sources.file_docs(str(tmp_path / "*"), problems)
    assert [_byte_doc(d.read()) for d in docs] == _docs(out)
    m = PreparedCorpus(out).manifest
    assert dict(problems.kinds) == m["problems"]["kinds"]
    assert problems.first == m["problems"]["first"][: sources.Problems.SHOWN]


def test_one_problem_is_said_in_the_singular(tmp_path, capsys):
    path = _jsonl(tmp_path / "a.jsonl", [{"text": "good"}, "{bad\n"])
    _, err = _run(capsys, "--input", path, "--tokenizer", "bytes", "--out", tmp_path / "out")
    assert err.splitlines()[-2:] == [
        "1 problem (1 invalid JSON):",
        f"  {path}:2: invalid JSON (Expecting property name enclosed in double quotes, column 2)",
    ]


# --------------------------------------------------------------------------- errors


def test_errors_are_one_line(tmp_path, capsys):
    doc = tmp_path / "a.txt"
    doc.write_text("text")
    out = tmp_path / "out"
    common = ["--tokenizer", "bytes", "--out", out]
    assert "matches no files" in _fails(capsys, "--input", tmp_path / "*.jsonl", *common)
    assert "does not exist" in _fails(capsys, "--input", tmp_path / "nope", *common)
    # one pattern of several matching nothing is an error too
    missing = f"{tmp_path}/x*.md"
    assert f"{missing!r} matches" in _fails(capsys, "--input", doc, "--input", missing, *common)
    err = _fails(capsys, "--input", doc, "--tokenizer", tmp_path / "none.json", "--out", out)
    assert "--tokenizer" in err and "none.json" in err and "does not exist" in err
    assert "--out" in _fails(capsys, "--input", doc, "--tokenizer", "bytes")  # argparse
    assert not out.exists()

    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("not ours")
    assert "--overwrite" in _fails(capsys, "--input", doc, "--tokenizer", "bytes", "--out", other)
    err = _fails(capsys, "--input", doc, "--tokenizer", "bytes", "--out", other, "--overwrite")
    assert "not a prepared directory" in err
    assert (other / "keep.txt").read_text() == "not ours"

    # an empty directory is fine; a prepared one is replaced with --overwrite
    out.mkdir()
    _run(capsys, "--input", doc, *common)
    assert "--overwrite" in _fails(capsys, "--input", doc, *common)
    doc.write_text("new text")
    _run(capsys, "--input", doc, *common, "--overwrite")
    assert _docs(out) == [_byte_doc("new text")]
    _no_leftovers(tmp_path)

    (tmp_path / "blank.jsonl").write_text("\n\n")
    assert "no documents" in _fails(
        capsys, "--input", tmp_path / "blank.jsonl", "--tokenizer", "bytes", "--out", tmp_path / "o"
    )


# --------------------------------------------------------------------------- command line


def test_command_prints_the_summary_line(tmp_path):
    _jsonl(tmp_path / "a.jsonl", [{"text": "abc"}, {"text": "de"}])
    (tmp_path / "b.txt").write_text("fgh")
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "ultrajax.data", "prepare", "--input", str(tmp_path / "*.*"),
         "--tokenizer", "bytes", "--out", str(out)],
        capture_output=True, text=True, cwd=REPO, timeout=120,
        env={**os.environ, "COLUMNS": "80"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert re.fullmatch(
        r"prepared 3 documents, 14 tokens in 1 shard \(uint16, 60 B\) from 34 B in "
        rf"\d+\.\d s \([\d.]+[kMG]? tokens/s, 1 worker\) -> {re.escape(str(out))}\n",
        proc.stdout,
    ), proc.stdout
    assert prepare.summary(
        {"dtype": "<u4", "shards": [{}] * 3, "documents": 1234, "tokens": 5_678_901,
         "inputs": [{"bytes": 12_300_000}]},
        "DIR", 2.1, 2,
    ) == (
        "prepared 1,234 documents, 5,678,901 tokens in 3 shards (uint32, 22.7 MB) from "
        "12.3 MB in 2.1 s (2.7M tokens/s, 2 workers) -> DIR"
    )  # fmt: skip


def test_bench_fills_a_mesh_size_from_devices_and_refuses_bad_numbers(capsys):
    """`data bench` times the feed of a config whose mesh fills a size (-1) only when told
    the run's devices (the global batch depends on them), and says so in one line when not;
    a count below 1 is one line too (it was a ZeroDivisionError, or a negative rate)."""
    base = ["--config", str(REPO / "configs" / "tiny.yaml"), "mesh.data=-1", "--steps", "1"]

    def fails(*args):
        with pytest.raises(SystemExit) as e:
            command.bench([*base, *args])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1, err
        return err

    assert "--devices N" in fails()
    for bad in (["--steps", "0"], ["--processes", "0"], ["--devices", "0"]):
        assert ">= 1" in fails("--devices", "4", *bad)
    # processes that cannot share the devices (it printed a figure for 8 processes of 1)
    assert "--processes 8 does not divide the mesh's 4 device(s)" in fails(
        "--devices", "4", "--processes", "8"
    )
    # configs/tiny.yaml: micro-batches of 8 rows, 2 of them a step; 4 devices' worth
    assert command.bench([*base, "--devices", "4", "--processes", "2"]) == 0
    out = capsys.readouterr().out
    assert "| 1 of 2 | 32 / 32 of 64 |" in out, out
