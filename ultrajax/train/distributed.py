"""Multi-host start-up: `jax.distributed.initialize`, before anything touches the backend.

One JAX process per host (per GPU node), each driving all of that host's devices;
together they see one global device set and run one SPMD program. What a process
needs to join: the coordinator's HOST:PORT, the number of processes and its own
id. Three ways to get them, in this order:

1. explicit flags, `--coordinator HOST:PORT --num-processes N --process-id I`
   (what `scripts/launch_local.sh` passes);
2. the scheduler's environment, read by JAX's own cluster detection: SLURM
   (inside `srun`) and Open MPI (`mpirun`);
3. nothing: a single process needs no distributed runtime at all.

The known SLURM pitfall: JAX's detection assumes one process per GPU and makes
each process see only the GPU numbered by its local task id, so with one task
per node every node would train on its first GPU only. With one task on this
node we therefore pass all of the node's GPUs explicitly, and the train loop
checks (`check_local_devices`) that JAX sees as many devices as the node was given.

On CPU the processes talk through gloo (`jax_cpu_collectives_implementation`),
which is how multi-host runs are tested on one machine.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass

import jax
import yaml

from ultrajax.config.parse import flatten
from ultrajax.config.schema import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "multi-process", "join a multi-process run (not needed under SLURM or Open MPI)"
    )
    group.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address")
    group.add_argument("--num-processes", type=int, metavar="N", help="processes in the run")
    group.add_argument("--process-id", type=int, metavar="I", help="this process, 0..N-1")


@dataclass(frozen=True)
class Joining:
    """How this process joins a multi-process run (the coordinator, the process count, its
    own id, its devices); every None is left to JAX's cluster detection."""

    source: str  # "flags", "slurm" or "openmpi"
    num_processes: int
    coordinator: str | None = None
    process_id: int | None = None
    local_device_ids: tuple[int, ...] | None = None  # None: JAX's default for the source
    expect_local_devices: int | None = None  # checked after start-up (GPU runs)


def _int_env(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name, "")
    return int(value) if value.strip().isdigit() else None


def slurm_tasks_on_node(env: Mapping[str, str]) -> int | None:
    """Tasks of this step on this node: SLURM_NTASKS_PER_NODE, or the first entry of
    SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE (formats "8", "1(x2)", "2,1")."""
    direct = _int_env(env, "SLURM_NTASKS_PER_NODE")
    if direct is not None:
        return direct
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        match = re.match(r"\s*(\d+)", env.get(name, ""))
        if match:
            return int(match.group(1))
    return None


def node_gpus(env: Mapping[str, str]) -> int | None:
    """GPUs given to this node: SLURM_GPUS_ON_NODE, else the CUDA_VISIBLE_DEVICES list."""
    n = _int_env(env, "SLURM_GPUS_ON_NODE")
    if n:
        return n
    visible = env.get("CUDA_VISIBLE_DEVICES", "").strip()
    if visible and visible != "NoDevFiles":
        return len([v for v in visible.split(",") if v.strip()])
    return None


def joining(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    env: Mapping[str, str] | None = None,
) -> Joining | None:
    """Decide how to join, without touching JAX (so tests can call it). None: one process."""
    env = os.environ if env is None else env
    given = {"--coordinator": coordinator, "--num-processes": num_processes}
    given["--process-id"] = process_id
    if any(v is not None for v in given.values()):
        missing = [k for k, v in given.items() if v is None]
        if missing:
            raise ConfigError(
                f"{', '.join(missing)} missing: --coordinator, --num-processes and "
                "--process-id go together"
            )
        host, _, port = coordinator.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"--coordinator {coordinator!r} must look like HOST:PORT")
        if num_processes < 1:
            raise ConfigError(f"--num-processes must be >= 1, got {num_processes}")
        if not 0 <= process_id < num_processes:
            raise ConfigError(f"--process-id must be in 0..{num_processes - 1}, got {process_id}")
        if num_processes == 1:
            return None
        return Joining("flags", num_processes, coordinator, process_id)
    slurm = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID")
    if all(k in env for k in slurm):  # inside `srun` (what JAX's detection requires)
        n = _int_env(env, "SLURM_NTASKS") or 1
        if n == 1:
            return None
        ids, expect = None, None
        if slurm_tasks_on_node(env) == 1:  # one process drives every GPU of its node
            expect = node_gpus(env)
            ids = tuple(range(expect)) if expect else None
        return Joining("slurm", n, local_device_ids=ids, expect_local_devices=expect)
    if "OMPI_COMM_WORLD_SIZE" in env:
        n = _int_env(env, "OMPI_COMM_WORLD_SIZE") or 1
        return Joining("openmpi", n) if n > 1 else None
    return None


