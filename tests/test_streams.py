"""Logical streams: the same global batch whatever the number of processes, resume on any
process count, shuffle after packing, mixtures by weight, rows placed on devices, and the
background feed."""

import json
import re
import subprocess
import sys
import threading

import harness
import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding

from ultrajax.config import parse
from ultrajax.config.schema import ConfigError
from ultrajax.data import loader as data_lib
from ultrajax.data import sources as sources_lib
from ultrajax.data import streams, tokenizer
from ultrajax.data.prefetch import Prefetcher
from ultrajax.parallel import mesh as mesh_lib
from ultrajax.train import batch as batch_lib
from ultrajax.train import setup

TOK = tokenizer.ByteTokenizer()


def _source(n, prefix="d", length=lambda i: 5 + (i * 7) % 13, weight=1.0):
    docs = [
        sources_lib.Doc(key=f"{prefix}{i}", text=f"<{prefix}{i}>" + "x" * length(i))
        for i in range(n)
    ]
    return streams.Source(np.arange(n), sources_lib.TextReader(docs, TOK), weight, prefix)


def _streams(
    sources, rows=None, *, batch=16, n=4, window=0, seed=0, seq_len=15, accum=1, default=False
):
    return streams.Streams(
        sources, batch_size=batch, grad_accum=accum, streams=n, seed=seed, seq_len=seq_len,
        cross_doc_mask=True, window=window, rows=rows, default=default,
    )  # fmt: skip


def _process_rows(p, processes, batch=16, grad_accum=2):
    return streams.data_parallel_rows(p, processes, batch, grad_accum)


def _global(parts, batch=16):
    """Assemble processes' rows into the global batch, checking they agree where they overlap."""
    out = {}
    for rows, packed in parts:
        for i, r in enumerate(rows):
            row = {k: v[i] for k, v in packed.items()}
            if r in out:
                for k in row:
                    np.testing.assert_array_equal(out[r][k], row[k])
            out[r] = row
    assert sorted(out) == list(range(batch))
    return {k: np.stack([out[r][k] for r in range(batch)]) for k in out[0]}


def _run(processes, steps, sources, *, window=8, state=None, n=8):
    """`steps` global batches as `processes` processes would make them (each only its rows),
    and the merged state after them."""
    procs = [
        _streams(sources, _process_rows(p, processes), window=window, n=n, accum=2)
        for p in range(processes)
    ]
    if state is not None:
        for s in procs:
            s.set_state(state)
    batches = [_global([(s.rows, next(s)) for s in procs]) for _ in range(steps)]
    merged = {}
    for s in procs:
        merged.update(s.get_state()["positions"])
    return batches, dict(procs[0].get_state(), positions=merged), procs


def test_the_global_batch_is_the_same_for_1_2_and_4_processes_and_each_packs_its_share():
    sources = [_source(40)]
    ref, _, _ = _run(1, 6, sources)
    for processes in (2, 4):
        got, _, procs = _run(processes, 6, sources)
        for a, b in zip(ref, got, strict=True):
            for k in a:
                np.testing.assert_array_equal(a[k], b[k])
        owned = [set(s.owned) for s in procs]  # 8 streams: whole streams, none packed twice
        assert set().union(*owned) == set(range(8)) and sum(map(len, owned)) == 8
    # fewer streams than processes: a stream is packed by several processes (the same
    # rows: the batch is still right, the work is repeated)
    got, _, procs = _run(4, 2, sources, n=2)
    for a, b in zip(_run(1, 2, sources, n=2)[0], got, strict=True):
        np.testing.assert_array_equal(a["tokens"], b["tokens"])
    assert [s.owned for s in procs] == [[0], [0], [1], [1]]
    assert not np.array_equal(ref[0]["tokens"], ref[1]["tokens"])


def test_a_state_saved_by_2_processes_resumes_on_1_and_4_mid_epoch():
    sources = [_source(40)]
    full, _, _ = _run(1, 9, sources)  # 9 x 16 rows of 16 tokens: past one epoch (~3.5k)
    _, state, _ = _run(2, 5, sources)
    state = json.loads(json.dumps(state))  # as a checkpoint stores it: tuples become lists
    for processes in (1, 4):
        after, _, _ = _run(processes, 4, sources, state=state)
        for a, b in zip(full[5:], after, strict=True):
            for k in a:
                np.testing.assert_array_equal(a[k], b[k])


def _identity_keys_advised(message: str) -> list[str]:
    """The settings of the run's identity (config/parse.py) that an error's advice, what
    follows its first ': ', names: following such advice moves the run to a new directory."""
    advice = message.split(": ", 1)[1]
    keys = re.findall(r"\b([a-z]+)\.([a-z_]+)\b", advice)
    return [f"{a}.{b}" for a, b in keys if a in parse.IDENTITY or (a, b) == ("train", "seed")]


