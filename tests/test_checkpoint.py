"""Checkpoints: exact resume through SIGTERM and Ctrl-C, the keep policy, restore onto another
layout, a save killed mid-write (and its leftovers removed), mismatched or corrupt checkpoints.

The runs go through `train.train` itself (in this process, 8 simulated devices).
Runs of one layout compile the same programs; the session's persistent compilation
cache (tests/conftest.py) compiles each once.
"""

import fnmatch
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from ultrajax.config import parse, validate
from ultrajax.config import schema as config
from ultrajax.config.schema import ConfigError
from ultrajax.data import loader as data_lib
from ultrajax.parallel import mesh as mesh_lib
from ultrajax.train import checkpoint, metrics, optim, report, resume
from ultrajax.train import loop as train
from ultrajax.train.ramp import Ramp
from ultrajax.train.step import init_state, state_shardings

pytestmark = pytest.mark.slow

TINY = Path(__file__).parents[1] / "configs" / "tiny.yaml"
SMALL = [
    "model.d_model=32",
    "model.n_layers=2",
    "model.n_heads=8",
    "model.n_kv_heads=4",
    "model.d_ff=64",
    "model.seq_len=32",
    "train.steps=20",
    "train.grad_accum=2",
    "train.log_every=1",
    "train.eval_batches=0",
    "optim.warmup_steps=2",
]
# the same global batch (8 sequences) under two layouts
LAYOUT_A = ["mesh.fsdp=4", "mesh.tensor=2", "parallel.zero=3", "train.micro_batch_size=1"]
LAYOUT_B = ["mesh.data=2", "mesh.tensor=4", "parallel.zero=1", "train.micro_batch_size=2"]
ONE_DEVICE = ["train.micro_batch_size=4"]


def load(run_dir, *extra) -> config.Config:
    return parse.load(TINY, SMALL + [f"train.run_dir={run_dir}", *extra])


def losses(run_dir) -> dict[int, float]:
    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").open()]
    steps = [r["step"] for r in records]
    assert len(steps) == len(set(steps)), f"a step was logged twice: {steps}"
    return {r["step"]: r["loss"] for r in records}


def steps(run_dir) -> list[int]:
    return checkpoint._steps(Path(run_dir) / "checkpoints")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """20 steps in one run under fsdp=4 x tensor=2, ZeRO-3, saving every 10 steps."""
    run_dir = tmp_path_factory.mktemp("reference")
    assert train.train(load(run_dir, *LAYOUT_A, "checkpoint.every=10")) == 0
    assert steps(run_dir) == [10, 20]
    return run_dir, losses(run_dir)


def test_sigterm_then_resume_gives_identical_losses(reference, tmp_path, monkeypatch):
    _, expected = reference
    write = metrics.MetricsWriter.write

    def write_then_sigterm(self, record):
        write(self, record)
        if record["step"] == 9:  # arrives during step 10: step 10 is saved, then the run stops
            signal.raise_signal(signal.SIGTERM)

    monkeypatch.setattr(metrics.MetricsWriter, "write", write_then_sigterm)
    ck_dir = tmp_path / "checkpoints"
    ck_dir.mkdir()
    (ck_dir / "notes.txt").write_text("not a checkpoint")
    extra = (*LAYOUT_A, "checkpoint.every=4", "checkpoint.keep=2")
    assert train.train(load(tmp_path, *extra)) == 143
    assert sorted(losses(tmp_path)) == list(range(1, 11))
    assert steps(tmp_path) == [8, 10]  # step 4 went by the keep policy
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the handler is put back
    monkeypatch.undo()

    assert train.train(load(tmp_path, *extra)) == 0  # checkpoint.resume=auto
    got = losses(tmp_path)  # metrics.jsonl appended, not truncated
    assert list(got) == list(range(1, 21))
    assert got == expected  # exactly: same state, same data position, same programs
    assert steps(tmp_path) == [16, 20]
    assert (ck_dir / "notes.txt").read_text() == "not a checkpoint"  # nothing else deleted
    # a finished run resumed again has nothing to do
    assert train.train(load(tmp_path, *extra)) == 0
    assert losses(tmp_path) == got


