"""`python -m ultrajax.train` as a user runs it: a short end-to-end run, --print-config, and
bad input."""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import harness
import pytest

from ultrajax.config import parse, validate
from ultrajax.train import optim

ROOT = Path(__file__).resolve().parent.parent
TINY = "configs/tiny.yaml"
FIELDS = (
    "step",
    "time",
    "tokens",
    "loss",
    "grad_norm",
    "lr",
    "tokens_per_s",
    "step_time_s",
    "mfu",
    "hfu",
)
SMALL = [
    "train.steps=12",
    "train.log_every=4",
    "train.eval_every=6",
    "train.eval_batches=2",
    "train.micro_batch_size=4",
    "train.grad_accum=2",
    "model.n_layers=2",
    "model.seq_len=64",
    "optim.warmup_steps=2",
]


def _env():
    return harness.child_env()


def _train(*args, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "ultrajax.train", *args],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# --------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    started = time.time()
    proc = _train("--config", TINY, *SMALL, f"train.run_dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc.started, proc.ended = started, time.time()
    return proc, run_dir


@pytest.mark.slow
def test_run_exits_cleanly_and_prints_a_summary(run):
    proc, _ = run
    assert "Traceback" not in proc.stderr
    assert "summary:" in proc.stdout
    assert "tokens/s" in proc.stdout and "MFU" in proc.stdout
    assert "parameters" in proc.stdout


@pytest.mark.slow
def test_metrics_jsonl_has_every_field_finite(run):
    _, run_dir = run
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    # logged at step 1, every 4 steps and the last; evaluated every 6 steps and the last
    assert [r["step"] for r in records] == [1, 4, 6, 8, 12]
    assert [r["step"] for r in records if "eval_loss" in r] == [6, 12]
    for r in records:
        for key in FIELDS:
            assert key in r, (key, r)
            assert isinstance(r[key], (int, float)) and math.isfinite(r[key]), (key, r)
        if "eval_loss" in r:
            assert math.isfinite(r["eval_loss"]) and r["eval_loss"] > 0
        assert r["loss"] > 0 and r["grad_norm"] > 0
        assert r["tokens_per_s"] > 0 and r["step_time_s"] > 0
        assert 0 < r["mfu"] <= r["hfu"]
        # tokens per step = 4 micro x 2 accum x 64 seq
        assert r["tokens_per_s"] * r["step_time_s"] == pytest.approx(4 * 2 * 64, rel=1e-6)
    assert records[-1]["loss"] < records[0]["loss"]


@pytest.mark.slow
def test_metrics_records_carry_wall_clock_time_and_tokens_so_far(run):
    proc, run_dir = run
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["tokens"] for r in records] == [r["step"] * 4 * 2 * 64 for r in records]
    assert all(isinstance(r["tokens"], int) for r in records)
    times = [r["time"] for r in records]
    assert all(isinstance(t, float) for t in times)
    assert proc.started < times[0] and times == sorted(times) and times[-1] < proc.ended
    # the clock runs at least as long as the steps logged in between (evaluation adds to it)
    for a, b in zip(records, records[1:], strict=False):
        steps_between = (b["step"] - a["step"]) * b["step_time_s"]
        assert b["time"] - a["time"] >= 0.99 * steps_between - 1e-3, (a, b)


@pytest.mark.slow
def test_config_yaml_is_the_resolved_config_and_lr_follows_its_schedule(run):
    _, run_dir = run
    cfg = parse.load(run_dir / "config.yaml")
    assert cfg.train.steps == 12 and cfg.model.n_layers == 2 and cfg.model.seq_len == 64
    assert cfg.train.run_dir == str(run_dir)
    schedule = optim.lr_schedule(cfg)
    for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()):
        # the lr logged at step s is the one step s used (the schedule at s - 1)
        assert r["lr"] == pytest.approx(float(schedule(r["step"] - 1)), rel=1e-5, abs=1e-12)


# --------------------------------------------------------------------------- run directories


