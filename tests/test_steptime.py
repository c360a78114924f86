"""The step-time model's scale terms and its pipeline pricing, each held to what it means
(docs/planner.md), and the leave-node-count-out fit of scripts/validate_planner.py.

tests/data/playbook_nodes_sample.csv: every other run of the 1.34B on 1 and 4 nodes,
copied from the playbook's sweep (../shared/playbook_runs/calibration.csv)."""

import importlib.util
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from ultrajax.config import parse
from ultrajax.cost import flops, hardware, steptime
from ultrajax.parallel.pipeline import schedules

ROOT = Path(__file__).resolve().parent.parent
NODES_SAMPLE = ROOT / "tests" / "data" / "playbook_nodes_sample.csv"
H100 = hardware.by_name("h100")
SCALE = steptime.Fit(congestion=0.2, jitter=0.05, step_overhead=0.1, node_latency=1e-5)


def _script():
    spec = importlib.util.spec_from_file_location(
        "validate_planner", ROOT / "scripts" / "validate_planner.py"
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_a_reduction_takes_longer_over_more_nodes_at_the_same_bytes():
    """Congestion and the per-node bucket latency: the same bytes, a ring over more nodes."""
    nbytes = 2.7e9
    times = []
    for nodes in (2, 4, 16, 64):
        link = steptime.links({"data": 8 * nodes}, H100, 8)["data"]
        assert link.inter and link.nodes == nodes
        times.append(link.seconds(nbytes, SCALE) + link.bucket_latency(nbytes, SCALE))
    assert all(a < b for a, b in zip(times, times[1:], strict=False))
    # with the scale terms off the bandwidth term does not depend on the node count
    off = steptime.Fit()
    flat = [steptime.links({"data": 8 * n}, H100, 8)["data"].seconds(nbytes, off) for n in (2, 64)]
    assert flat[0] == pytest.approx(flat[1])
    inside = steptime.links({"data": 8}, H100, 8)["data"]
    assert inside.bucket_latency(nbytes, SCALE) == 0.0  # one node: no node to cross


def test_straggler_wait_grows_with_nodes_and_is_zero_on_one():
    waits = [steptime.straggler(n, SCALE) for n in (1, 2, 16, 64)]
    assert waits[0] == 0.0
    assert all(a < b for a, b in zip(waits, waits[1:], strict=False))
    assert waits[-1] == pytest.approx(0.05 * np.sqrt(2 * np.log(64)))


def _config(**mesh):
    cfg = parse.load(ROOT / "configs" / "llama-8b.yaml")
    sizes = {"data": 1, "fsdp": 1, "tensor": 1, "pipeline": 1, "sequence": 1, **mesh}
    cfg.mesh = replace(cfg.mesh, **sizes)
    cfg.parallel = replace(cfg.parallel, zero=0, sequence_parallel=cfg.mesh.tensor > 1)
    cfg.train = replace(cfg.train, micro_batch_size=1, grad_accum=8, batch_schedule=None)
    return cfg


def test_scale_terms_add_their_time_only_where_they_mean_something():
    one = steptime.features(_config(data=8), H100, 8)
    many = steptime.features(_config(data=64), H100, 8)
    assert (one.nodes, many.nodes) == (1, 8)
    t_one = steptime.step_time(one, SCALE)
    assert t_one.overhead == pytest.approx(0.1)  # the step's fixed cost; no node to wait for
    t_many = steptime.step_time(many, SCALE)
    assert t_many.overhead > 0.1
    # stage_sync: only where neighbouring stages sit on different nodes, and as a floor
    # under a layer's compute (host time the GPU work hides), not a cost added to it
    sync = steptime.Fit(stage_sync=1e-3)
    inside = steptime.features(_config(pipeline=4, tensor=2), H100, 8)
    apart = steptime.features(
        _config(pipeline=4, tensor=2, data=4),
        H100,
        8,
        order=("pipeline", "data", "fsdp", "sequence", "tensor"),
    )
    assert not inside.stages_apart and apart.stages_apart
    assert steptime.host_floor(apart, sync) - steptime.host_floor(
        apart, steptime.Fit()
    ) == pytest.approx(1e-3 * apart.layers * apart.tensor)
    assert steptime.host_floor(inside, sync) == steptime.host_floor(inside, steptime.Fit())
    assert (
        steptime.step_time(inside, sync).total == steptime.step_time(inside, steptime.Fit()).total
    )
    # the 8B's layers (~10 ms of GPU work a micro-batch at t = 2) hide a 2 ms floor...
    base, hidden = (steptime.step_time(apart, f) for f in (steptime.Fit(), sync))
    assert base.host == 0.0 and hidden.total == pytest.approx(base.total)
    # ...but not a 100 ms one: then the micro-batch's busy time is the floor
    slow = steptime.Fit(stage_sync=0.05)
    t = steptime.step_time(apart, slow)
    assert t.host > 0 and t.pipeline_sends == pytest.approx(base.pipeline_sends)
    assert t.compute + t.host == pytest.approx(apart.m * steptime.host_floor(apart, slow))


@pytest.mark.parametrize("kind,v", [("1f1b", 1), ("zb-h1", 1), ("afab", 1), ("interleaved", 2)])
def test_lockstep_tick_is_its_slowest_op(kind, v):
    """Without the head the time is schedules.lockstep's (a tick lasts its slowest op);
    the shortcut past 2p micro-batches equals the table built in full."""
    p = 4
    for m in (4, 8, 12, 20):
        table = schedules.build(kind, p, m, v)
        assert steptime.lockstep_time(kind, p, m, v, 0.0) == pytest.approx(
            schedules.lockstep(table)[0]
        )
        assert steptime.lockstep_time(kind, p, m, v, 0.3) == pytest.approx(
            steptime._lockstep_table(kind, p, m, v, 0.3)
        )


def test_the_head_lands_in_the_last_stage_forward_tick():
    p, m, h = 4, 8, 0.26
    table = schedules.build("1f1b", p, m)
    # by hand: every forward of the last device costs 1 + 3h; a tick lasts its slowest op
    ops = table[..., 0]
    cost = np.vectorize(lambda o: schedules.COSTS[int(o)])(ops)
    cost[:, p - 1] += 3 * h * (ops[:, p - 1] == schedules.FORWARD)
    assert steptime.lockstep_time("1f1b", p, m, 1, h) == pytest.approx(cost.max(axis=1).sum())
    # a head on the first device instead would not cost the same: the position matters
    first = np.vectorize(lambda o: schedules.COSTS[int(o)])(ops)
    first[:, 0] += 3 * h * (ops[:, 0] == schedules.FORWARD)
    assert first.max(axis=1).sum() != pytest.approx(cost.max(axis=1).sum())
    assert steptime.lockstep_bubble("1f1b", p, m, 1, h) > 0


def test_8b_head_is_about_0_78_of_a_stage_forward_at_p4():
    """The issue's figure: the 8B's LM head, forward and backward in the last stage's
    forward tick, against the forward of its 8 layers."""
    m = replace(_config().model, remat="none")
    head = 6.0 * steptime._head_size(m)
    layers = flops.flops_per_token(m, causal=True) - head
    h = head / layers * m.n_layers / (m.n_layers // 4)
    assert steptime.HEAD_IN_FORWARD * h == pytest.approx(0.78, abs=0.06)


def test_ultrajax_prices_lockstep_nanotron_the_textbook_bubble():
    cfg = _config(pipeline=4, data=2)
    ours = steptime.features(cfg, H100, 8)
    theirs = steptime.features(cfg, H100, 8, balanced=True)
    assert theirs.bubble == pytest.approx(schedules.formula("1f1b", 4, 8))
    assert ours.bubble != pytest.approx(theirs.bubble)  # lockstep ticks, the head last


def test_leave_out_fit_reports_the_figures(capsys):
    vp = _script()
    runs = vp.load(str(NODES_SAMPLE))
    r, fit = vp.leave_out(runs, 4, iters=40)
    assert r["runs"] == sum(int(x.row["nodes"]) == 4 for x in runs)
    figures = r["by_nodes"][4]
    assert 0 <= figures["verdict_agreement"] <= 1 and figures["median_error"] >= 0
    assert -1 <= figures["spearman_mean"] <= 1
    assert set(steptime.SCALE_TERMS) <= set(vars(fit))
    assert vp.main([str(NODES_SAMPLE), "--leave-out", "1", "--iters", "20"]) == 0
    out = capsys.readouterr().out
    assert "left out" in out and "fit without 1 nodes" in out


def test_a_remat_backward_recomputes_its_forward_in_the_lockstep_ticks():
    """Full remat: a backward costs 2 + the recomputed share of a forward (~0.8 for the 8B:
    w_down is never recomputed), and the ticks it fills last longer; none: 2."""
    m = _config().model
    redo = steptime.remat_share(replace(m, remat="full"))
    assert steptime.remat_share(replace(m, remat="none")) == 0.0
    assert 0.7 < redo < 1.0
    assert 0 < steptime.remat_share(replace(m, remat="selective")) < redo
    p, mb = 4, 8
    costs = dict(schedules.COSTS)
    costs[schedules.BACKWARD] += redo
    table = schedules.build("1f1b", p, mb)
    assert steptime.lockstep_time("1f1b", p, mb, 1, 0.0, redo) == pytest.approx(
        schedules.lockstep(table, costs)[0]
    )
    cfg = _config(pipeline=4, data=2)
    cfg.model = replace(cfg.model, remat="none")
    plain = steptime.features(cfg, H100, 8).bubble
    cfg.model = replace(cfg.model, remat="full")
    assert steptime.features(cfg, H100, 8).bubble > plain  # the forward ticks wait longer


def test_zero3_gathers_hide_where_the_program_prefetches_them():
    """ultrajax's layer scan gathers the next layer while this one computes
    (parallel.prefetch, model/prefetch.py): the gathers hide behind compute. Without the
    prefetch a layer is gathered in its own iteration, before the compute that reads it:
    the planner adds the whole gather time to the step, unless
    parallel.pipeline_collectives lets XLA start it an iteration early; a prefetching
    framework (`balanced`) hides it."""
    base = ["mesh.data=8", "mesh.fsdp=8", "parallel.zero=3", "train.micro_batch_size=1",
            "train.grad_accum=8", "model.remat=full"]  # fmt: skip
    path = ROOT / "configs" / "llama-8b.yaml"
    cfg = parse.load(path, [*base, "parallel.prefetch=false"])
    piped = parse.load(
        path, [*base, "parallel.prefetch=false", "parallel.pipeline_collectives=true"]
    )
    fetched = parse.load(path, base)
    f = steptime.features(cfg, H100, 8)
    gathers = sum(lk.seconds(b, steptime.ULTRAJAX, lk.size - 1) for lk, b in f.gathers)
    assert gathers > 0 and not f.gathers_overlap
    exposed, hidden, ahead = (steptime.predict(c, H100) for c in (cfg, piped, fetched))
    assert exposed.context == pytest.approx(f.m * gathers)
    assert hidden.context == 0.0 == ahead.context < exposed.context  # the compute covers it
    assert steptime.features(cfg, H100, 8, balanced=True).gathers_overlap