def test_a_state_from_another_pipeline_or_count_is_refused_naming_no_identity_setting():
    state = _streams([_source(10)], n=4).get_state()
    with pytest.raises(ConfigError) as e:
        _streams([_source(10)], n=8).set_state(state)  # pinned: the config asks for 8
    assert not _identity_keys_advised(str(e.value)), e.value
    assert "checkpoint.init_from" in str(e.value)
    with pytest.raises(ConfigError, match="do not split a global batch of 12 rows") as e:
        _streams([_source(10)], batch=12, n=4, default=True).set_state(dict(state, streams=8))
    assert not _identity_keys_advised(str(e.value)), e.value
    assert "a multiple of 8" in str(e.value)
    with pytest.raises(ConfigError, match="older data pipeline"):
        _streams([_source(10)], n=4).set_state({"next_index": 3})


def test_a_resume_under_another_default_count_continues_the_saved_streams():
    """A checkpoint read as 4 streams (the default before: gcd(micro-batch rows, 64)),
    resumed where the default is now 16: the run goes on with the saved 4 streams."""
    sources = [_source(40)]
    old = _streams(sources, n=4, accum=4, window=8)
    next(old)
    state = json.loads(json.dumps(old.get_state()))
    expected = [next(old)["tokens"] for _ in range(3)]
    count = streams.stream_count([16], None)
    assert count == 16
    new = _streams(sources, n=count, accum=4, window=8, default=True)
    new.set_state(state)
    assert new.count == 4 and new.describe() == "4 streams of 4 rows a step"
    for want in expected:
        np.testing.assert_array_equal(next(new)["tokens"], want)


def test_the_default_stream_count_is_a_function_of_the_global_batch_only():
    assert streams.stream_count([16], None) == 16 and streams.stream_count([96], None) == 32
    assert streams.stream_count([512], None) == 64 and streams.stream_count([6], None) == 2
    assert streams.stream_count([16, 48, 96], None) == 16  # a ramp: it splits every batch
    assert streams.stream_count([16], 8) == 8
    with pytest.raises(ConfigError, match="data.streams=5 does not split a global batch") as e:
        streams.stream_count([16], 5)
    assert not _identity_keys_advised(str(e.value)), e.value


def test_a_batch_ramp_grows_each_stream_s_rows_and_keeps_who_packs_them():
    """Micro-batches of 2 rows, 4 then 6 of them a step (a ramp from 8 to 12 rows): the
    default count, gcd(64, 8, 12) = 4, splits both; each stream gives 2 then 3 rows a step
    and a data-parallel process (one row of each micro-batch) keeps packing whole streams."""
    count = streams.stream_count([8, 12], None)
    assert count == 4
    rows = streams.data_parallel_rows(0, 2, 8, 4)
    s = streams.Streams([_source(30)], batch_size=8, grad_accum=4, streams=count, seed=0,
                        seq_len=15, cross_doc_mask=True, rows=rows, batch_sizes=[12])  # fmt: skip
    assert s.owned == [0, 2] and sorted(s.rows) == rows
    s.grad_accum = 6
    assert len(next(s)["tokens"]) == 6 and sorted(s.rows) == [0, 2, 4, 6, 8, 10]
    with pytest.raises(ConfigError, match="4 streams do not split a global batch of 10 rows"):
        s.grad_accum = 5


# the same global batch of 8 rows, split four ways on 8 simulated devices
SPLITS = {
    "8x1": ["train.micro_batch_size=8", "train.grad_accum=1"],
    "2x4": ["train.micro_batch_size=2", "train.grad_accum=4"],
    "data=2": ["mesh.data=2", "train.micro_batch_size=4", "train.grad_accum=1"],
    "data=2, 2x2": ["mesh.data=2", "train.micro_batch_size=2", "train.grad_accum=2"],
}
DEFAULTS = ["model.seq_len=32", "train.seed=3"]  # tiny.yaml's data settings, data.streams unset


def _split_data(split, processes=1, p=0):
    """A split's data as setup.build_run makes it: the rows its devices hold (all of them
    with one process; process p's share of the data-parallel rows with several)."""
    cfg, devices = harness.make(*SPLITS[split], base=DEFAULTS)
    assert cfg.data.streams is None and cfg.global_batch == 8
    sh = batch_lib.sharding(mesh_lib.make_mesh(cfg, devices))
    rows = batch_lib.rows_needed(sh, cfg.train.grad_accum, 8, cfg.model.seq_len)
    if processes > 1:
        rows = streams.data_parallel_rows(p, processes, 8, cfg.train.grad_accum)
    d = data_lib.build(
        cfg.data, seq_len=cfg.model.seq_len, batch_size=8, seed=cfg.train.seed,
        vocab_size=cfg.model.vocab_size, grad_accum=cfg.train.grad_accum, rows=rows,
    )  # fmt: skip
    return d, sh, cfg