@pytest.mark.slow
def test_the_readme_command_reruns_with_a_changed_shape(tmp_path):
    """No train.run_dir: each config gets its own directory under ./runs, so changing the
    shape and rerunning trains (it used to fail on the first run's checkpoint), and
    rerunning the finished command says what to do instead of silently nothing."""
    quick = ["train.steps=2", "train.eval_batches=0", "model.n_layers=1", "model.seq_len=32",
             "optim.warmup_steps=1", "train.micro_batch_size=2", "train.grad_accum=1"]  # fmt: skip
    cmd = [sys.executable, "-m", "ultrajax.train", "--config", str(ROOT / TINY), *quick]

    def start(*extra):
        return subprocess.Popen([*cmd, *extra], cwd=tmp_path, env=_env(), text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip

    first, changed = start(), start("model.d_model=64")
    for proc in (first, changed):
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
    dirs = sorted(p.name for p in (tmp_path / "runs").iterdir())
    assert len(dirs) == 2 and all(d.startswith("tiny-") for d in dirs), dirs
    for d in dirs:
        assert (tmp_path / "runs" / d / "checkpoints" / "2").is_dir()
    again = start()
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0, err[-2000:]
    assert "train.steps=2 is reached, nothing to train" in out
    assert "train.reschedule=true" in out and "train.run_dir=..." in out
    # a longer run of the same is refused, not silent: test_checkpoint.py, in-process


# a run stopped half-way through its 4-step schedule, on one device under mesh.data=-1 (as
# the 8B recipe), so that the same command on more devices makes a larger global batch;
# data.streams fixed, so that only the batch differs, whichever default the data takes
HALF = ["train.eval_batches=0", "model.n_layers=1", "model.seq_len=32", "train.log_every=1",
        "optim.warmup_steps=1", "optim.schedule_steps=4", "train.micro_batch_size=2",
        "train.grad_accum=2", "mesh.data=-1", "data.streams=2"]  # fmt: skip


@pytest.fixture(scope="module")
def half_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("half")
    proc = _train("--config", TINY, "--cpu-devices", "1", *HALF, "train.steps=2",
                  f"train.run_dir={run_dir}")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


def _snapshot(run_dir: Path) -> dict:
    """Every file of a run directory with its modification time and contents."""
    return {
        str(p.relative_to(run_dir)): (p.stat().st_mtime_ns, p.read_bytes())
        for p in sorted(run_dir.rglob("*"))
        if p.is_file()
    }


def test_a_finished_run_on_more_devices_trains_nothing_writes_nothing(half_run, tmp_path):
    """train.steps reached: on 2 devices the global batch doubles, and the run used to go on
    (its token budget and learning-rate position counted in the new batch). It stays
    finished: one line, exit 0, the run directory exactly as it was."""
    run_dir = tmp_path / "run"
    shutil.copytree(half_run, run_dir)
    before = _snapshot(run_dir)
    proc = _train("--config", TINY, "--cpu-devices", "2", *HALF, "train.steps=2",
                  f"train.run_dir={run_dir}")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == [
        f"{run_dir / 'checkpoints'} is at step 2: train.steps=2 is reached, nothing to train. "
        "To train longer, raise train.steps (with train.reschedule=true, or "
        "optim.schedule_steps=4 to keep the schedule); to start over, give "
        f"train.run_dir=... or delete {run_dir}"
    ]
    assert "compiled" not in proc.stdout and "Traceback" not in proc.stderr
    assert _snapshot(run_dir) == before


def test_a_changed_global_batch_mid_run_is_refused_the_same_continues(half_run, tmp_path):
    """Steps 3-4 on 2 devices: 8 sequences a step instead of 4 is refused in one line naming
    the settings that keep 4 (not the run's identity), with nothing written; one of them
    continues, and the learning rate is the schedule's at the step (it used to restart the
    warm-up: the position was counted in the new batch)."""
    run_dir = tmp_path / "run"
    shutil.copytree(half_run, run_dir)
    before = _snapshot(run_dir)
    cmd = ["--config", TINY, "--cpu-devices", "2", *HALF, "train.steps=4",
           f"train.run_dir={run_dir}"]  # fmt: skip
    proc = _train(*cmd)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert f"{run_dir / 'checkpoints' / '2'} trained with a global batch of 4 sequences" in lines[0]
    assert "would use 8 (2 micro-batch x 2 accum x 2 dp" in lines[0]
    assert "Keep 4 with train.grad_accum=1 or train.micro_batch_size=1" in lines[0]
    assert _snapshot(run_dir) == before

    proc = _train(*cmd, "train.micro_batch_size=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["tokens"] for r in records] == [128, 256, 384, 512]
    schedule = optim.lr_schedule(parse.load(ROOT / TINY, [*HALF, "train.steps=4"]))
    for r in records:  # the lr logged at step s is the schedule's at s - 1
        assert r["lr"] == pytest.approx(float(schedule(r["step"] - 1)), rel=1e-5)


# --------------------------------------------------------------------------- Ctrl-C


@pytest.mark.parametrize(
    "signum, code, said",
    [
        (signal.SIGINT, 130, "interrupted before the first step"),
        (signal.SIGTERM, 143, "stopped by SIGTERM before the first step"),
    ],
)
def test_ctrl_c_while_compiling_exits_130_and_saves_nothing(tmp_path, signum, code, said):
    """Ctrl-C before the first step (here while XLA compiles the step): one line on stderr,
    status 130, no checkpoint. A KeyboardInterrupt there left the compile running on XLA's
    own thread under the interpreter's exit: a segmentation fault in most tries. SIGTERM
    the same, with status 143 (it ended the process without a word)."""
    env = _env()
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # a real compile, not the session's cache
    env["PYTHONUNBUFFERED"] = "1"  # each line as it is printed
    quick = ["train.steps=3", "optim.warmup_steps=1", "train.eval_batches=0"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "ultrajax.train", "--config", TINY, *quick,
         f"train.run_dir={tmp_path}"],
        cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True,
    )  # fmt: skip
    out = ""
    for line in proc.stdout:  # said as the step's compile begins
        out += line
        if line.startswith("compiling the step ..."):
            os.killpg(proc.pid, signum)  # as a terminal sends Ctrl-C, or a scheduler
            break
    rest, err = proc.communicate(timeout=300)
    out += rest
    assert proc.returncode == code, err[-3000:]
    assert "compiled the step" not in out  # it came during the compile
    assert "Traceback" not in err and "Fatal Python error" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[-1:] == [f"{said}: nothing was trained yet, nothing saved"]
    ck_dir = tmp_path / "checkpoints"
    assert not ck_dir.exists() or not any(ck_dir.iterdir())
    assert not (tmp_path / "metrics.jsonl").exists()


# --------------------------------------------------------------------------- --print-config


def test_print_config_prints_the_resolved_config_and_batch_then_exits(tmp_path):
    run_dir = tmp_path / "never"
    overrides = ["train.steps=7", "optim.warmup_steps=2", f"train.run_dir={run_dir}"]
    looks = {  # mesh.data=-1 is filled from the 8 devices; without --cpu-devices: 1 CPU
        "eight": ["--cpu-devices", "8", "mesh.data=-1", "--print-config", *overrides],
        "here": ["--print-config", "mesh.fsdp=2", *overrides],
    }
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "ultrajax.train", "--config", TINY, *args],
            cwd=ROOT,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, args in looks.items()
    }
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr
        assert "Traceback" not in stderr and "compiled" not in stdout
        out[name] = stdout
    assert not run_dir.exists()  # nothing trained, nothing written

    # the output is a config file: the resolved config, mesh fill included
    (tmp_path / "printed.yaml").write_text(out["eight"])
    printed = parse.load(tmp_path / "printed.yaml")
    want = parse.load(ROOT / TINY, ["mesh.data=-1", *overrides])
    validate.resolve_mesh(want, 8)
    assert parse.to_dict(printed) == parse.to_dict(want)
    assert printed.mesh.data == 8 and printed.train.steps == 7
    derived = [line for line in out["eight"].splitlines() if line.startswith("# ")]
    # tiny: 8 micro x 2 accum, seq 256
    assert derived[1:] == [
        "# global batch: 128 sequences = 8 micro-batch x 2 grad accumulation x 8 dp",
        "# tokens per step: 32,768 = 128 sequences x 256 seq_len",
        "# dp: 8 = data 8 x fsdp 1",
        "# mesh: data=8 fsdp=1 pipeline=1 expert=1 sequence=1 tensor=1 (8 devices)",
        "# devices: 8 (cpu, --cpu-devices)",
    ]
    # a mesh for another machine is shown, and the mismatch said, not refused
    assert (
        "# global batch: 32 sequences = 8 micro-batch x 2 grad accumulation x 2 dp"
        in out["here"].splitlines()
    )
    assert "# devices: 1 (cpu); this mesh needs 2" in out["here"].splitlines()