def test_ctrl_c_saves_then_resume_gives_identical_losses(reference, tmp_path, monkeypatch, capsys):
    _, expected = reference
    write = metrics.MetricsWriter.write

    def write_then_ctrl_c(self, record):
        write(self, record)
        if record["step"] == 6:  # arrives during step 7: step 7 is saved, then the run stops
            signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(metrics.MetricsWriter, "write", write_then_ctrl_c)
    before = signal.getsignal(signal.SIGINT)
    ck_dir = tmp_path / "checkpoints"
    try:
        code = train.train(load(tmp_path, *LAYOUT_A))
    except KeyboardInterrupt:  # not pytest's: a Ctrl-C the run did not handle fails here
        pytest.fail("Ctrl-C during the run was not handled: KeyboardInterrupt")
    assert code == 130
    out, err = capsys.readouterr()
    assert f"starting fresh at step 0: no checkpoint found in {ck_dir}" in out
    # what Ctrl-C says goes to stderr: seen also when stdout is a file or a pipe
    assert "Ctrl-C: saving step 7, then stopping (Ctrl-C again: quit now)" in err
    stopped = [line for line in err.splitlines() if line.startswith("stopped by")]
    assert stopped == [
        f"stopped by Ctrl-C after step 7: saved in {ck_dir / '7'}; "
        "run the same command again to resume"
    ]
    assert sorted(losses(tmp_path)) == list(range(1, 8))
    assert steps(tmp_path) == [7]
    assert signal.getsignal(signal.SIGINT) is before  # the handlers are put back
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    monkeypatch.undo()

    # a save killed earlier left its temporary directory: the next start removes it
    (ck_dir / "8.orbax-checkpoint-tmp-1764150000000" / "params").mkdir(parents=True)
    assert train.train(load(tmp_path, *LAYOUT_A)) == 0
    out = capsys.readouterr().out
    assert (
        f"removed 1 unfinished save(s) left by a killed run in {ck_dir}: "
        "8.orbax-checkpoint-tmp-1764150000000"
    ) in out
    assert f"resumed from {ck_dir / '7'} at step 7" in out and "starting fresh" not in out
    assert f"restoring {ck_dir / '7'}\n" in out.split("resumed from")[0]  # said first
    assert losses(tmp_path) == expected  # exactly, as after SIGTERM
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    assert [r["tokens"] for r in records] == [r["step"] * 8 * 32 for r in records]  # 8 x seq 32
    times = [r["time"] for r in records]
    assert times == sorted(times)  # wall clock: the resumed run's records come after
    assert sorted(p.name for p in ck_dir.iterdir()) == ["20", "7"]


def test_ctrl_c_under_a_pipe_its_reader_closed_still_saves_the_step(tmp_path):
    """`train ... | tee log` and Ctrl-C: the terminal sends SIGINT to the whole process
    group, so tee is gone by the time the run writes its next line. The step is saved
    all the same, its record is written, and the run exits 130 with the messages on
    stderr (no BrokenPipeError, no failed last flush)."""
    cmd = [sys.executable, "-m", "ultrajax.train", "--config", str(TINY), *SMALL, *ONE_DEVICE,
           "train.steps=1000", f"train.run_dir={tmp_path}"]  # fmt: skip
    with open(tmp_path / "stderr", "w") as stderr:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True
        )
        try:
            for line in proc.stdout:  # the run is in the loop once a step is logged
                if line.startswith("step "):
                    break
            proc.stdout.close()  # the reader (tee) goes first...
            os.killpg(proc.pid, signal.SIGINT)  # ...then the Ctrl-C reaches the trainer
            code = proc.wait(timeout=300)
        finally:
            proc.kill()
    err = (tmp_path / "stderr").read_text()
    assert code == 130, err[-3000:]
    assert "Traceback" not in err and "Exception ignored" not in err, err[-3000:]
    (stopped,) = [line for line in err.splitlines() if line.startswith("stopped by Ctrl-C")]
    n = int(stopped.split("after step ")[1].split(":")[0])
    assert stopped == (
        f"stopped by Ctrl-C after step {n}: saved in {tmp_path / 'checkpoints' / str(n)}; "
        "run the same command again to resume"
    )
    assert f"Ctrl-C: saving step {n}, then stopping" in err
    assert 1 < n < 1000 and steps(tmp_path) == [n]
    assert sorted(losses(tmp_path)) == list(range(1, n + 1))