JOIN_TIMEOUT_S = 300  # jax.distributed.initialize's own default, said in the joining line


def _first(how: Joining, env: Mapping[str, str]) -> bool:
    """Whether this process is process 0, the one that prints (SLURM and Open MPI give
    the rank in the environment; JAX's detection reads the same)."""
    if how.process_id is not None:
        return how.process_id == 0
    rank = env.get("SLURM_PROCID") if how.source == "slurm" else env.get("OMPI_COMM_WORLD_RANK")
    return rank in (None, "0")


def initialize(args: argparse.Namespace | None = None, env: Mapping[str, str] | None = None):
    """Join the multi-process run this process belongs to, if any. Call it after the
    platform options are set and before anything asks JAX for devices."""
    env = os.environ if env is None else env
    how = joining(
        getattr(args, "coordinator", None),
        getattr(args, "num_processes", None),
        getattr(args, "process_id", None),
        env,
    )
    if how is None:
        return None
    if jax.distributed.is_initialized():
        return how
    try:
        if jax.config.jax_cpu_collectives_implementation in (None, "", "none"):
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except AttributeError:  # a JAX without the option: its default is what there is
        pass
    if how.process_id == 0 and how.coordinator:  # the coordinator's port, taken: XLA segfaults
        _check_port_free(how.coordinator)
    if _first(how, env):
        # until every process has joined JAX says nothing (5 minutes where one never starts)
        at = f" at {how.coordinator}" if how.coordinator else ""
        print(
            f"joining the {how.num_processes}-process run{at} ({how.source}): waiting for "
            f"every process to start (JAX gives up after {JOIN_TIMEOUT_S // 60} minutes)",
            flush=True,
        )
    try:
        jax.distributed.initialize(
            coordinator_address=how.coordinator,
            num_processes=how.num_processes,
            process_id=how.process_id,
            local_device_ids=list(how.local_device_ids) if how.local_device_ids else None,
            initialization_timeout=JOIN_TIMEOUT_S,
        )
    except (ValueError, RuntimeError) as e:
        first = (str(e).strip().splitlines() or [""])[0].rstrip(".")
        hint = "" if how.source == "flags" else "; set JAX_COORDINATOR_ADDRESS=HOST:PORT"
        raise ConfigError(
            f"could not join the {how.num_processes}-process run ({how.source}): "
            f"{first[:300]}{hint}"
        ) from None
    if how.source == "flags":
        _check_count(how)
    _check_same_software()
    return how


def software() -> str:
    """What this process runs: Python, JAX, jaxlib, and a digest of ultrajax's own source
    files (a checkout edited on one host is other code under the same version)."""
    import hashlib
    import importlib.util
    import platform
    from pathlib import Path

    import jaxlib

    root = Path(__file__).resolve().parents[1]
    kernels = importlib.util.find_spec("ultrajax.kernels")  # ../kernels, by a link or a mapping
    digest = hashlib.sha256()
    for top in [root, *[Path(p).resolve() for p in kernels.submodule_search_locations or []]]:
        for path in sorted(top.rglob("*.py")):
            digest.update(str(path.relative_to(top)).encode() + b"\0" + path.read_bytes())
    return (
        f"python {platform.python_version()}, jax {jax.__version__}, jaxlib "
        f"{jaxlib.__version__}, ultrajax source {digest.hexdigest()[:12]}"
    )


def _check_same_software() -> None:
    """Every process runs the same software as process 0: hosts with another JAX, or
    another ultrajax checkout, compile other programs for one run (a hang in the first
    collective at best, other numbers on some hosts at worst)."""
    mine = software()
    theirs = _leader_if_other("software", mine)
    if theirs is not None:
        raise ConfigError(
            f"process {_process_id()} runs other software than process 0: {mine} here, "
            f"{theirs} there; install the same on every host"
        )


def _process_id() -> int:
    """This process's id in the run, known once joined, without starting the backend."""
    from jax._src import distributed as jax_distributed

    return jax_distributed.global_state.process_id


