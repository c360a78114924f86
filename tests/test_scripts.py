"""The benchmark scripts still run (they build the step as the trainer does, so a change of
its signature breaks them first): one tiny size, one step, a table printed."""

import os
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))


@pytest.mark.slow
def test_bench_step_prints_its_table(capsys):
    import bench_step

    tiny = ["model.n_layers=1", "model.seq_len=32", "train.micro_batch_size=1"]
    args = ["--sizes", "tiny", "--steps", "1", "--warmup", "0", "--docs", "3"]
    assert bench_step.main([*args, *tiny, "data.cross_doc_mask=true"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| tiny |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2].endswith("3 docs a row"), cells[2]  # packed rows, as --docs asked
    assert float(cells[5].replace(",", "")) > 0  # tokens/s


def test_bench_cpu_attention_prints_each_backend_beside_xla(capsys):
    import bench_cpu_attention

    shape = ["--batch", "2", "--seq", "16", "--heads", "2", "--kv-heads", "1", "--head-dim", "8"]
    assert bench_cpu_attention.main([*shape, "--iters", "1"]) == 0
    rows = {
        cells[0]: cells
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("| ") and not line.startswith("| backend")
        for cells in [[c.strip() for c in line.strip("|").split("|")]]
    }
    for name in ("xla", "blocked", "tiled"):
        assert float(rows[name][1]) > 0  # ms
        assert float(rows[name][3]) < 1e-5  # the same attention as xla's, fp32


def _kept_run(run, args, records):
    """A run directory as a finished run leaves it: its metrics and the config `args` (a
    train command's) resolve to, which tiny_runs checks before it reads the run."""
    import json

    from ultrajax import cli
    from ultrajax.config import parse

    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    asked = cli.parser("ultrajax.train", "").parse_args(args)
    (run / "config.yaml").write_text(parse.dump(parse.load(ROOT / asked.config, asked.overrides)))


def test_diloco_tiny_reads_its_runs_and_compares_them_with_data_parallelism(tmp_path, capsys):
    """scripts/diloco_tiny.py reads a run it already has (never trains it again) and
    prints each final eval loss against data parallelism's."""

    import diloco_tiny
    import tiny_runs

    for i, (name, extra) in enumerate(diloco_tiny.RUNS.items()):
        run = tiny_runs.run_dir(tmp_path, name)
        lines = [{"step": 100, "eval_loss": 2.0 + i}, {"step": 200, "eval_loss": 1.5 + i / 10}]
        _kept_run(run, [*diloco_tiny.COMMON, *extra], lines)
    dirs = {tiny_runs.run_dir(tmp_path, n) for n in diloco_tiny.RUNS}
    assert len(dirs) == len(diloco_tiny.RUNS)
    assert diloco_tiny.main(["--runs", str(tmp_path)]) == 0
    rows = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| H=4, outer")]
    assert rows == ["| H=4, outer 0.7 / Nesterov 0.9 | 1.6000 (step 200) | +6.7% |"]


def test_fp8_tiny_says_whether_each_recipe_is_within_its_bound(tmp_path, capsys, monkeypatch):
    """scripts/fp8_tiny.py reads its runs and says, per recipe, whether the final eval
    loss is within 1.5% of bf16's, either way (a fourth recipe stands in for lower)."""

    import fp8_tiny
    import tiny_runs

    finals = {"bf16": 2.0, "fp8 tensorwise": 2.02, "fp8 rowwise": 2.04, "fp8 delayed": 1.96}
    monkeypatch.setitem(fp8_tiny.RUNS, "fp8 delayed", ["model.fp8=delayed"])
    for name, loss in finals.items():
        run = tiny_runs.run_dir(tmp_path, name)
        _kept_run(run, [*fp8_tiny.COMMON, *fp8_tiny.RUNS[name]], [{"step": 300, "eval_loss": loss}])
    assert fp8_tiny.main(["--runs", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "fp8 tensorwise: +1.00% of bf16's final eval loss, within ±1.5%" in out
    assert "fp8 rowwise: +2.00% of bf16's final eval loss, NOT within ±1.5%" in out
    assert "fp8 delayed: -2.00% of bf16's final eval loss, NOT within ±1.5%" in out


def test_fp8_tiny_over_seeds_says_each_recipes_mean_gap(tmp_path, capsys):
    """--seeds: each seed's runs in their own directory, each seed's gaps, then each
    recipe's mean gap over the seeds and their range."""

    import fp8_tiny
    import tiny_runs

    finals = {0: {"bf16": 2.0, "fp8 tensorwise": 2.04}, 1: {"bf16": 2.0, "fp8 tensorwise": 1.98}}
    table = {"bf16": [], "fp8 tensorwise": ["model.fp8=tensorwise"]}
    for seed, runs in finals.items():
        for name, loss in runs.items():
            run = tiny_runs.run_dir(tmp_path / f"seed-{seed}", name)
            args = [*fp8_tiny.COMMON, *table[name], *([f"train.seed={seed}"] if seed else [])]
            _kept_run(run, args, [{"step": 300, "eval_loss": loss}])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fp8_tiny, "RUNS", table)
        assert fp8_tiny.main(["--runs", str(tmp_path), "--seeds", "0,1"]) == 0
        out = capsys.readouterr().out
        # seed 0's runs where seed 1's are asked for: refused, not read as seed 1's (they were)
        for name in table:
            shutil.copytree(tiny_runs.run_dir(tmp_path / "seed-0", name),
                            tiny_runs.run_dir(tmp_path / "wrong" / "seed-1", name))  # fmt: skip
        with pytest.raises(SystemExit, match="holds a run of other settings"):
            fp8_tiny.main(["--runs", str(tmp_path / "wrong"), "--seeds", "1"])
    assert "seed 0: fp8 tensorwise: +2.00% of bf16's final eval loss, NOT within ±1.5%" in out
    assert "seed 1: fp8 tensorwise: -1.00% of bf16's final eval loss, within ±1.5%" in out
    assert "fp8 tensorwise over seeds 0,1: mean +0.50% (-1.00% to +2.00%), within ±1.5%" in out


def test_check_flash_gpu_holds_each_backward_to_the_reference_interpreted(capsys):
    """scripts/check_flash_gpu.py's own check off a GPU (--interpret: one small packed
    case, the kernel interpreted): a line for each backward, split and fused, every error
    (out, lse, dq, dk, dv) at fp32 rounding: within 1e-5 of the largest magnitude, the
    bound tests/test_kernels.py holds fp32 gradients to (sums over 100 keys)."""
    import check_flash_gpu

    assert check_flash_gpu.main(["--interpret"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("ok")]
    assert [ln.split(":")[0].split()[-1] for ln in lines] == ["split", "fused"], lines
    for line in lines:
        errors = dict(zip(*[iter(line.split(":")[1].split())] * 2, strict=True))
        assert set(errors) == {"out", "lse", "dq", "dk", "dv"}
        assert all(float(e) < 1e-5 for e in errors.values()), line


def test_bench_attention_prints_a_row_per_backward_with_stand_ins_off_a_gpu(capsys, monkeypatch):
    """scripts/bench_attention.py's GPU paths run here with stand-ins (the kernel
    interpreted, XLA's attention for cuDNN's), so a GPU call finds no plumbing error: a row
    per backward, split and fused, and the split one on the grid's order before, each the
    stand-in's attention to bf16 rounding, and the one-kernel backward's sweep."""
    import functools

    import bench_attention
    import jax

    from ultrajax.kernels import flash_attention as fa

    real_attention = jax.nn.dot_product_attention
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(
        fa, "flash_attention", functools.partial(fa.flash_attention, interpret=True)
    )
    monkeypatch.setattr(jax.nn, "dot_product_attention",
                        lambda *a, implementation=None, **kw: real_attention(*a, **kw))  # fmt: skip
    tiny = ["--seqs", "128", "--tokens", "128", "--heads", "2", "--kv-heads", "1", "--iters", "1"]
    assert bench_attention.main([*tiny, "--heads-first"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 128,64")]
    assert [r.split("|")[1].split()[1:] for r in rows] == [["split"], ["fused"],
                                                            ["split", "heads-first"]]  # fmt: skip
    for r in rows:
        cells = [c.strip() for c in r.strip("|").split("|")]
        assert float(cells[5]) > 0 and float(cells[8]) < 0.1 and float(cells[9]) < 0.1, r
    monkeypatch.setattr(bench_attention, "BWD_SWEEP", ((128, 64, 4, 2),))
    assert bench_attention.main([*tiny, "--sweep", "bwd", "--fused"]) == 0
    (row,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| bwd")]
    assert "128,64,4,2 fused" in row and "failed" not in row


def test_profile_step_reads_a_gpu_trace_off_the_device_streams():
    """On a GPU trace the kernels on the device's streams count, each named by the HLO
    instruction in its "hlo_op" stat (a cuBLAS kernel's own name says nothing of which dot
    it is); the host's launch threads and the derived views count for nothing. On a CPU
    trace (no device plane) nested events count by self time."""
    from types import SimpleNamespace as NS

    import profile_step

    def event(name, start, duration, **stats):
        return NS(name=name, start_ns=start, end_ns=start + duration, duration_ns=duration,
                  stats=list(stats.items()))  # fmt: skip

    stream = NS(name="Stream #7", events=[
        event("sm90_xmma_gemm_bf16", 0, 50, hlo_op="custom-call.3"),
        event("loop_fusion", 60, 20, hlo_op="fusion.12"),
        event("sm90_xmma_gemm_bf16", 90, 30, hlo_op="custom-call.3"),
        event("memcpy", 130, 5),  # no instruction: not counted
    ])  # fmt: skip
    derived = NS(name="XLA Ops", events=[event("custom-call.3", 0, 50, hlo_op="custom-call.3")])
    host = NS(name="/host:CPU", lines=[NS(name="launch", events=[event("fusion.12", 0, 999)])])
    gpu = NS(name="/device:GPU:0", lines=[stream, derived])
    totals = {}
    for name, ns in profile_step.op_times([host, gpu]):
        totals[name] = totals.get(name, 0) + ns
    assert totals == {"custom-call.3": 80, "fusion.12": 20}
    thread = NS(name="tf_XLAEigen", events=[event("while.1", 0, 100), event("dot.2", 10, 60)])
    cpu = dict(profile_step.op_times([NS(name="/host:CPU", lines=[thread])]))
    assert cpu == {"while.1": 40, "dot.2": 60}


def test_gpu_compile_without_jaxs_cuda_plugin_says_how_to_get_it(capsys, monkeypatch):
    """scripts/gpu_compile.py needs jax's CUDA plugin, never a dependency: without it, a
    one-line error that names it (exit 2). What it sets in the environment is undone."""
    import importlib.util

    import gpu_compile

    plugins = importlib.util.find_spec("jax_plugins")
    if plugins and importlib.util.find_spec("jax_plugins.xla_cuda12"):
        pytest.skip("jax's CUDA plugin is installed here")
    for name in ("XLA_FLAGS", "JAX_PLATFORMS", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK"):
        monkeypatch.setenv(name, os.environ.get(name, ""))
    with pytest.raises(SystemExit) as e:
        gpu_compile.main(["model.n_layers=1"])
    assert e.value.code == 2
    assert "jax's CUDA plugin" in capsys.readouterr().err


def test_step_table_reports_the_runs_asked_for_with_their_ratios(tmp_path):
    """scripts/step_table.py (bench_gpu.sh's table): each run asked for from its own file,
    ratios to torch.compile's tokens/s and memory, packed against causal; a run asked for
    whose file holds only the header is named as failed; a file of a run not asked for
    (an older call's) is never read."""
    import bench_step
    import step_table

    def ultrajax(name, tokens, mem):  # a run's file as bench_step.py writes its table
        row = {"model": "1b", "params": 1.2e9, "layout": "8x2048", "tokens_per_step": 16384,
               "step_ms": 1.0, "tokens_per_s": tokens, "peak": 989e12, "mfu": 0.4,
               "hfu": 0.4, "compile_s": 30.0, "memory": mem * 2**30,
               "mfu_causal": 0.38}  # fmt: skip
        (tmp_path / f"{name}.txt").write_text(bench_step.table([row]) + "\n")

    ultrajax("ultrajax-causal", 60000, 40.0)
    ultrajax("ultrajax-packed", 57000, 40.0)
    ultrajax("ultrajax-whole-logits", 1, 1.0)  # an older call's: not asked for
    (tmp_path / "ultrajax-selective.txt").write_text(bench_step.table([]) + "\n")  # failed
    (tmp_path / "hf-compiled.txt").write_text('{"tokens_per_s": 50000.0, "peak_gib": 50.0}\n')
    runs = "ultrajax-causal ultrajax-selective ultrajax-packed hf-compiled"
    lines = step_table.table(tmp_path, runs.split()).splitlines()
    rows = {ln.split("|")[1].strip(): [c.strip() for c in ln.split("|")[2:-1]]
            for ln in lines[2:] if ln.startswith("| ")}  # fmt: skip
    assert list(rows) == [step_table.LABELS[n] for n in runs.split()]
    causal = rows[step_table.LABELS["ultrajax-causal"]]
    assert causal == ["60,000", "40.0%", "38.0%", "40.0", "1.200x", "0.80x"]
    assert rows[step_table.LABELS["ultrajax-selective"]][0].startswith("failed or skipped")
    assert lines[-1] == "packed, one document a row / causal tokens/s: 95.0%"