def test_a_second_ctrl_c_exits_at_once_while_the_save_is_written(tmp_path):
    script = tmp_path / "twice.py"
    script.write_text(textwrap.dedent(CTRL_C_TWICE))
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 130, proc.stderr[-2000:]
    assert time.monotonic() - t0 < 60  # not after the 600 s "save"
    assert "stopping" in proc.stdout and "not reached" not in proc.stdout
    assert "Ctrl-C again: exiting without waiting for the save in progress" in proc.stderr


CTRL_C_TWICE = """
import signal, sys, time
from pathlib import Path
from ultrajax.train import preemption

class SlowSave:  # a save that takes 10 minutes: the user presses Ctrl-C again meanwhile
    dir = Path(sys.argv[1])
    def wait(self):
        signal.raise_signal(signal.SIGINT)
        time.sleep(600)

with preemption.Preemption(SlowSave()) as preempted:
    signal.raise_signal(signal.SIGINT)  # the first: only a flag
    print("stopping" if preempted(1) else "not stopping", flush=True)
print("not reached")
"""


def test_leftover_tmp_folders_are_removed_at_start(tmp_path):
    ck_dir = tmp_path / "checkpoints"
    (ck_dir / "3.orbax-checkpoint-tmp-1764150000000" / "params").mkdir(parents=True)
    (ck_dir / "3.orbax-checkpoint-tmp-1764150000000" / "params" / "d").write_bytes(b"\0" * 64)
    (ck_dir / "5.orbax-checkpoint-tmp-1764150000001").mkdir()
    (ck_dir / "notes.txt").write_text("not a checkpoint")
    lines = []
    ck, state, start = resume.start(load(tmp_path), None, None, say=lines.append)
    ck.close()
    assert start == 0 and state is None
    assert lines == [
        f"removed 2 unfinished save(s) left by a killed run in {ck_dir}: "
        "3.orbax-checkpoint-tmp-1764150000000, 5.orbax-checkpoint-tmp-1764150000001",
        f"starting fresh at step 0: no checkpoint found in {ck_dir}",
    ]
    assert sorted(p.name for p in ck_dir.iterdir()) == ["notes.txt"]
    lines.clear()  # nothing left: nothing said about it
    resume.start(load(tmp_path, "checkpoint.resume=never"), None, None, lines.append)[0].close()
    assert lines == [f"starting fresh at step 0 (checkpoint.resume=never); saving to {ck_dir}"]
    # must: no checkpoint is an error that says where it looked and the way out
    with pytest.raises(ConfigError, match=r"resume=must, but .*checkpoints holds no checkpoint"):
        resume.start(load(tmp_path, "checkpoint.resume=must"), None, None)


def test_resume_onto_another_layout_continues_the_losses(reference, tmp_path):
    ref_dir, expected = reference
    source = ref_dir / "checkpoints" / "10"
    assert train.train(load(tmp_path, *LAYOUT_B, f"checkpoint.resume={source}")) == 0
    got = losses(tmp_path)
    assert list(got) == list(range(11, 21))
    np.testing.assert_allclose([got[s] for s in got], [expected[s] for s in got], rtol=2e-5, atol=0)


def _target(cfg, devices):
    validate.resolve_mesh(cfg, len(devices))
    mesh = mesh_lib.make_mesh(cfg, devices)
    tx = optim.optimizer(cfg)
    shardings = state_shardings(cfg, mesh, mesh_lib.rules(cfg), tx)
    abstract = jax.eval_shape(lambda k: init_state(cfg, tx, k), jax.random.key(0))
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
    )