def leader_value(name: str, value: str) -> str | None:
    """Process 0's `value` of `name`, for every other process to hold its own against (in
    the coordinator's key-value store: no backend, no collective). Process 0 gets its own
    back; None outside a multi-process run."""
    from jax._src import distributed as jax_distributed  # the client is not public API

    client = getattr(getattr(jax_distributed, "global_state", None), "client", None)
    if client is None:
        return None
    key = f"ultrajax/{name}/0"
    if jax_distributed.global_state.process_id == 0:
        client.key_value_set(key, value)
        return value
    try:
        return client.blocking_key_value_get(key, 120_000)  # ms: process 0 may be starting
    except Exception as e:  # XLA's runtime error: its deadline
        first = (str(e).strip().splitlines() or [""])[0]
        raise ConfigError(
            f"process 0 did not give its {name} within 120 s ({first[:200]}): see its log"
        ) from None


def _leader_if_other(name: str, value: str) -> str | None:
    """Process 0's `value` of `name` where it differs from this process's; else None."""
    theirs = leader_value(name, value)
    return theirs if theirs is not None and theirs != value else None


def check_same_config(text: str) -> None:
    """Every process runs process 0's config. One whose file or overrides differ (a local
    copy edited, a different command) joined and trained with its own settings: another
    learning rate on its shards, for one, without a word. `text` is the resolved config
    as YAML; the keys that differ are named."""
    theirs = _leader_if_other("config", text)
    if theirs is None:
        return
    a, b = flatten(yaml.safe_load(theirs)), flatten(yaml.safe_load(text))
    differ = [f"{k} {a.get(k)!r} vs {b.get(k)!r}" for k in sorted(a.keys() | b.keys())
              if a.get(k) != b.get(k)]  # fmt: skip
    raise ConfigError(
        f"process {_process_id()}'s config differs from process 0's: "
        f"{'; '.join(differ[:8])}{' ...' if len(differ) > 8 else ''} (process 0's value "
        "first): give every process the same config file and overrides"
    )


def check_same_data(corpora: str) -> None:
    """Every process reads the corpus process 0 reads. The config names the same path on
    every host, but a node-local copy can be another (stale, cut short): one host then
    trained on other documents. `corpora` counts each corpus's documents and names a
    prepared one's manifest digest (its shards' checksums) and the tokenizer's digest."""
    theirs = _leader_if_other("data", corpora)
    if theirs is not None:
        raise ConfigError(
            f"process {_process_id()} reads other data than process 0: {corpora} here, "
            f"{theirs} there; give every host the same copy"
        )


def _check_count(how: Joining) -> None:
    """The run has as many processes as process 0 was told: one started with another
    --num-processes joined it and ran on, believing in another run. Each process reads
    process 0's count (before the backend starts). (A process 0 told more than there are
    waits for processes that never come, until JAX's start-up times out.)"""
    theirs = _leader_if_other("num_processes", str(how.num_processes))
    if theirs is not None:
        raise ConfigError(
            f"process {how.process_id} was started with --num-processes {how.num_processes}, "
            f"but process 0 (the coordinator, {how.coordinator}) with {theirs}: give every "
            "process the same count"
        )


def _check_port_free(coordinator: str) -> None:
    """Process 0 serves the coordinator on its port (all interfaces). A port another
    program listens on made JAX's service fail to bind and the process crash (SIGSEGV)."""
    port = coordinator.rpartition(":")[2]
    if not port.isdigit():
        return  # JAX names the problem
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a TIME_WAIT port is free
        try:
            s.bind(("", int(port)))
        except OSError as e:
            raise ConfigError(
                f"the coordinator's port {port} ({coordinator}) cannot be served here "
                f"({e.strerror}): another program holds it; give another port (--coordinator "
                "HOST:PORT, or JAX_COORDINATOR_PORT under SLURM)"
            ) from None


def check_local_devices(env: Mapping[str, str] | None = None) -> None:
    """On GPU nodes with one process each: every GPU of the node must be in use.

    Call it once the backend may start (it asks for devices), not from `initialize`:
    flags read at backend start (XLA_FLAGS, train/overlap.py) are set between the two."""
    how = joining(env=env)
    if how is None or not how.expect_local_devices or jax.default_backend() != "gpu":
        return
    have = jax.local_device_count()
    if have != how.expect_local_devices:
        raise ConfigError(
            f"process {jax.process_index()} sees {have} GPU(s) but its node was given "
            f"{how.expect_local_devices}: do not set CUDA_VISIBLE_DEVICES per task; "
            "use one task per node with --gpus-per-node (see scripts/slurm/train.sbatch)"
        )


def joined() -> bool:
    """Whether this process is in a multi-process run."""
    return jax.distributed.is_initialized()


def shutdown() -> None:
    """Leave the run cleanly (a barrier with the other processes). Only on success: a
    failing process must exit at once, so the launcher can stop the others."""
    if jax.distributed.is_initialized():
        sys.stdout.flush()
        jax.distributed.shutdown()
