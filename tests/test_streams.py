"""Logical streams: the same global batch whatever the number of processes, resume on any
process count, shuffle after packing, mixtures by weight, rows placed on devices, and the
background feed."""

import json
import threading

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding

from ultrajax.config.schema import ConfigError
from ultrajax.data import sources as sources_lib
from ultrajax.data import streams, tokenizer
from ultrajax.data.prefetch import Prefetcher
from ultrajax.train import batch as batch_lib

TOK = tokenizer.ByteTokenizer()


def _source(n, prefix="d", length=lambda i: 5 + (i * 7) % 13, weight=1.0):
    docs = [
        sources_lib.Doc(key=f"{prefix}{i}", text=f"<{prefix}{i}>" + "x" * length(i))
        for i in range(n)
    ]
    return streams.Source(np.arange(n), sources_lib.TextReader(docs, TOK), weight, prefix)


def _streams(sources, rows=None, *, batch=16, n=4, window=0, seed=0, seq_len=15, accum=1):
    return streams.Streams(
        sources, batch_size=batch, grad_accum=accum, streams=n, seed=seed, seq_len=seq_len,
        cross_doc_mask=True, window=window, rows=rows,
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


def test_a_state_for_another_stream_count_is_refused_with_the_fix():
    state = _streams([_source(10)], n=4).get_state()
    with pytest.raises(ConfigError, match="set data.streams=4"):
        _streams([_source(10)], n=8).set_state(state)
    with pytest.raises(ConfigError, match="older data pipeline"):
        _streams([_source(10)], n=4).set_state({"next_index": 3})


def test_stream_count_divides_a_micro_batch():
    assert streams.stream_count(16, None) == 16 and streams.stream_count(96, None) == 32
    assert streams.stream_count(512, None) == 64 and streams.stream_count(6, None) == 2
    with pytest.raises(ConfigError, match="data.streams=5 must divide the rows of a micro"):
        streams.stream_count(16, 5)


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


def test_rows_needed_and_place_rows_match_placing_the_whole_batch():
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("data", "fsdp", "sequence"))
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