def _data(cfg):
    return data_lib.build(
        cfg.data,
        seq_len=cfg.model.seq_len,
        batch_size=cfg.global_batch,
        seed=cfg.train.seed,
        vocab_size=cfg.model.vocab_size,
        grad_accum=cfg.train.grad_accum,
    )


def test_restore_on_a_single_device_is_the_same_state(reference, tmp_path):
    source = reference[0] / "checkpoints" / "10"
    cfg_a, cfg_1 = load(tmp_path, *LAYOUT_A), load(tmp_path, *ONE_DEVICE)
    data_a, data_1 = _data(cfg_a), _data(cfg_1)
    sharded, step_a = resume.restore_train(source, cfg_a, _target(cfg_a, jax.devices()), data_a)
    single, step_1 = resume.restore_train(source, cfg_1, _target(cfg_1, jax.devices()[:1]), data_1)
    assert step_a == step_1 == 10 and int(single["step"]) == 10
    assert single["params"]["layers"]["wq"].sharding.device_set == {jax.devices()[0]}
    assert len(sharded["params"]["layers"]["wq"].sharding.device_set) == 8
    for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(single), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    batch_a, batch_1 = next(data_a.train), next(data_1.train)  # the same data position
    for key in batch_a:
        np.testing.assert_array_equal(batch_a[key], batch_1[key])


KILLED_SAVE = """
import os, signal, sys
import jax.numpy as jnp
import orbax.checkpoint._src.path.atomicity as atomicity
from ultrajax.config import parse
from ultrajax.train import checkpoint

cfg = parse.load(None, ["checkpoint.dir=" + sys.argv[1], "checkpoint.keep=5"])
state = {"step": jnp.int32(1), "params": {"w": jnp.ones((64, 64))}, "opt_state": {}}
ck = checkpoint.Checkpoints(cfg)
ck.save(1, state, {"position": 1})
ck.wait()

async def die(*args, **kwargs):  # everything is written but the final rename: killed now
    os.kill(os.getpid(), signal.SIGKILL)

atomicity.async_path.rename = die
ck.save(2, dict(state, step=jnp.int32(2), params={"w": jnp.zeros((64, 64))}), {"position": 2})
ck.wait()
"""


def read_meta(path) -> dict:
    """The checkpoint's meta item: {"step", "seed", "kind"}."""
    root, step = checkpoint.locate(path)
    return checkpoint._read_json_item(root, step, "meta")