def _step_rows(d, sh, cfg) -> list[bytes]:
    """One step's rows as the step reads them (placed on the devices), as a sorted list."""
    t = d.train
    batch = setup.rows_to_global(next(t), t.rows, t.grad_accum, sh, cfg)
    tokens = np.asarray(batch.inputs).reshape(8, -1)
    return sorted(row.tobytes() for row in tokens)


def test_8x1_2x4_and_data_2_read_the_same_rows_each_step_with_default_settings():
    """The rows of a step depend on the seed, the data config, the global batch and the
    position only: every split of the same global batch trains on the same 8 rows (the
    loss is their summed NLL over their target count: the same up to float rounding)."""
    ref = None
    for split in SPLITS:
        d, sh, cfg = _split_data(split)
        got = [_step_rows(d, sh, cfg) for _ in range(3)]
        ref = ref or got
        assert got == ref, split
    assert ref[0] != ref[1]
    for split in ("8x1", "2x4"):  # as 2 processes: each packs whole streams, 4 of the 8
        owned = [set(_split_data(split, 2, p)[0].train.owned) for p in (0, 1)]
        assert sorted(map(len, owned)) == [4, 4] and owned[0] | owned[1] == set(range(8))


def test_a_resume_onto_another_split_continues_the_same_data():
    d, sh, cfg = _split_data("8x1")
    _step_rows(d, sh, cfg)
    state = json.loads(json.dumps(d.state()))  # as a checkpoint stores it
    expected = [_step_rows(d, sh, cfg) for _ in range(2)]
    for split in ("2x4", "data=2, 2x2"):
        d, sh, cfg = _split_data(split)
        d.restore(state)
        assert [_step_rows(d, sh, cfg) for _ in range(2)] == expected, split


def test_grad_accum_changes_where_rows_go_not_which_rows():
    """16 rows a step from 4 streams, as 1 micro-batch of 16 or 4 of 4: each stream gives
    the same 4 rows a step either way, so a step's rows are the same set (and the summed
    gradient the same up to the order of the sum)."""
    one = _streams([_source(30)], n=4, accum=1, window=4)
    four = _streams([_source(30)], n=4, accum=4, window=4)
    for _ in range(3):
        a, b = next(one), next(four)
        assert sorted(r.tobytes() for r in a["tokens"]) == sorted(r.tobytes() for r in b["tokens"])
        order_a, order_b = np.argsort(one.rows), np.argsort(four.rows)
        assert not np.array_equal(a["tokens"][order_a], b["tokens"][order_b])


def test_shuffle_after_packing_spreads_a_long_document_over_batches():
    """A ~5-row document among short ones, 4 rows a stream a step: packed in order its rows
    sit together in one or two batches; shuffled in windows of 32 rows they spread out."""

    def long_rows(window):
        src = _source(40, length=lambda i: 70 if i == 0 else 6)
        s = _streams([src], batch=16, n=4, window=window)
        counts = []
        for _ in range(24):
            toks = next(s)["tokens"]
            counts.append(int(sum("<d0>" in TOK.decode(r) or set(r) == {ord("x")} for r in toks)))
        return counts

    plain, shuffled = long_rows(0), long_rows(32)
    assert sum(plain) == sum(shuffled) >= 4  # the same rows, in other batches
    assert max(plain) >= 3 and max(shuffled) < max(plain)
    assert sum(c > 0 for c in shuffled) > sum(c > 0 for c in plain)


def test_mixture_weights_hold_and_resume():
    a, b = _source(30, "a", weight=3.0), _source(30, "b", weight=1.0)
    s = _streams([a, b], n=4, window=8)
    rows = [TOK.decode(r) for _ in range(60) for r in next(s)["tokens"]]
    tagged = [r for r in rows if "<a" in r or "<b" in r]
    share = np.mean(["<a" in r for r in tagged])
    assert abs(share - 0.75) < 0.05, share
    state = s.get_state()
    nxt = next(s)["tokens"]
    again = _streams([a, b], n=4, window=8)
    again.set_state(state)
    np.testing.assert_array_equal(next(again)["tokens"], nxt)


