"""Multi-host training, tested with several local processes (jax.distributed over gloo).

Fast tests check the pieces (mesh.dcn config, how a process decides to join a
run, the hybrid device layout, the SLURM command line); the slow ones start real
processes: 2 processes x 4 devices against 1 process x 8 devices, a checkpoint
written by 2 processes resumed by 1, and the launcher stopping a broken run.
"""

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import harness
import jax
import numpy as np
import pytest

from ultrajax import cli
from ultrajax.config.parse import dump, load
from ultrajax.config.schema import ConfigError
from ultrajax.config.validate import resolve_mesh
from ultrajax.data import prepare
from ultrajax.parallel import mesh as mesh_lib
from ultrajax.train import distributed

ROOT = Path(__file__).resolve().parent.parent
LAUNCH = ROOT / "scripts" / "launch_local.sh"
SBATCH = ROOT / "scripts" / "slurm" / "train.sbatch"

# tiny on purpose: each run compiles on a shared 2-core machine
TINY = [
    "--config",
    "configs/tiny.yaml",
    "model.d_model=32",
    "model.n_layers=2",
    "model.d_ff=64",
    "model.seq_len=32",
    "train.micro_batch_size=2",
    "train.grad_accum=1",
    "train.log_every=1",
    "train.eval_batches=0",
    "optim.warmup_steps=0",  # every step updates: a wrong gradient shows at the next step
]
LAYOUT = ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "parallel.zero=3"]
STEPS = 4


def _env(**extra):
    env = harness.child_env()
    for k in [k for k in env if k.startswith(("SLURM_", "OMPI_"))]:
        env.pop(k)  # a test run inside a SLURM job must not look like a multi-task step
    env.update(extra)
    return env


def _losses(run_dir: Path) -> dict[int, tuple[float, float]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in records}


# --------------------------------------------------------------------------- config: mesh.dcn


def test_dcn_defaults_to_one_host_per_axis():
    cfg = load(None)
    assert (cfg.mesh.dcn.data, cfg.mesh.dcn.fsdp, cfg.mesh.dcn.pipeline) == (1, 1, 1)
    assert "dcn" not in cfg.mesh.sizes()


def test_dcn_override_and_yaml_round_trip(tmp_path):
    cfg = load(None, ["mesh.data=4", "mesh.dcn.data=2"])
    assert cfg.mesh.dcn.data == 2 and cfg.mesh.data == 4
    path = tmp_path / "c.yaml"
    path.write_text(dump(cfg))
    assert load(path) == cfg
    path.write_text("mesh:\n  fsdp: 4\n  dcn: {fsdp: 2}\n")
    assert load(path).mesh.dcn.fsdp == 2


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["mesh.dcn.dta=2"], "did you mean mesh.dcn.data?"),
        (["mesh.dnc.data=2"], "did you mean mesh.dcn?"),
        (["mesh.dcn=2"], "mesh.dcn is a section"),
        (["mesh.dcn.data=0"], "mesh.dcn.data must be >= 1"),
        (["mesh.dcn.data=2"], "mesh.dcn.data (2) must divide mesh.data (1)"),
        (["mesh.dcn.tensor=2"], "unknown config key 'mesh.dcn.tensor'"),
        (["train.steps.x=1"], "train.steps is a value, not a section"),
    ],
)
def test_dcn_errors_are_one_line(overrides, message):
    with pytest.raises(ConfigError) as info:
        load(None, overrides)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_dcn_checked_after_the_fill():
    cfg = load(None, ["mesh.fsdp=-1", "mesh.dcn.fsdp=3"])
    with pytest.raises(ConfigError, match=r"mesh.dcn.fsdp \(3\) must divide mesh.fsdp \(8\)"):
        resolve_mesh(cfg, 8)