def test_a_killed_save_never_replaces_the_last_good_checkpoint(tmp_path):
    script = tmp_path / "killed.py"
    script.write_text(textwrap.dedent(KILLED_SAVE))
    ck_dir = tmp_path / "checkpoints"
    proc = subprocess.run([sys.executable, str(script), str(ck_dir)], capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    leftovers = [p.name for p in ck_dir.iterdir() if not p.name.isdigit()]
    assert leftovers and all(n.startswith("2.orbax-checkpoint-tmp") for n in leftovers)
    assert all(fnmatch.fnmatch(n, checkpoint.TMP_PATTERN) for n in leftovers)  # what start removes
    assert checkpoint.locate(ck_dir) == (ck_dir, 1)  # the half-written step 2 does not count
    assert read_meta(ck_dir)["step"] == 1
    # a new run saves step 2 for real (Orbax replaces its own unfinished temporary)
    cfg = parse.load(None, [f"checkpoint.dir={ck_dir}"])
    ck = checkpoint.Checkpoints(cfg)
    assert ck.steps() == [1]
    state = {
        "step": jax.numpy.int32(2),
        "params": {"w": jax.numpy.zeros((64, 64))},
        "opt_state": {},
    }
    ck.save(2, state, {"position": 2})
    ck.close()
    assert checkpoint.locate(ck_dir) == (ck_dir, 2)
    assert sorted(p.name for p in ck_dir.iterdir()) == ["1", "2"]


def test_mismatched_checkpoints_name_what_differs(reference, tmp_path):
    source = reference[0] / "checkpoints" / "10"
    cfg = load(tmp_path, *LAYOUT_A, "model.d_model=64", "model.n_layers=3")
    with pytest.raises(ConfigError) as e:
        resume.restore_train(source, cfg, _target(cfg, jax.devices()), _data(cfg))
    assert "model.d_model=32 in the checkpoint, 64 in the config" in str(e.value)
    assert "model.n_layers=2 in the checkpoint, 3 in the config" in str(e.value)
    assert "train.run_dir=" in str(e.value) and "\n" not in str(e.value)  # the ways out
    # with checkpoint.dir set, another run directory shares it: that is not a way out
    shape = ["model.d_model=64", f"checkpoint.dir={reference[0] / 'checkpoints'}"]
    with pytest.raises(ConfigError) as e:
        resume.restore_train(source, load(tmp_path, *LAYOUT_A, *shape),
                             _target(cfg, jax.devices()), _data(cfg))  # fmt: skip
    assert "give it its own checkpoint.dir=..." in str(e.value)
    assert "train.run_dir=" not in str(e.value)
    # an optimizer of another structure (no clipping), the change asked for, is named too
    cfg = load(tmp_path, *LAYOUT_A, "optim.clip_norm=0", "checkpoint.resume_changed=true")
    with pytest.raises(ConfigError, match=r"lacks optimizer/opt_state/0/.* \(the optim\.\*"):
        resume.restore_train(source, cfg, _target(cfg, jax.devices()), _data(cfg))
    # parameters only: the config must agree too
    with pytest.raises(ConfigError, match="model.d_model=32 in the checkpoint, 64"):
        checkpoint.load_params(source, load(tmp_path, "model.d_model=64").model)


def test_a_resume_that_changes_what_the_run_is_is_refused_or_named(reference, tmp_path):
    """The optimizer, the seed, the data's split, the dtypes: changed on resume into the same
    run directory they were taken without a word (a learning rate 50x, an eval split that
    now holds trained-on documents, fp32 masters cast to bf16). Refused, each named, unless
    checkpoint.resume_changed=true, which names them as the run goes on."""
    source = reference[0] / "checkpoints" / "10"
    changed = ["optim.lr=0.05", "train.seed=9", "data.eval_fraction=0.5", "optim.schedule=wsd"]
    cfg = load(tmp_path, *LAYOUT_A, *changed, "model.param_dtype=bfloat16")
    with pytest.raises(ConfigError) as e:
        resume.restore_train(source, cfg, _target(cfg, jax.devices()), _data(cfg))
    msg = str(e.value)
    ref = load(tmp_path)
    for key in ("optim.lr", "train.seed", "data.eval_fraction", "optim.schedule"):
        section, name = key.split(".")
        was = getattr(getattr(ref, section), name)
        assert f"{key} {was} -> " in msg, (key, msg)
    assert "model.param_dtype float32 -> bfloat16" in msg
    assert "checkpoint.resume_changed=true" in msg and "\n" not in msg
    lines = []
    cfg = load(tmp_path, *LAYOUT_A, "optim.lr=0.05", "checkpoint.resume_changed=true")
    _, step = resume.restore_train(
        source, cfg, _target(cfg, jax.devices()), _data(cfg), warn=lines.append
    )
    assert step == 10 and lines == [
        f"note: resuming {source} with changed settings: optim.lr {ref.optim.lr} -> 0.05"
    ]
    # a finished run trains nothing, so nothing is refused: fewer steps (a cosine over 15
    # instead of 20: its learning rate differs) or changed settings, it is simply done
    finished = (reference[0] / "checkpoints", 20)
    for extra in (["train.steps=15"], ["train.steps=15", *changed]):
        cfg = load(tmp_path, *LAYOUT_A, *extra)
        assert resume.check_resume(cfg, finished, warn=lines.append).done
    # its way to train on keeps the saved run's schedule (20 steps), not this config's 15
    said = report.nothing_to_train(cfg, resume.saved_config(*finished), *finished, tmp_path)
    assert "train.steps=15 is reached" in said and "optim.schedule_steps=20 to keep" in said
    assert said.endswith(f"to start over, give train.run_dir=... or delete {tmp_path}")
    shared = load(tmp_path, *LAYOUT_A, "train.steps=15", f"checkpoint.dir={finished[0]}")
    said = report.nothing_to_train(shared, resume.saved_config(*finished), *finished, tmp_path)
    assert said.endswith(f"give another checkpoint.dir=... (every run that names {finished[0]} "
                         "shares it)")  # fmt: skip
    # what does not change the run goes through without a word: layout, logging, steps
    lines = []
    cfg = load(tmp_path, *LAYOUT_A, "train.log_every=3", "optim.schedule_steps=20")
    resume.restore_train(source, cfg, _target(cfg, jax.devices()), _data(cfg), warn=lines.append)
    assert lines == []


def test_a_changed_schedule_length_on_resume_is_refused_or_rescheduled(reference, tmp_path):
    """train.steps=30 on a run scheduled over 20: refused (the learning rate would jump),
    accepted with train.reschedule=true (saying by how much), or kept with
    optim.schedule_steps=20 (the old schedule, held at its end)."""
    source = reference[0] / "checkpoints" / "10"
    cfg = load(tmp_path, *LAYOUT_A, "train.steps=30")
    old = float(optim.lr_schedule(load(tmp_path))(10))
    new = float(optim.lr_schedule(cfg)(10))
    assert new > old * 1.2  # the cosine over 30 steps is higher at step 10
    with pytest.raises(ConfigError) as e:
        resume.restore_train(source, cfg, _target(cfg, jax.devices()), _data(cfg))
    msg = str(e.value)
    assert f"of step 11 goes from {old:.2e} to {new:.2e}" in msg  # the one logged as 11
    assert "over 20 steps" in msg
    assert "train.reschedule=true" in msg and "optim.schedule_steps=20" in msg
    lines = []
    cfg = load(tmp_path, *LAYOUT_A, "train.steps=30", "train.reschedule=true")
    state, step = resume.restore_train(
        source, cfg, _target(cfg, jax.devices()), _data(cfg), warn=lines.append
    )
    assert step == 10 and any(line.startswith("rescheduled: the cosine") for line in lines)
    cfg = load(tmp_path, *LAYOUT_A, "train.steps=30", "optim.schedule_steps=20")
    assert float(optim.lr_schedule(cfg)(10)) == old and float(optim.lr_schedule(cfg)(29)) > 0
    resume.restore_train(source, cfg, _target(cfg, jax.devices()), _data(cfg))
    # a constant schedule has no length to change
    cfg = load(tmp_path, *LAYOUT_A, "train.steps=30", "optim.schedule=constant")
    resume.check_schedule(load(tmp_path, "optim.schedule=constant"), cfg, "x", 10)


def test_corrupt_and_missing_checkpoints_are_clear_errors(reference, tmp_path):
    good = reference[0] / "checkpoints" / "10"
    cfg = load(tmp_path, *LAYOUT_A)
    target = _target(cfg, jax.devices())
    with pytest.raises(ConfigError, match="does not exist"):
        resume.restore_train(tmp_path / "nowhere", cfg, target, _data(cfg))
    bad = tmp_path / "bad" / "10"
    shutil.copytree(good, bad)
    for f in (bad / "params").rglob("*"):
        if f.is_file() and f.parent.name == "d":  # the array data
            f.write_bytes(b"\0" * f.stat().st_size)
    with pytest.raises(ConfigError, match=r"checkpoint .*bad/10 cannot be read") as e:
        resume.restore_train(bad, cfg, target, _data(cfg))
    assert "resume from" not in str(e.value)  # no step before it
    shutil.copytree(good, tmp_path / "bad" / "5")  # a whole step before: the way on is named
    with pytest.raises(ConfigError) as e:
        resume.restore_train(bad, cfg, target, _data(cfg))
    assert str(e.value).endswith(
        f"; to resume from step 5, the last before it, move {bad} out of {bad.parent} and "
        "run the same command again"
    )
    (bad / "config" / "metadata").write_text("{ not json")
    with pytest.raises(ConfigError, match=r"checkpoint .*bad/10 cannot be read"):
        checkpoint.read_config(bad)
    # resume=never never starts over on top of a run's checkpoints (keep would delete them);
    # `none` is its older name
    for mode in ("never", "none"):
        cfg = load(reference[0], *LAYOUT_A, f"checkpoint.resume={mode}")
        with pytest.raises(ConfigError, match="already holds checkpoints .* own train.run_dir"):
            resume.start(cfg, None, None)
    # must: the latest
    assert resume.resume_source(load(reference[0], "checkpoint.resume=must"))[1] == 20
    # a run directory stands for the latest checkpoint in it (generate, convert, resume=PATH)
    assert checkpoint.locate(reference[0]) == (reference[0] / "checkpoints", 20)
    # resuming an old step into a directory with newer ones is refused
    cfg = load(reference[0], *LAYOUT_A, f"checkpoint.resume={good}")
    with pytest.raises(ConfigError, match="already holds steps after 10"):
        resume.start(cfg, None, None)
    assert steps(reference[0]) == [10, 20]


def test_init_from_loads_parameters_only(reference, tmp_path):
    source = reference[0] / "checkpoints" / "20"
    cfg = load(tmp_path, *LAYOUT_A, f"checkpoint.init_from={source}")
    target = _target(cfg, jax.devices())
    fresh = jax.tree.map(lambda a: jax.numpy.zeros(a.shape, a.dtype, device=a.sharding), target)
    ck, state, start = resume.start(cfg, fresh, _data(cfg), say=lambda *a: None)
    ck.close()
    assert start == 0 and int(state["step"]) == 0
    assert int(state["opt_state"][1][0].count) == 0  # the optimizer starts fresh
    saved = checkpoint.load_params(source, cfg.model)
    for a, b in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(saved), strict=True):
        assert a.sharding == b.sharding or len(a.sharding.device_set) == 8
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # a parameter-only checkpoint cannot be resumed: it has no optimizer state
    only = checkpoint.write_params(tmp_path / "params-only", saved, cfg)
    with pytest.raises(ConfigError, match="holds parameters only"):
        resume.restore_train(only, cfg, target, _data(cfg))