# --------------------------------------------------------------------------- bad input

BAD = {
    "unknown-key": (["--config", TINY, "train.stepz=5"], "train.steps"),
    "wrong-type": (["--config", TINY, "train.steps=abc"], "train.steps"),
    "missing-config": (["--config", "configs/no_such_file.yaml"], "no_such_file.yaml"),
    "d_model-n_heads": (["--config", TINY, "model.d_model=100", "model.n_heads=3"], "n_heads"),
    "missing-data-path": (
        ["--config", TINY, "data.source=files", "data.path=/nonexistent/corpus.txt"],
        "/nonexistent/corpus.txt",
    ),
    # errors that say what to do (issue 13)
    "no-config": ([], "usage: ultrajax.train"),
    "odd-head-dim": (["--config", TINY, "model.d_model=100", "model.n_heads=4"], "head_dim"),
    "path-without-files": (["--config", TINY, "data.path=corpus.txt"], "data.source=files"),
    "mesh-fill": (["--config", TINY, "mesh.data=-1", "mesh.tensor=8"], "--cpu-devices 8"),
    # a directory that cannot be made: a traceback once the model was built
    "dir-is-a-file": (["--config", TINY, f"checkpoint.dir={TINY}"], "is a file, not a directory"),
    "dir-unmakeable": (["--config", TINY, f"checkpoint.dir={TINY}/ck"], "cannot make the"),
}