def test_processes_with_unequal_devices_are_one_line():
    """Two processes of 2 and 1 devices (--cpu-devices 2 and 1) made a 3-device mesh, and
    the run failed at its first save in Orbax's reshape. Refused where the mesh is made,
    naming each process's count."""
    from types import SimpleNamespace

    cfg = load(None, ["mesh.data=3"])
    devices = [SimpleNamespace(process_index=p, id=i) for i, p in enumerate((0, 0, 1))]
    with pytest.raises(ConfigError) as info:
        mesh_lib.make_mesh(cfg, devices)
    assert "(process 0: 2, process 1: 1)" in str(info.value) and "\n" not in str(info.value)


# --------------------------------------------------------------------------- joining a run


def test_a_coordinator_port_in_use_is_one_line():
    """Process 0 serves the coordinator: a port another program listens on crashed it
    (SIGSEGV inside JAX's service); now one line names the port and the way out."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"port {port} .* another program holds it"):
            distributed._check_port_free(f"127.0.0.1:{port}")
    distributed._check_port_free(f"127.0.0.1:{port}")  # free again


def test_single_process_needs_nothing():
    assert distributed.joining(env={}) is None
    assert distributed.joining("127.0.0.1:1234", 1, 0, env={}) is None


def test_explicit_flags():
    p = distributed.joining("10.0.0.1:8476", 4, 3, env={})
    assert (p.source, p.coordinator) == ("flags", "10.0.0.1:8476")
    assert (p.num_processes, p.process_id) == (4, 3)


@pytest.mark.parametrize(
    "flags, message",
    [
        (("h:1", None, 0), "--num-processes missing"),
        ((None, 2, None), "--coordinator, --process-id missing"),
        (("nohost", 2, 0), "must look like HOST:PORT"),
        (("h:99999", 2, 0), "must look like HOST:PORT"),
        (("h:1", 2, 2), "--process-id must be in 0..1"),
        (("h:1", 0, 0), "--num-processes must be >= 1"),
    ],
)
def test_bad_flags(flags, message):
    with pytest.raises(ConfigError, match=message):
        distributed.joining(*flags, env={})


SLURM_NODE = {
    "SLURM_JOB_ID": "77",
    "SLURM_STEP_NODELIST": "gpu-[001-002]",
    "SLURM_NTASKS": "2",
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "0",
}


def test_slurm_one_task_per_node_uses_every_gpu():
    """The pitfall: JAX alone would give this process only GPU 0 (its local task id)."""
    env = dict(SLURM_NODE, SLURM_NTASKS_PER_NODE="1", SLURM_GPUS_ON_NODE="8")
    p = distributed.joining(env=env)
    assert p.source == "slurm" and p.num_processes == 2
    assert p.local_device_ids == tuple(range(8)) and p.expect_local_devices == 8
    env = dict(SLURM_NODE, SLURM_STEP_TASKS_PER_NODE="1(x2)", CUDA_VISIBLE_DEVICES="0,1,2,3")
    assert distributed.joining(env=env).local_device_ids == (0, 1, 2, 3)


def test_slurm_one_task_per_gpu_keeps_jax_default():
    env = dict(SLURM_NODE, SLURM_NTASKS="16", SLURM_NTASKS_PER_NODE="8", SLURM_GPUS_ON_NODE="8")
    p = distributed.joining(env=env)
    assert p.num_processes == 16 and p.local_device_ids is None


def test_slurm_single_task_and_batch_script_need_nothing():
    assert distributed.joining(env=dict(SLURM_NODE, SLURM_NTASKS="1")) is None
    outside_srun = {k: v for k, v in SLURM_NODE.items() if k != "SLURM_STEP_NODELIST"}
    assert distributed.joining(env=outside_srun) is None


def test_a_gpu_process_that_sees_too_few_gpus_stops(monkeypatch):
    env = dict(SLURM_NODE, SLURM_NTASKS_PER_NODE="1", SLURM_GPUS_ON_NODE="8")
    distributed.check_local_devices(env)  # CPU backend here: nothing to check
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "local_device_count", lambda: 1)
    with pytest.raises(ConfigError, match="sees 1 GPU.* its node was given 8"):
        distributed.check_local_devices(env)
    monkeypatch.setattr(jax, "local_device_count", lambda: 8)
    distributed.check_local_devices(env)


def test_open_mpi():
    assert distributed.joining(env={"OMPI_COMM_WORLD_SIZE": "4"}).source == "openmpi"
    assert distributed.joining(env={"OMPI_COMM_WORLD_SIZE": "1"}) is None


def test_cli_has_the_flags_and_takes_options_after_overrides():
    args = cli.parser("t", "d").parse_args(
        ["--config", "x.yaml", "train.steps=3", "--num-processes", "2", "mesh.data=2"]
    )
    assert args.num_processes == 2 and args.overrides == ["train.steps=3", "mesh.data=2"]


# --------------------------------------------------------------------------- hybrid mesh


@dataclass(frozen=True)
class FakeDevice:  # what create_hybrid_device_mesh reads, for layouts of several hosts
    id: int
    process_index: int
    platform: str = "cpu"
    device_kind: str = "cpu"


def _hosts(n_hosts, per_host):
    return [FakeDevice(i, i // per_host) for i in range(n_hosts * per_host)]


def test_hybrid_mesh_puts_dcn_factors_across_hosts():
    cfg = load(None, ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "mesh.dcn.data=2"])
    ids = np.vectorize(lambda d: d.id)(mesh_lib.hybrid_devices(cfg, _hosts(2, 4)))
    assert ids.shape == (2, 2, 1, 1, 1, 2)
    assert set(ids[0].flat) == {0, 1, 2, 3} and set(ids[1].flat) == {4, 5, 6, 7}
    cfg = load(None, ["mesh.data=2", "mesh.fsdp=4", "mesh.dcn.fsdp=2"])
    ids = np.vectorize(lambda d: d.id)(mesh_lib.hybrid_devices(cfg, _hosts(2, 4)))
    # fsdp = 2 hosts (outer) x 2 devices (inner); data stays inside a host
    assert ids[:, :, 0, 0, 0, 0].tolist() == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_hybrid_mesh_errors_name_the_mismatch():
    cfg = load(None, ["mesh.fsdp=8", "mesh.dcn.fsdp=4"])
    with pytest.raises(ConfigError, match="spans 4 hosts, but the run has 2 process"):
        mesh_lib.hybrid_devices(cfg, _hosts(2, 4))
    cfg = load(None, ["mesh.fsdp=4", "mesh.dcn.fsdp=2"])
    with pytest.raises(ConfigError, match="inside each host the mesh is fsdp=2"):
        mesh_lib.hybrid_devices(cfg, _hosts(2, 4))


def test_one_process_mesh_description():
    cfg = load(None, ["mesh.data=2", "mesh.fsdp=4"])
    text = mesh_lib.describe_hosts(mesh_lib.make_mesh(cfg, jax.devices()))
    assert text.startswith("hosts: 1 process(es) x 8 devices; across hosts (DCN): none")


# --------------------------------------------------------------------------- SLURM script


def _sbatch(*args, **env):
    slurm = dict(
        SLURM_JOB_ID="4242",
        SLURM_JOB_NUM_NODES="2",
        SLURM_GPUS_ON_NODE="8",
        SLURM_NTASKS_PER_NODE="1",
        SLURM_JOB_NODELIST="gpu-[017-018]",
        ULTRAJAX_DRY_RUN="1",
    )
    slurm.update(env)
    clean = {"PATH": "/usr/bin:/bin", **slurm}  # no scontrol here: the script parses the list
    return subprocess.run(
        ["bash", str(SBATCH), *args], env=clean, capture_output=True, text=True, timeout=60
    )


def test_sbatch_command_line():
    user = ["--config", "configs/tiny.yaml", "mesh.data=2", "mesh.fsdp=8", "mesh.dcn.data=2"]
    out = _sbatch(*user, "train.run_dir=runs/two nodes")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    exports = dict(shlex.split(line)[1].split("=", 1) for line in lines[:-1])
    cmd = shlex.split(lines[-1])
    assert exports["JAX_COORDINATOR_ADDRESS"] == "gpu-017:24242"  # first node, port from job id
    assert "XLA_FLAGS" not in exports  # overlap/bucketing flags come from parallel.* config
    assert float(exports["XLA_PYTHON_CLIENT_MEM_FRACTION"]) > 0.75
    assert "NCCL_DEBUG" in exports
    assert "CUDA_VISIBLE_DEVICES" not in out.stdout  # never narrowed per task
    srun, module = cmd[: cmd.index("-m")], cmd[cmd.index("-m") :]
    assert srun[0] == "srun"
    for flag in ("--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=8", "--kill-on-bad-exit=1"):
        assert flag in srun
    assert module[:2] == ["-m", "ultrajax.train"]
    assert module[2:] == [*user, "train.run_dir=runs/two nodes"]  # passed through unchanged
    # what the nodes will run parses and validates as the train command's input
    args = cli.parser("ultrajax.train", "").parse_args(module[2:])
    cfg = load(ROOT / args.config, args.overrides)
    resolve_mesh(cfg, 2 * 8)
    assert cfg.mesh.dcn.data == 2
    # a coordinator of the user's own is kept (the doc says so; it was overwritten)
    out = _sbatch(*user, JAX_COORDINATOR_ADDRESS="myhost:1234")
    assert "JAX_COORDINATOR_ADDRESS=myhost:1234" in out.stdout.splitlines()[0], out.stdout


def test_sbatch_refuses_several_tasks_per_node():
    out = _sbatch("--config", "configs/tiny.yaml", SLURM_NTASKS_PER_NODE="8")
    assert out.returncode == 2 and "one task per node" in out.stderr


# --------------------------------------------------------------------------- real processes


def _launch(n, *args, timeout=900):
    return subprocess.run(
        ["bash", str(LAUNCH), str(n), *args],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _train(*args, timeout=900):
    return subprocess.run(
        [sys.executable, "-m", "ultrajax.train", *args],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_launcher_rejects_bad_input():
    out = _launch(0)
    assert out.returncode == 2 and "usage" in out.stderr
    out = _launch(2, "--config", "configs/tiny.yaml", "train.stepz=3")
    assert out.returncode == 2
    assert out.stderr.strip() == (
        "error: unknown config key 'train.stepz'; did you mean train.steps?"
    )
    out = _launch(2, "train.steps=3")  # no --config: it started both, each then failed
    assert out.returncode == 2 and out.stderr.strip().startswith("error: --config FILE")


def test_a_run_that_cannot_join_says_why():
    code = "from ultrajax import cli; cli.setup_devices(None)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=_env(OMPI_COMM_WORLD_SIZE="2"),  # Open MPI's rank count, but not its coordinator
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert out.stderr.startswith("error: could not join the 2-process run (openmpi)")
    assert out.stderr.count("\n") == 1


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _second_fails(tmp_path, where, first, second, cwd=ROOT, cwd0=ROOT) -> str:
    """Two train processes with their own arguments: process 1 must fail, alone and at
    once; its stderr. (Process 0 is then stopped: it waits for process 1.)"""
    common = [sys.executable, "-m", "ultrajax.train", *TINY, "--cpu-devices", "1"]
    common += ["train.steps=3", f"train.run_dir={tmp_path}", "--coordinator", where]
    procs = []
    for own, home in ((first, cwd0), (second, cwd)):  # `python -m` imports from its cwd
        out = subprocess.PIPE
        cmd = [*common, *own]
        procs.append(subprocess.Popen(cmd, cwd=home, env=_env(), stdout=out, stderr=out, text=True))
    try:
        _, err = procs[1].communicate(timeout=120)
    finally:
        procs[0].kill()
        procs[0].communicate()
    assert procs[1].returncode == 2, err
    return err


def test_a_process_told_another_count_stops_at_once(tmp_path):
    """Process 1 started with --num-processes 3 joined process 0's 2-process run and ran
    on. Now it stops, naming both counts; and at once: a process failing alone waited,
    inside JAX's client teardown, for process 0, which waited for it (5 minutes)."""
    where = f"127.0.0.1:{_free_port()}"
    first = ["--num-processes", "2", "--process-id", "0"]
    err = _second_fails(tmp_path, where, first, ["--num-processes", "3", "--process-id", "1"])
    assert err == (
        "error: process 1 was started with --num-processes 3, but process 0 (the coordinator, "
        f"{where}) with 2: give every process the same count\n"
    )