def test_a_batch_check_keeps_the_run_s_learning_rate_position_and_budget(tmp_path):
    """resume.check_batch, from a ramp state alone (nothing compiled). The run: 4 sequences
    of 32 tokens a step on 1 device under mesh.data=-1, 512 tokens a step from 1024 tokens
    on. Resumed on 2 devices, the ramp's stage sets the batch, so it continues, with the
    learning rate read where the run left it (it used to be read in the new, twice larger,
    batch: half-way back up the schedule); at the config's batch the doubled batch is
    refused; a finished run stays finished."""
    ramp = "train.batch_schedule=[{tokens_per_step: 512, from_tokens: 1024}]"

    def on(devices, *extra):
        cfg = load(tmp_path, "mesh.data=-1", "train.micro_batch_size=2", *extra)
        validate.resolve_mesh(cfg, devices)
        return cfg

    def ran(cfg, n):
        r = Ramp(cfg)
        for _ in range(n):
            r.step_done()
        return json.loads(json.dumps(r.state()))  # as a checkpoint holds it

    saved = on(1, ramp)
    later = resume.check_batch(saved, on(2, ramp), ran(saved, 8), 8, "ck/8")
    assert (later.stage, later.tokens_per_step, later.grad_accum) == (1, 512, 4)
    assert (later.position, later.total, later.done) == (8.0, 20 * 128, False)
    with pytest.raises(ConfigError) as e:
        resume.check_batch(saved, on(2, ramp), ran(saved, 4), 4, "ck/4")
    assert str(e.value).startswith("ck/4 trained with a global batch of 4 sequences; ")
    assert "Keep 4 with train.grad_accum=1 or train.micro_batch_size=1;" in str(e.value)
    # an older checkpoint without the ramp's state: its config's batch all along
    older = resume.check_batch(on(1), on(1, "train.grad_accum=1", "train.micro_batch_size=4"),
                               None, 5, "ck/5")  # fmt: skip
    assert (older.tokens, older.position) == (5 * 128, 5.0)
    assert resume.check_batch(saved, on(2, ramp), ran(saved, 14), 14, "ck/14").done
    assert resume.check_batch(on(1), on(2), None, 20, "ck/20").done