# As processes: the most common mistake, end to end, and those whose check comes after
# the mesh's (one CPU device; the test process has 8, which tiny.yaml's mesh of 1 does
# not fit). The others run the command's own code in this process (cli.run around
# tools/train.main): the same exit status and stderr, without 2.5 s of start-up each.
IN_A_PROCESS = ("unknown-key", "mesh-fill", "missing-data-path")


@pytest.fixture(scope="module")
def bad_runs(tmp_path_factory):
    """Start the bad-input processes at once (each is mostly interpreter start-up)."""
    run_dir = tmp_path_factory.mktemp("bad")
    procs = {
        name: subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ultrajax.train",
                *BAD[name][0],
                f"train.run_dir={run_dir / name}",
            ],
            cwd=ROOT,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in IN_A_PROCESS
    }
    results = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        results[name] = (proc.returncode, out, err, run_dir / name)
    return results


def _in_this_process(args: list[str], run_dir: Path, capsys) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `python -m ultrajax.train ARGS` run here; the
    environment it changes (XLA_FLAGS, the working directory) is put back."""
    from ultrajax import cli
    from ultrajax.tools import train as command

    capsys.readouterr()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
        mp.chdir(ROOT)
        with pytest.raises(SystemExit) as exited:
            cli.run(lambda: command.main([*args, f"train.run_dir={run_dir}"]))
    out, err = capsys.readouterr()
    return exited.value.code, out, err


@pytest.mark.slow
@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_exits_2_with_one_line(bad_runs, name, tmp_path, capsys):
    if name in IN_A_PROCESS:
        code, _, err, run_dir = bad_runs[name]
    else:
        run_dir = tmp_path / name
        code, _, err = _in_this_process(BAD[name][0], run_dir, capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert "Traceback" not in err
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and len(lines[0]) > len("error: ")
    assert BAD[name][1] in lines[0]
    assert not (run_dir / "metrics.jsonl").exists()


def test_a_run_that_fails_closes_its_bar_data_and_metrics_first(tmp_path, monkeypatch, capsys):
    """A save failing at step 4 (a full disk): the progress bar was redrawn after the
    error line (by the interpreter's teardown), and the data threads and the metrics
    file were left to it. They are closed where the run stops, by any path."""
    from ultrajax.train import checkpoint, loop

    def fails(self, step, state, data_state):
        raise checkpoint.SaveFailed(f"could not save step {step}")

    closed = []
    monkeypatch.setattr(checkpoint.Checkpoints, "save", fails)
    monkeypatch.setattr(loop.Training, "close", lambda self: closed.append(self.step))
    saves = ["checkpoint.every=4", f"train.run_dir={tmp_path}", "mesh.data=-1"]
    cfg = parse.load(TINY, [*SMALL, *saves])
    with pytest.raises(checkpoint.SaveFailed, match="could not save step 4"):
        loop.train(cfg)
    assert closed == [4]


def test_a_step_is_in_metrics_before_its_save_and_a_diverged_step_is_not_saved(
    tmp_path, monkeypatch
):
    """The save started before the step's evaluation and line: a run killed once the save
    was whole lost the line for good (the resume starts after it). And a loss gone to
    inf at a save step was saved before the run stopped on it, so the run resumed there."""
    from ultrajax.train import checkpoint, loop

    saved, real = {}, checkpoint.Checkpoints.save

    def save(self, step, state, data_state):
        lines = (self.dir.parent / "metrics.jsonl").read_text().splitlines()
        saved[step] = [(r["step"], "eval_loss" in r) for r in map(json.loads, lines)]
        return real(self, step, state, data_state)

    monkeypatch.setattr(checkpoint.Checkpoints, "save", save)
    common = [*SMALL, "mesh.data=-1", "checkpoint.every=6"]
    assert loop.train(parse.load(TINY, [*common, f"train.run_dir={tmp_path / 'a'}"])) == 0
    assert sorted(saved) == [6, 12]
    assert saved[6][-1] == (6, True) and saved[12][-1] == (12, True)

    saved.clear()  # a learning rate that overflows the weights: every step saved, few logged
    wild = ["optim.lr=1e30", "optim.warmup_steps=0", "checkpoint.every=1", "train.eval_every=50"]
    cfg = parse.load(TINY, [*common, *wild, "train.log_every=50", f"train.run_dir={tmp_path}"])
    with pytest.raises(loop.Diverged, match=r"loss is (nan|inf) at step (\d+)") as e:
        loop.train(cfg)
    last = int(str(e.value).split(" at step ")[1].split(";")[0])
    assert 1 < last < 12 and sorted(saved) == list(range(1, last))  # stopped where it went


def test_a_profile_window_a_run_resumes_or_ends_inside_is_written(tmp_path, capsys):
    """A run resumed inside train.profile_steps crashed at the stop of a trace it never
    started (losing the steps since its last save), and one whose ramp reached its token
    budget inside the window left the trace unwritten, without a word."""
    from ultrajax.train import loop

    quick = ["optim.warmup_steps=1", "train.eval_batches=0", "train.micro_batch_size=2",
             "train.grad_accum=1", "model.n_layers=1", "model.seq_len=64",
             "mesh.data=-1"]  # fmt: skip
    run = tmp_path / "resumed"
    cfg = parse.load(TINY, [*quick, "train.steps=3", "optim.schedule_steps=8",
                            f"train.run_dir={run}"])  # fmt: skip
    assert loop.train(cfg) == 0
    cfg = parse.load(TINY, [*quick, "train.steps=8", "optim.schedule_steps=8",
                            "train.profile_steps=[2, 5]", f"train.run_dir={run}"])  # fmt: skip
    capsys.readouterr()
    assert loop.train(cfg) == 0
    assert (f"profile of steps 3..5 written to {run}/profile (train.profile_steps=[2, 5]: "
            "the run resumed inside it)") in capsys.readouterr().out  # fmt: skip
    assert (run / "memory.prof").is_file() and any((run / "profile").rglob("*.xplane.pb"))
    ramp = tmp_path / "ramp"  # 4 steps of 1024 tokens, then 2048: the budget ends at step 6
    stages = "[{tokens_per_step: 2048, from_tokens: 4096}]"
    cfg = parse.load(TINY, [*quick, "train.steps=8", f"train.batch_schedule={stages}",
                            "train.profile_steps=[4, 7]", f"train.run_dir={ramp}"])  # fmt: skip
    assert loop.train(cfg) == 0
    out = capsys.readouterr().out
    assert "(train.profile_steps=[4, 7]: the run ended inside it)" in out, out
    assert (ramp / "memory.prof").is_file() and any((ramp / "profile").rglob("*.xplane.pb"))


def test_a_loss_that_is_not_finite_ends_the_run_with_status_1(monkeypatch, capsys):
    """The loop stops at the first logged step whose loss is not finite (Diverged); the
    command turns that into one line and exit status 1, like a failed run."""
    from types import SimpleNamespace

    from ultrajax.tools import train as command
    from ultrajax.train import loop

    fake = SimpleNamespace(lead=True, step=7)
    with pytest.raises(loop.Diverged, match="loss is nan at step 7; lower optim.lr"):
        loop.Training.check(fake, {"loss": float("nan")})

    def diverge(cfg):
        raise loop.Diverged("loss is inf at step 3; lower optim.lr")

    monkeypatch.setattr(command, "train", diverge)
    monkeypatch.setattr(command.overlap, "apply", lambda parallel: None)
    monkeypatch.setattr(command.cli, "setup_devices", lambda args: None)
    with pytest.raises(SystemExit) as e:
        command.main(["--config", str(ROOT / TINY)])
    assert e.value.code == 1
    assert capsys.readouterr().err == "error: loss is inf at step 3; lower optim.lr\n"
