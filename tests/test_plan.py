"""The layout planner: its enumeration, its step-time model's pieces, the command line,
and the validation against the Ultra-Scale Playbook's sweep.

tests/data/playbook_sample.csv: the 1- node cells of the 1.34B and 8.86B models (125 runs)
copied from the playbook's benchmark sweep (../shared/playbook_runs/calibration.csv,
nanotron on H100 nodes of 8; its README gives the model shapes)."""

import importlib.util
import json
import math
import re
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from ultrajax import cli
from ultrajax.config import parse, validate
from ultrajax.config import schema as config
from ultrajax.cost import candidates, comms, hardware, memory, steptime
from ultrajax.model.llama import param_count
from ultrajax.tools import plan

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "tests" / "data" / "playbook_sample.csv"


def _script():
    spec = importlib.util.spec_from_file_location(
        "validate_planner", ROOT / "scripts" / "validate_planner.py"
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


vp = _script()


def _small() -> config.Config:
    cfg = config.Config()
    m = cfg.model
    m.vocab_size, m.d_model, m.n_layers, m.n_heads, m.n_kv_heads = 32000, 1024, 12, 16, 4
    m.d_ff, m.seq_len = 2816, 2048
    return cfg


def test_enumeration_divides_model_batch_and_devices():
    base = _small()
    gpus, tokens = 16, 64 * 2048
    seen = list(candidates.enumerate_candidates(base, gpus, 8, tokens // 2048))
    assert len(seen) > 100
    m = base.model
    for lay in seen:
        assert lay.data * lay.fsdp * lay.tensor * lay.pipeline * lay.sequence == gpus
        assert lay.data * lay.fsdp * lay.micro_batch * lay.accum * 2048 == tokens
        assert m.n_kv_heads % lay.tensor == 0 and m.d_ff % lay.tensor == 0
        assert m.n_layers % (lay.pipeline * lay.virtual) == 0
        assert lay.tensor <= 8  # tensor parallelism stays inside a node
        assert lay.pipeline == 1 or lay.accum >= lay.pipeline
        assert not (lay.zero == 3 and lay.pipeline > 1)
    shapes = {(x.tensor, x.pipeline, x.sequence) for x in seen}
    assert (4, 1, 1) in shapes and (1, 4, 1) in shapes and (2, 1, 2) in shapes
    assert not any(t == 8 for t, _, _ in shapes)  # 4 kv heads: tensor <= 4
    assert not any(p == 8 for _, p, _ in shapes)  # 12 layers
    # what the enumeration yields, the config's own checks accept
    for lay in seen[:: max(1, len(seen) // 40)]:
        cfg = lay.config(base)
        validate.validate_layout(cfg)
        assert cfg.tokens_per_step == tokens
    assert base.mesh.sizes() == config.MeshConfig().sizes()  # the base is not changed


def test_enumeration_is_what_the_validator_accepts():
    """The divisibility rules are the config's: the planner yields exactly the tries
    (mesh shapes, batch splits) that validate_layout accepts, in order. Its shortcuts
    (a mesh shape asked once, schedules asked on few micro-batches) change nothing; the
    shape here makes each rule bite: 24 GPUs (fsdp 3, 6 ... against d_model 1024),
    12 layers (no interleaving on 4 stages), 12 tokens (context and tensor chunks)."""
    base = _small()
    base.model.seq_len = 12
    gpus, sequences = 24, 48
    tries = []
    for tp, cp, pp in candidates._mesh_shapes(gpus, 8):
        dp = gpus // (tp * cp * pp)
        if sequences % dp == 0:
            tries += candidates._batch_splits(sequences // dp, dp, tp, cp, pp, 8)
    accepted = []
    for c in tries:
        try:
            validate.validate_layout(c.config(base))
            accepted.append(c)
        except config.ConfigError:
            pass
    assert 0 < len(accepted) < len(tries)
    assert list(candidates.enumerate_candidates(base, gpus, 8, sequences)) == accepted


def test_enumeration_tries_expert_parallelism_for_moe_models():
    """An MoE model's layouts split the data ranks over `expert` too (sizes that divide
    the experts and stay inside a node); a dense model's never do. Each is priced: its
    memory (the experts, their grouped matmuls) and its step time (the all-to-alls)."""
    dense = list(candidates.enumerate_candidates(_small(), 16, 8, 64))
    assert {c.expert for c in dense} == {1}
    base = _small()
    base.model.moe_experts, base.model.moe_top_k, base.model.moe_d_ff = 8, 2, 1024
    seen = list(candidates.enumerate_candidates(base, 16, 8, 64))
    assert {c.expert for c in seen} == {1, 2, 4, 8}
    for lay in seen:
        assert lay.data * lay.fsdp * lay.expert * lay.tensor * lay.pipeline * lay.sequence == 16
        assert lay.data * lay.fsdp * lay.expert * lay.micro_batch * lay.accum == 64
    acc = hardware.by_name("h100")
    lay = next(c for c in seen if c.expert == 4 and c.tensor == 1 and c.pipeline == 1)
    cfg = lay.config(base)
    assert "mesh.expert=4" in lay.overrides() and " ep4" in lay.short()
    assert memory.estimate(cfg, platform="gpu").peak > 0
    one = replace(lay, data=lay.data * 4, expert=1).config(base)  # the same split, no EP
    t, t1 = (steptime.predict(c, acc, 8) for c in (cfg, one))
    assert t.tensor > t1.tensor  # the all-to-alls, priced where TP's collectives are


def test_a_layouts_overrides_give_it_over_any_config_file(tmp_path):
    """The command the planner prints lays its overrides over the user's file: a file's
    mesh.expert=2 (or virtual stages) stayed in force where a layout had none, so the
    printed command for Mixtral's #1 was refused (its mesh multiplied to 8x the GPUs)."""
    base = _small()
    base.model.moe_experts, base.model.moe_top_k, base.model.moe_d_ff = 8, 2, 1024
    path = tmp_path / "moe.yaml"
    own = _small()
    own.model = base.model
    own.mesh.data, own.mesh.expert, own.mesh.pipeline = -1, 2, 2
    own.parallel.pipeline_schedule, own.parallel.virtual_stages = "interleaved", 3
    path.write_text(parse.dump(own))
    seen = list(candidates.enumerate_candidates(base, 16, 8, 64))
    picked = [c for c in seen if c.expert == 1][:3] + [c for c in seen if c.pipeline > 1][:3]
    assert {c.expert for c in picked} == {1} and any(c.pipeline > 1 for c in picked)
    for c in picked:
        cfg = parse.load(path, c.overrides().split())
        validate.resolve_mesh(cfg, 16)
        validate.validate_layout(cfg)
        assert cfg.mesh.sizes() == c.config(base).mesh.sizes(), c.short()
        assert plan._candidate_of(cfg) == c


def test_every_communication_term_has_an_axis():
    """steptime places comms.expected's terms by what they say: a term it cannot place
    (renamed in cost/comms.py) must fail here, not vanish from the step time."""
    base = _small()
    base.model.attention = "cudnn"
    cases = [dict(data=2, fsdp=4, zero=z) for z in (0, 1, 2, 3)] + [
        dict(fsdp=2, tensor=2, sequence=2, zero=3),
        dict(data=2, fsdp=2, pipeline=2, zero=1),
    ]
    kinds = set()
    for case in cases:
        cfg = config.Config(model=base.model)
        cfg.parallel.zero = case.pop("zero")
        cfg.parallel.sequence_parallel = case.get("tensor", 1) > 1
        cfg.train.grad_accum = 4
        for k, v in case.items():
            setattr(cfg.mesh, k, v)
        for term in comms.expected(cfg):
            kinds.add(steptime._axis_of(term)[1])
    assert kinds == {"tp", "p2p", "context", "gathers", "hidden", "exposed"}


@pytest.mark.parametrize("schedule, v", [("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)])
def test_pipeline_shortcuts_match_the_full_computation(schedule, v):
    """The planner reads a pipeline's memory at 2p micro-batches and its bytes at p under
    1F1B, then scales: the same figures as asking memory.estimate and comms.expected."""
    cfg = _small()
    cfg.model.attention = "cudnn"
    cfg.mesh.fsdp, cfg.mesh.pipeline, cfg.parallel.zero = 2, 2, 1
    cfg.parallel.pipeline_schedule, cfg.parallel.virtual_stages = schedule, v
    cfg.train.micro_batch_size, cfg.train.grad_accum = 2, 12
    assert candidates.memory_of(cfg, {}) == pytest.approx(memory.estimate(cfg, platform="gpu").peak)
    direct = {t.what: t.traffic for t in comms.expected(cfg)}
    for term, scale in steptime._scaled_terms(cfg, {}):
        assert term.traffic * scale == pytest.approx(direct[term.what], rel=1e-9)


def test_step_time_parts():
    """The bubble is the schedule's (textbook where the executor is not lockstep, the
    lockstep one for ultrajax's); more micro-batches shrink it; TP costs time a
    one-device layout does not pay; the overlap hides the DP reduction."""
    acc = hardware.by_name("h100")
    cfg = _small()
    cfg.model.attention = "cudnn"
    cfg.mesh.pipeline, cfg.train.grad_accum = 4, 4

    def textbook(cfg):
        f = steptime.features(cfg, acc, 8, lockstep=False)
        return steptime.step_time(f, steptime.ULTRAJAX)

    def busy(t):
        return t.total - t.data - t.optimizer - t.overhead

    t = textbook(cfg)
    assert t.bubble / busy(t) == pytest.approx(3 / 7, rel=1e-6)
    cfg.train.grad_accum = 16  # the same p - 1 idle ticks, a smaller share: 3/19
    t16 = textbook(cfg)
    assert t16.bubble == pytest.approx(t.bubble)
    assert t16.bubble / busy(t16) == pytest.approx(3 / 19, rel=1e-6)
    lock = steptime.predict(cfg, acc, 8)  # ultrajax's executor: lockstep ticks, the head last
    f = steptime.features(cfg, acc, 8)
    assert lock.bubble / busy(lock) == pytest.approx(f.bubble, rel=1e-6) != 3 / 19
    tp = _small()
    tp.mesh.tensor, tp.parallel.sequence_parallel = 4, True
    assert steptime.predict(tp, acc, 8).tensor > 0
    dp = _small()
    dp.mesh.data = 8
    f = steptime.features(dp, acc, 8)
    hidden = steptime.step_time(f, steptime.Fit(overlap=1.0)).data
    exposed = steptime.step_time(f, steptime.Fit(overlap=0.0)).data
    assert exposed > hidden >= 0


def test_best_layout_for_1_34b_on_one_node_is_among_the_measured_fastest():
    """The planner over the sweep's own space (dp, tp, pp with 1F1B, micro-batch,
    accumulation, ZeRO 0/1, no remat) on one node of 8 H100s, 1M tokens a step, with the
    nanotron constants and memory model: of the layouts the sweep tried in this cell, its
    best is one of the five fastest that ran."""
    runs = [r for r in vp.load(str(SAMPLE)) if r.row["model"] == "1.34B"]
    ran = sorted((r for r in runs if r.ran), key=lambda r: -r.measured)
    key = lambda r: tuple(int(r.row[k]) for k in ("dp", "tp", "pp", "gas", "mbs", "zero"))  # noqa: E731
    fastest = {key(r) for r in ran[:5]}
    tried = {key(r) for r in runs}
    base = config.Config(model=vp.model_config("1.34B", 4096))
    acc = hardware.by_name("h100")
    scored = []
    for lay in candidates.enumerate_candidates(base, 8, 8, 2**20 // 4096):
        if lay.remat != "none" or lay.zero > 1 or lay.sequence > 1 or lay.schedule != "1f1b":
            continue
        cfg = lay.config(base)
        if vp.nanotron_memory(cfg) > vp.MEMORY_LIMIT:
            continue
        f = steptime.features(cfg, acc, 8, vp.NANOTRON_ORDER, balanced=True)
        t = steptime.step_time(f, steptime.NANOTRON)
        dp = lay.data * lay.fsdp
        k = (dp, lay.tensor, lay.pipeline, lay.accum, lay.micro_batch, int(lay.fsdp > 1))
        if k in tried:
            scored.append((t.tokens_per_s_per_gpu, k))
    assert len(scored) > 20
    best = max(scored)[1]
    assert best in fastest, (best, fastest)


def test_validation_script_reproduces_its_figures(capsys):
    assert vp.main([str(SAMPLE), "--cells"]) == 0
    out = capsys.readouterr().out
    assert "125 runs, 44 ran" in out
    assert "verdict agreement      96.8%" in out
    assert "Spearman (mean/cell)   0.927" in out
    assert "median error tok/s/GPU 8.2%" in out
    assert "1.34B x 1 nodes        32 runs  Spearman 0.918" in out


def test_validation_script_errors_are_one_line(tmp_path, capsys):
    assert vp.main([str(tmp_path / "missing.csv")]) == 2
    bad = tmp_path / "bad.csv"
    bad.write_text("model,nodes\n1.34B,1\n")
    assert vp.main([str(bad)]) == 2
    other = tmp_path / "other.csv"
    other.write_text(SAMPLE.read_text().replace("1.34B", "2B", 1))
    assert vp.main([str(other)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(e.startswith("error: ") for e in err)
    assert "columns missing" in err[1] and "'2B': unknown shape" in err[2]


def test_spearman():
    assert vp.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert vp.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert vp.spearman([1, 2, 2, 3], [1, 3, 2, 4]) == pytest.approx(0.9486833, rel=1e-6)
    assert math.isnan(vp.spearman([1, 1], [1, 2]))


def _run(argv):
    with pytest.raises(SystemExit) as e:
        cli.run(lambda: plan.main(argv))
    return e.value.code


def test_plan_command_ranks_layouts(tmp_path, capsys):
    path = tmp_path / "small.yaml"
    path.write_text(parse.dump(_small()))
    args = ["--config", str(path), "--gpus", "16", "--tokens-per-step", str(64 * 2048)]
    assert _run([*args, "--top", "3"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "16 x h100 (8 per node), 131,072 tokens per step (64 x 2048)" in lines[0]
    ranked = [ln for ln in lines if ln[:2].strip() in ("1", "2", "3")]
    assert len(ranked) == 3
    assert "slower (" in out and "#1: python -m ultrajax.train" in out
    assert _run([*args, "--top", "2", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert len(r["best"]) == 2 and r["gpus"] == 16
    first, second = r["best"]
    assert first["tokens_per_s_per_gpu"] >= second["tokens_per_s_per_gpu"]
    assert first["memory_bytes"] <= r["device_memory"]
    # every layout faster than the second that is not ranked lost on memory, by how much
    for lost in r["faster_oom"]:
        assert lost["memory_bytes"] > r["device_memory"] and lost["lost"].startswith("does not fit")
        assert lost["tokens_per_s_per_gpu"] >= second["tokens_per_s_per_gpu"]
    assert all(s["lost"].endswith(("slower", "%")) or "slower:" in s["lost"] for s in r["slower"])
    pytest.importorskip("matplotlib")
    png = tmp_path / "plan.png"
    assert _run([*args, "--plot", str(png)]) == 0
    assert png.stat().st_size > 10_000 and f"plot: {png}" in capsys.readouterr().out


def test_a_model_no_layout_fits_says_the_least_it_needs(tmp_path, capsys):
    """Nothing fits: the fastest needs were listed, never the least any layout needs."""
    big = _small()
    big.model.d_model, big.model.n_layers, big.model.d_ff = 8192, 40, 28672
    path = tmp_path / "big.yaml"
    path.write_text(parse.dump(big))
    assert _run(["--config", str(path), "--gpus", "2", "--tokens-per-step", "8192"]) == 1
    out = capsys.readouterr().out
    least = re.search(r"the least any layout needs: ([\d.]+) GiB \((.+)\), ([\d.]+) GiB over", out)
    assert least, out
    needs = [float(x) for x in re.findall(r"needs ([\d.]+) GiB", out)]
    assert needs and float(least[1]) <= min(needs)
    assert float(least[1]) - float(least[3]) == pytest.approx(
        hardware.by_name("h100").memory / 2**30, abs=0.11
    )


def test_a_wide_area_link_prices_data_parallelism_and_diloco_across_sites(tmp_path, capsys):
    """--sites 2 --wan-gbps 100 --wan-km 4800: each site plans its 8 GPUs and half the
    batch; one synchronisation of the whole model (fp32) is (N-1)/N of its bytes at the
    link's bandwidth plus 2(N-1) crossings of 4,800 km of fibre; DiLoCo's step at H adds
    1/H of it, data parallelism's a sync of its gradients every step; the smallest H is
    the sync over the step, rounded up."""
    path = tmp_path / "small.yaml"
    path.write_text(parse.dump(_small()))
    args = ["--config", str(path), "--gpus", "16", "--tokens-per-step", str(64 * 2048),
            "--sites", "2", "--wan-gbps", "100", "--wan-km", "4800", "--top", "1"]  # fmt: skip
    assert _run([*args, "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    w, n = r["wan"], param_count(_small().model)
    crossing = 4800 / (299_792.458 / 1.468)
    sync = 0.5 * 4 * n / (100e9 / 8) + 2 * crossing
    assert w["sync_s"] == pytest.approx(sync, rel=1e-9) and w["params"] == n
    step = w["step_s"]
    assert step == pytest.approx(r["best"][0]["step_s"])
    assert w["diloco"]["4"]["step_s"] == pytest.approx(step + sync / 4)
    assert w["data_parallel_step_s"] == pytest.approx(step + sync)  # fp32 gradients
    assert w["hiding_h"] == max(1, math.ceil(sync / step))
    # each site's layout is of its 8 GPUs
    overrides = dict(kv.split("=") for kv in r["best"][0]["overrides"].split())
    sizes = ("mesh.data", "mesh.fsdp", "mesh.tensor", "mesh.pipeline", "mesh.sequence")
    assert math.prod(int(overrides.get(k, 1)) for k in sizes) == 8
    assert _run(args) == 0
    out = capsys.readouterr().out
    assert "8 x h100 (8 per node), 65,536 tokens per step (32 x 2048) a site, 2 sites" in out
    assert "across 2 sites, 4,800 km apart (23.5 ms a crossing), 100 Gbit/s each way" in out


@pytest.mark.parametrize(
    "args, words",
    [
        (["--gpus", "16", "--sites", "3", "--wan-gbps", "10"], "must divide by --sites (3)"),
        (["--gpus", "16", "--sites", "2"], "needs --wan-gbps"),
        (["--gpus", "16", "--sites", "0"], "--sites must be >= 1"),
        (["--gpus", "0"], "--gpus must be >= 1"),
        (["--gpus", "8", "--gpu", "tpu"], "unknown GPU 'tpu'"),
        (["--gpus", "8", "--tokens-per-step", "1000"], "multiple of model.seq_len"),
        (["--gpus", "7", "--tokens-per-step", str(3 * 2048)], "no layout of 7 GPUs"),
        (["--gpus", "8", "model.nope=1"], "model.nope"),
        (["--gpus", "8", "--gpus-per-node", "0"], "--gpus-per-node must be >= 1"),
        (["--gpus", "8", "--gpus-per-node", "3"], "8 GPUs do not fill nodes of 3"),  # was priced
        # 0 was taken as "the config's batch"; the link flags without sites were ignored;
        # a batch that splits into part sequences over sites named each site's share
        (["--gpus", "8", "--tokens-per-step", "0"], "--tokens-per-step must be >= 1, got 0"),
        (["--gpus", "16", "--wan-gbps", "400"], "add --sites N"),
        (["--gpus", "8", "--plot", "nowhere/p.png"], "--plot: the directory nowhere does not"),
        (["--gpus", "16", "--wan-km", "100"], "add --sites N"),
        (
            ["--gpus", "16", "--sites", "2", "--wan-gbps", "9", "--tokens-per-step", str(2048)],
            "--tokens-per-step (2048) must be a multiple of --sites x model.seq_len (2 x 2048)",
        ),
    ],
)
def test_plan_errors_are_one_line(tmp_path, capsys, args, words):
    path = tmp_path / "small.yaml"
    path.write_text(parse.dump(_small()))
    assert _run(["--config", str(path), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and words in err and "\n" not in err


# -------------------------------------------------------------------- the config's own layout


def _plan(tmp_path, *extra, tokens=64 * 2048, gpu="h100"):
    """(the plan's result, its text) for the small model on 16 GPUs with `extra` overrides."""
    path = tmp_path / "small.yaml"
    path.write_text(parse.dump(_small()))
    argv = ["--config", str(path), "--gpus", "16", "--tokens-per-step", str(tokens)]
    args = plan._parser().parse_args([*argv, "--gpu", gpu, *extra])
    r = plan.plan(args)
    return r, plan.report(r, args)


def _own_line(text: str) -> list[str]:
    lines = text.splitlines()
    i = next(i for i, ln in enumerate(lines) if ln.startswith("your config: "))
    return lines[i : i + 2]


def test_own_layout_that_is_the_best_and_one_that_is_invalid(tmp_path):
    r, text = _plan(tmp_path)  # the config's mesh is one device: no layout of 16
    assert r["own"].rank is None and r["own"].time is None
    assert _own_line(text)[0].startswith(
        "your config: not a valid layout on 16 GPUs: mesh sizes {'data': 1,"
    )
    best = r["best"][0]
    r, text = _plan(tmp_path, *best.candidate.overrides().split())
    own = r["own"]
    assert (own.rank, own.note, own.time.total) == (1, "", r["best"][0].time.total)
    first, second = _own_line(text)
    assert first.startswith(f"your config: {best.candidate.short()}: #1 of the layouts that fit")
    assert second == "#1 is your config's layout: nothing to change"
    assert plan._own_json(own, r, r["base"])["best_changes"] == ""
    r, _ = _plan(tmp_path, *best.candidate.overrides().split(), tokens=128 * 2048)
    assert r["own"].rank is None and r["own"].note == (
        "not ranked: its batch is 131,072 tokens per step, the plan's 262,144"
    )


def test_own_layout_ranked_lower_says_what_the_best_changes(tmp_path):
    r, _ = _plan(tmp_path)
    best = r["best"][0].candidate
    other = "full" if best.remat != "full" else "selective"
    r, text = _plan(tmp_path, *best.overrides().split(), f"model.remat={other}")
    own, capacity = r["own"], r["acc"].memory
    faster = [e for e in r["evaluated"] if e.time.total < own.time.total]
    assert own.by_speed == len(faster) + 1 and own.note == ""
    assert own.rank == 1 + sum(e.memory <= capacity for e in faster) > 1
    j = plan._own_json(own, r, r["base"])
    assert j["rank"] == own.rank and j["fits"] and j["best_changes"] == f"model.remat={best.remat}"
    gain = r["best"][0].time.tokens_per_s_per_gpu / own.time.tokens_per_s_per_gpu - 1
    assert j["gain"] == pytest.approx(gain) and gain > 0
    first, second = _own_line(text)
    assert f"#{own.rank} of the layouts that fit (#{own.by_speed} of " in first
    assert second.startswith(f"#1 changes model.remat={best.remat}: +")


def test_own_layout_that_does_not_fit(tmp_path, capsys):
    path = tmp_path / "small.yaml"
    path.write_text(parse.dump(_small()))
    argv = ["--config", str(path), "--gpus", "16", "--tokens-per-step", str(16 * 32 * 2048)]
    layout = ["mesh.data=16", "train.micro_batch_size=32", "train.grad_accum=1", "model.remat=none"]
    assert _run([*argv, "--gpu", "a100-40gb", "--json", *layout]) == 0
    r = json.loads(capsys.readouterr().out)
    own = r["own"]
    assert own["layout"] == "dp16 mbs32 ga1 remat=none" and not own["fits"]
    assert own["memory_bytes"] > r["device_memory"] and own["rank"] is None
    assert own["note"].startswith("does not fit, ") and own["rank_by_speed"] >= 1
    assert own["best_changes"] and "mesh.data=16" not in own["best_changes"]
    assert _run([*argv, "--gpu", "a100-40gb", *layout]) == 0
    first, second = _own_line(capsys.readouterr().out)
    assert "does not fit" in first and second.startswith("#1 changes ")


def test_table_columns_name_what_they_measure():
    """The step's part "data" is data-parallel communication, not data loading."""
    assert "mem GiB" in plan.HEADER and "share of the step" in plan.HEADER
    t = steptime.StepTime(
        compute=8.0, host=0.0, tensor=0.0, pipeline_sends=0.0, context=0.0, bubble=0.0,
        data=1.5, optimizer=0.0, tokens_per_device=1.0, overhead=0.5,
    )  # fmt: skip
    assert plan._where(t) == "compute 80%, DP comm 15%, step overhead 5%"
    assert set(plan.PARTS) == set(t.parts())
    labels = [label for label, _ in plan.PARTS.values()]
    assert len(set(labels)) == len(labels) and "data" not in labels
    best = candidates.Evaluated(candidates.Candidate(8, 1, 1, 1, 1, 0, 1, 1, "none"), t)
    assert "    DP comm: data-parallel / ZeRO gradient reduction" in "\n".join(plan._legend([best]))


def test_a_candidate_resolves_loss_chunk_auto_on_its_own_mesh():
    """The same layout gets the same chunk, and so the same memory, whatever layout the
    config had: auto is re-resolved per candidate (a 4-way tensor split quarters the
    logits: 1024-token chunks, where the config's one device chose 256); an explicit
    chunk stays."""
    big = ["model.vocab_size=128256", "model.seq_len=2048", "train.micro_batch_size=8"]
    layout = candidates.Candidate(
        data=1, fsdp=2, tensor=4, pipeline=1, sequence=1, zero=1, micro_batch=8, accum=1,
        remat="none",
    )  # fmt: skip
    seen = set()
    for mesh in (["mesh.data=1"], ["mesh.data=2"], ["mesh.fsdp=8", "mesh.data=1"]):
        base = parse.load(None, [*big, *mesh])
        seen.add(layout.config(base).model.loss_chunk)
    assert seen == {1024}
    explicit = parse.load(None, [*big, "mesh.data=1", "model.loss_chunk=128"])
    assert layout.config(explicit).model.loss_chunk == 128