def test_delayed_fp8_histories_are_saved_and_restored_exactly(tmp_path, monkeypatch):
    """model.fp8=delayed: the amax histories travel in the checkpoint's optimizer item,
    so a run stopped after step 3 and resumed has the losses of one that never stopped
    (a history lost would scale step 4 by its own amaxes: other values). The parameters
    alone, what conversion reads, hold no history."""
    extra = ("mesh.data=8", "train.micro_batch_size=1", "train.grad_accum=1")
    extra += ("model.fp8=delayed", "model.fp8_history=4", "train.steps=6")
    extra += ("checkpoint.every=3", "optim.warmup_steps=1")
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    assert train.train(load(whole, *extra)) == 0
    write = metrics.MetricsWriter.write

    def write_then_sigterm(self, record):
        write(self, record)
        if record["step"] == 2:  # step 3 is saved, then the run stops
            signal.raise_signal(signal.SIGTERM)

    monkeypatch.setattr(metrics.MetricsWriter, "write", write_then_sigterm)
    assert train.train(load(broken, *extra)) == 143
    monkeypatch.undo()
    cfg = load(broken, *extra)
    state, step = resume.restore_train(
        broken / "checkpoints" / "3", cfg, _target(cfg, jax.devices()), _data(cfg)
    )
    history = np.asarray(state["fp8"]["w_down"])
    assert step == 3 and history.shape == (2, 3, 4)  # layers, (x, w, g), fp8_history
    assert np.all(history[..., :3] > 0) and not np.any(history[..., 3])  # 3 steps recorded
    assert train.train(load(broken, *extra)) == 0
    assert losses(broken) == losses(whole)
    params = checkpoint.load_params(broken / "checkpoints" / "6", cfg.model)
    assert "fp8" not in params and set(params) == set(state["params"])