def test_a_process_running_other_code_stops(tmp_path):
    """A host with another checkout (one comment changed here) or another JAX compiled
    other programs for the same run. Each process's software is held against process 0's."""
    import shutil

    code = tmp_path / "code"
    shutil.copytree(
        ROOT / "ultrajax", code / "ultrajax", ignore=shutil.ignore_patterns("__pycache__")
    )
    loop_py = code / "ultrajax" / "train" / "loop.py"
    loop_py.write_text(loop_py.read_text() + "# edited on this host\n")
    where = f"127.0.0.1:{_free_port()}"
    first = ["--num-processes", "2", "--process-id", "0"]
    second = ["--num-processes", "2", "--process-id", "1"]
    (code / "configs").symlink_to(ROOT / "configs")
    err = _second_fails(tmp_path / "run", where, first, second, cwd=code)
    assert err.startswith("error: process 1 runs other software than process 0: python "), err
    assert err.endswith("; install the same on every host\n")
    here, there = err.split(": ", 2)[2].split(" here, ")
    assert here.split(", ")[:3] == there.split(", ")[:3]  # the same Python, JAX, jaxlib
    assert here.split("ultrajax source ")[1] != there.split("ultrajax source ")[1][:12]


def test_a_process_reading_another_copy_of_the_data_stops(tmp_path):
    """The same data.path on every host, but a node-local copy can be another corpus (a
    stale one here): that host trained on other documents. Held against process 0's."""
    homes = []
    for name, words in (("a", "one two three "), ("b", "four five six seven ")):
        home = tmp_path / name
        (home / "text").mkdir(parents=True)
        for i in range(12):
            (home / "text" / f"{i}.txt").write_text(words * (20 + i))
        prepare.prepare([str(home / "text")], "bytes", home / "prep", workers=1)
        (home / "configs").symlink_to(ROOT / "configs")
        homes.append(home)
    where = f"127.0.0.1:{_free_port()}"
    data = ["data.source=prepared", "data.path=prep", "mesh.data=-1"]  # a relative path
    first = ["--num-processes", "2", "--process-id", "0", *data]
    second = ["--num-processes", "2", "--process-id", "1", *data]
    err = _second_fails(tmp_path / "run", where, first, second, cwd=homes[1], cwd0=homes[0])
    assert err.startswith("error: process 1 reads other data than process 0: prep (")
    assert err.endswith("; give every host the same copy\n")
    here, there = err.split(": ", 2)[2].split(" here, ")
    assert "manifest" in here and here.split("manifest ")[1] != there.split("manifest ")[1]