def test_random_packed_rows_hold_the_documents_asked_for():
    """The benchmarks' random rows (bench_step.py --docs): `documents` a row, ids rising
    from 1 by one at each start, positions counted from each document's start; one
    document a row is the row's own positions."""
    rng = np.random.default_rng(3)
    one = batch_lib.random_packed(3, 31, 50, rng)
    assert (one["segment_ids"] == 1).all()
    np.testing.assert_array_equal(one["positions"], np.broadcast_to(np.arange(32), (3, 32)))
    packed = batch_lib.random_packed(5, 31, 50, rng, documents=4)
    seg, pos = packed["segment_ids"], packed["positions"]
    assert seg.shape == pos.shape == packed["tokens"].shape == (5, 32)
    steps = np.diff(seg, axis=1)
    assert (seg[:, 0] == 1).all() and (seg[:, -1] == 4).all() and set(steps.ravel()) <= {0, 1}
    starts = np.concatenate([np.ones((5, 1), bool), steps == 1], axis=1)
    assert (pos[starts] == 0).all() and (np.diff(pos, axis=1)[steps == 0] == 1).all()
    with pytest.raises(ValueError, match="documents"):
        batch_lib.random_packed(1, 7, 50, rng, documents=9)


def test_rows_needed_and_place_rows_match_placing_the_whole_batch():
    axes = ("data", "fsdp", "expert", "sequence")
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 1, 2), axes)
    sh = NamedSharding(mesh, batch_lib.SPEC)
    rng = np.random.default_rng(0)
    packed = batch_lib.random_packed(16, 8, 100, rng)
    whole = batch_lib.place(batch_lib.make(packed, True, 2), sh)
    rows = batch_lib.rows_needed(sh, 2, 16, 8)
    assert rows == list(range(16))  # one process holds every device
    perm = rng.permutation(16)  # rows handed over in any order
    local = batch_lib.make({k: v[perm] for k, v in packed.items()}, True)
    placed = batch_lib.place_rows(local, perm, 16, 2, sh)
    for a, b in zip(whole, placed, strict=True):
        assert a.sharding == b.sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="did not make"):
        batch_lib.place_rows(batch_lib.Batch(*(x[:8] for x in local)), perm[:8], 16, 2, sh)


def test_prefetcher_hands_out_the_state_of_what_it_returned():
    it = iter(range(100))
    made = []
    lock = threading.Lock()

    def produce():
        with lock:
            made.append(next(it))
            return made[-1]

    feed = Prefetcher(produce, lambda: len(made), depth=3)
    assert feed.state() == 0
    assert [next(feed) for _ in range(4)] == [0, 1, 2, 3]
    assert feed.state() == 4  # made ahead: not counted
    feed.close()
    inline = Prefetcher(iter(range(5)).__next__, lambda: "s", depth=0)
    assert next(inline) == 0 and inline.state() == "s"

    def broken():
        raise OSError("disk gone")

    bad = Prefetcher(broken, lambda: None, depth=2)
    with pytest.raises(OSError, match="disk gone"):
        next(bad)


SMALL = [
    "model.d_model=32", "model.n_layers=1", "model.n_heads=4", "model.n_kv_heads=2",
    "model.d_ff=64", "model.seq_len=32", "model.dtype=float32", "model.scan_unroll=1",
    "model.attention=xla", "train.steps=4", "train.log_every=1", "train.eval_batches=0",
    "optim.warmup_steps=0",
]  # fmt: skip


def _losses(run_dir) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    return {r["step"]: r["loss"] for r in records}


def _train(run_dir, split, *extra) -> subprocess.Popen:
    devices = "2" if split.startswith("data=2") else "1"
    args = ["--config", harness.TINY, "--cpu-devices", devices, *SMALL, *SPLITS[split]]
    env = harness.child_env()  # conftest's 8 devices: --cpu-devices decides here
    return subprocess.Popen(
        [sys.executable, "-m", "ultrajax.train", *args, f"train.run_dir={run_dir}", *extra],
        cwd=harness.ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip


def _done(proc: subprocess.Popen) -> None:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]


@pytest.mark.slow
def test_8x1_2x4_and_data_2_train_to_the_same_losses_and_resume_across_them(tmp_path):
    """End to end with default settings (fp32): 8 x 1 and 2 x 4 give the same losses, and
    a run saved at step 2 under 8 x 1 resumes under data=2 (2 x 2 each) to the same steps
    3 and 4: the same data continues."""
    a, b = _train(tmp_path / "a", "8x1", "checkpoint.every=2"), _train(tmp_path / "b", "2x4")
    _done(a), _done(b)
    ref, split = _losses(tmp_path / "a"), _losses(tmp_path / "b")
    assert list(ref) == list(split) == [1, 2, 3, 4]
    np.testing.assert_allclose(list(split.values()), list(ref.values()), rtol=1e-5)
    saved = tmp_path / "a" / "checkpoints" / "2"
    _done(_train(tmp_path / "c", "data=2, 2x2", f"checkpoint.resume={saved}"))
    resumed = _losses(tmp_path / "c")
    assert list(resumed) == [3, 4]
    np.testing.assert_allclose([resumed[3], resumed[4]], [ref[3], ref[4]], rtol=1e-5)