def test_a_failed_save_is_one_line_naming_the_directory(tmp_path, monkeypatch, capsys):
    """Orbax reports a full disk as a page of RESOURCE_EXHAUSTED tracebacks from its threads,
    raised again wherever the run next waits or saves. Both become SaveFailed: one line
    naming the directory, the cause and the way on; the command exits with status 1."""
    from types import SimpleNamespace

    from ultrajax.tools import train as command

    cfg = load(tmp_path)
    ck = checkpoint.Checkpoints(cfg)
    ck.close()
    full = ValueError('RESOURCE_EXHAUSTED: Error writing "params" ... Failed to write 2625536\n'
                      "bytes to file 8: No space left on device [os_error_code='28']")  # fmt: skip

    def fails(*args, **kwargs):
        raise full

    ck._mngr = SimpleNamespace(wait_until_finished=fails, save=fails, close=lambda: None)
    for call in (ck.wait, ck.close, lambda: ck.save(1, {"params": {}}, {})):
        with pytest.raises(checkpoint.SaveFailed) as e:
            call()
        msg = str(e.value)
        assert msg.startswith(f"could not save a checkpoint in {ck.dir}: no space left on device")
        assert "run the same command again" in msg and "\n" not in msg

    def train(cfg):
        raise checkpoint.SaveFailed("could not save a checkpoint in X: no space left on device")

    monkeypatch.setattr(command, "train", train)
    with pytest.raises(SystemExit) as e:
        command.main(["--config", str(TINY), "train.steps=2", "optim.warmup_steps=1"])
    assert e.value.code == 1
    assert (
        capsys.readouterr().err
        == "error: could not save a checkpoint in X: no space left on device\n"
    )