def test_a_process_with_another_config_stops_naming_the_keys(tmp_path):
    """A process whose overrides (or config file) differ joined and trained with its own
    settings, here another learning rate on its shards. Now it stops, naming the keys."""
    where = f"127.0.0.1:{_free_port()}"
    first = ["--num-processes", "2", "--process-id", "0"]
    second = ["--num-processes", "2", "--process-id", "1", "optim.lr=0.05", "train.seed=3"]
    err = _second_fails(tmp_path, where, first, second)
    assert err.startswith(
        "error: process 1's config differs from process 0's: optim.lr 0.003 vs 0.05; "
        "train.seed 0 vs 3 (process 0's value first): give every process the same config"
    ), err


@pytest.mark.slow
def test_an_error_in_the_processes_ends_the_run_with_its_message(tmp_path):
    layout = ["--cpu-devices", "2", "mesh.data=4", "mesh.dcn.data=4"]  # 4 hosts, but 2 run
    out = _launch(2, *TINY, *layout, f"train.run_dir={tmp_path}")
    assert out.returncode == 2
    assert "exited with status 2" in out.stderr
    assert "error: mesh.dcn (data=4) spans 4 hosts, but the run has 2 process(es)" in out.stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process x 8 devices, and two processes x 4 devices with the data axis across
    them (a hybrid mesh): the same layout, the same steps, a checkpoint every 2 steps."""
    base = tmp_path_factory.mktemp("multihost")
    # from prepared shards: each process reads and packs only its 4 of the 8 streams
    prepare.prepare([str(ROOT / "ultrajax")], "bytes", base / "shards", workers=1)
    ckpt = ["checkpoint.every=2", "checkpoint.keep=5", f"train.steps={STEPS}"]
    ckpt += ["data.source=prepared", f"data.path={base / 'shards'}"]
    one, two = base / "one", base / "two"
    t0 = time.perf_counter()
    out1 = _train(*TINY, *LAYOUT, *ckpt, "--cpu-devices", "8", f"train.run_dir={one}")
    assert out1.returncode == 0, out1.stderr[-3000:]
    t1 = time.perf_counter()
    out2 = _launch(
        2, *TINY, *LAYOUT, *ckpt, "mesh.dcn.data=2", "--cpu-devices", "4", f"train.run_dir={two}"
    )
    assert out2.returncode == 0, out2.stderr[-3000:]
    t2 = time.perf_counter()
    print(f"1 process: {t1 - t0:.0f}s, 2 processes: {t2 - t1:.0f}s")
    return one, two, out2, ckpt[3:]


@pytest.mark.slow
def test_two_processes_give_the_losses_of_one(runs):
    one, two, _, _ = runs
    single, multi = _losses(one), _losses(two)
    assert sorted(single) == sorted(multi) == list(range(1, STEPS + 1))
    for step in single:  # same global batches, same program: equal to float rounding
        np.testing.assert_allclose(multi[step], single[step], rtol=1e-5, err_msg=f"step {step}")
    assert single[STEPS][0] < single[1][0]  # and it trains


@pytest.mark.slow
def test_diloco_across_two_processes_gives_the_losses_of_one(tmp_path):
    """DiLoCo with `data` across the processes (its deployment: a replica a host or site):
    each process holds its replica; the step's metrics, one per replica and split over
    `data`, are gathered at log steps only (record.fetch: no process holds both). 2 x 4
    devices give 1 x 8's losses and norms, every step (a sync at step 2, then one step on).
    """
    steps = ["parallel.diloco_steps=2", "train.steps=3"]
    one, two = tmp_path / "one", tmp_path / "two"
    out1 = _train(*TINY, *LAYOUT, *steps, "--cpu-devices", "8", f"train.run_dir={one}")
    assert out1.returncode == 0, out1.stderr[-3000:]
    out2 = _launch(
        2, *TINY, *LAYOUT, *steps, "mesh.dcn.data=2", "--cpu-devices", "4", f"train.run_dir={two}"
    )
    assert out2.returncode == 0, out2.stderr[-3000:]
    single, multi = _losses(one), _losses(two)
    assert sorted(single) == sorted(multi) == [1, 2, 3]
    for step in single:
        np.testing.assert_allclose(multi[step], single[step], rtol=1e-5, err_msg=f"step {step}")


@pytest.mark.slow
def test_only_process_zero_prints_and_writes(runs):
    _, two, out, _ = runs
    log0 = (two / "logs" / "process_0.log").read_text()
    log1 = (two / "logs" / "process_1.log").read_text()
    assert "summary:" in log0 and f"step {STEPS:>6} loss" in log0
    assert "across hosts (DCN): data=2" in log0  # the hybrid mesh, printed
    assert "hosts: 2 process(es) x 4 devices" in log0
    assert "8 streams of 1 row a step; this process packs 4 of them" in log0
    assert "summary:" not in log1 and " loss " not in log1 and "mesh:" not in log1
    assert "joining the 2-process run at 127.0.0.1:" in log0 and "joining" not in log1
    assert "all 2 processes finished" in out.stderr


@pytest.mark.slow
def test_checkpoint_from_two_processes_resumes_in_one(runs, tmp_path):
    one, two, _, data = runs
    saved = two / "checkpoints" / "2"
    assert saved.is_dir()
    out = _train(
        *TINY,
        *LAYOUT,
        *data,
        f"train.steps={STEPS}",
        "--cpu-devices",
        "8",
        f"train.run_dir={tmp_path}",
        f"checkpoint.resume={saved}",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resumed from" in out.stdout
    resumed, single = _losses(tmp_path), _losses(one)
    assert sorted(resumed) == list(range(3, STEPS + 1))
    for step in resumed:
        np.testing.assert_allclose(resumed[step], single[step], rtol=1e-5, err_msg=f"step {step}")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


@pytest.mark.slow
def test_killing_one_process_stops_the_launcher(tmp_path):
    launcher = subprocess.Popen(
        ["bash", str(LAUNCH), "2", *TINY, "train.steps=100000", "--cpu-devices", "2"]
        + ["mesh.data=4", "mesh.dcn.data=2", f"train.run_dir={tmp_path}"],
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        pids_file, log0 = tmp_path / "logs" / "pids", tmp_path / "logs" / "process_0.log"
        deadline = time.monotonic() + 300
        # both processes have joined the run and built the mesh
        while not (log0.exists() and "mesh:" in log0.read_text()):
            assert launcher.poll() is None, launcher.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the run did not start"
            time.sleep(0.5)
        pids = [int(p) for p in pids_file.read_text().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        t0 = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        _, err = launcher.communicate(timeout=30)
        elapsed = time.monotonic() - t0
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    assert launcher.returncode == 128 + signal.SIGKILL, err[-3000:]
    assert elapsed < 10, f"the launcher took {elapsed:.1f}s to stop"
    assert "process 1" in err and "exited with status 137" in err
    assert "last lines of" in err
    for pid in pids:  # every process, and every process in their groups, is gone
        assert not _alive(pid)
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)


@pytest.mark.slow
def test_slurm_environment_starts_a_two_process_run(tmp_path):
    """What `srun` gives each task, simulated on this host: JAX's own SLURM detection
    (coordinator from JAX_COORDINATOR_ADDRESS, as the sbatch file sets it) joins both."""
    port = _free_port()
    code = (
        "import jax; from ultrajax import cli; cli.setup_devices(2);"
        "print(jax.process_index(), jax.process_count(), jax.device_count())"
    )
    procs = []
    for i in range(2):
        env = _env(
            SLURM_JOB_ID="5",
            SLURM_STEP_NODELIST="localhost",
            SLURM_NTASKS="2",
            SLURM_NTASKS_PER_NODE="1",
            SLURM_PROCID=str(i),
            SLURM_LOCALID="0",
            JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
        )
        cmd = [sys.executable, "-c", code]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=120)[0].splitlines() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert sorted(out[-1].split() for out in outs) == [["0", "2", "4"], ["1", "2", "4"]]
    # until all have joined JAX says nothing: process 0 (the task of rank 0) says so first
    assert outs[0][0].startswith("joining the 2-process run (slurm): waiting for every process")
    assert len(outs[1]) == 1
