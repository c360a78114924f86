"""Every test runs on CPU with 8 simulated devices, set before JAX starts its backend.

Triton kernels run in Triton's interpreter, which must be chosen before triton is
first imported (kernels/triton_call.py). A GPU test starts its own process without
these settings (tests/test_triton.py).
"""

import os
import subprocess
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TRITON_INTERPRET", "1")
# 8 simulated devices share 2 cores with the other test worker's compiles: XLA:CPU aborts
# a collective whose devices' threads have not all arrived within 40 s (seen once, an
# 8-device resume under full load, alone it passes in seconds). Here a late thread is
# starvation, not a deadlock: allow 10 minutes. Also for the runs the tests start.
_TIMEOUT = "--xla_cpu_collective_call_terminate_timeout_seconds=600"
# The suite is compile-bound: XLA's lowest backend optimisation level gives the same HLO
# and buffers (what the tests read) for half the compile time (harness.FAST)
_FAST = "--xla_backend_optimization_level=0"
# ... and XLA:CPU's code generation from before its fusion emitters compiles each program
# in 0.35-0.6 of the time (the suite: 765 -> 511 s, 2026-11-28). The programs' buffers
# and collectives are the same (temporaries within a few hundred bytes); a fusion may
# round differently, so tests comparing two programs allow a few ulps, and scatters
# become loops. Tried in a child first, on what the suite compiles that it can fail: XLA
# aborts on a flag it does not know (a later jaxlib may drop this one), and on a CPU
# without AVX (--xla_cpu_max_isa=SSE4_2) this code generation cannot link fp8 casts.
_LEGACY = "--xla_cpu_use_fusion_emitters=false"
_PROBED = "ULTRAJAX_TEST_XLA_FLAGS_PROBED"  # set for the workers and runs this process starts


def _xla_accepts(flag: str) -> bool:
    env = dict(
        os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {flag}", JAX_PLATFORMS="cpu"
    )
    code = (
        "import jax, jax.numpy as jnp; f8 = lambda x: x.astype(jnp.float8_e4m3fn).astype(x.dtype)"
        "; jax.jit(f8)(jnp.ones(64)).block_until_ready()"
    )
    argv = [sys.executable, "-c", code]
    try:
        run = subprocess.run(argv, env=env, capture_output=True, timeout=300)
    except subprocess.TimeoutExpired:
        return False
    return run.returncode == 0


if _PROBED not in os.environ:
    os.environ[_PROBED] = _LEGACY if _xla_accepts(_LEGACY) else ""
for _flag in (_TIMEOUT, _FAST, os.environ[_PROBED]):
    if _flag and _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()

# XLA:CPU's thread pool: one thread per simulated device unless PJRT_NPROC says more;
# blocked collectives can exhaust it (ultrajax/cli.py, CPU_THREADS)
os.environ.setdefault("PJRT_NPROC", "32")

import jax  # noqa: E402

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)


import numpy as np  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def compile_once(tmp_path_factory):
    """One persistent compilation cache for the session, this process and the CLI runs it
    starts: the same small programs (init, step, evaluation) are compiled once, not once
    per run, however short their compile (about 90 s of the suite).

    XLA:CPU used to kill a worker now and then, inside a compile or inside
    executable.serialize() as the cache wrote an entry: the worker had run out of memory
    mappings (pytest_runtest_teardown, below, now prevents that). A test whose worker
    dies still runs once more in a fresh worker (pytest_handlecrashitem, below)."""
    cache = str(tmp_path_factory.mktemp("jax-cache"))
    settings = {
        "jax_compilation_cache_dir": cache,
        "jax_persistent_cache_min_compile_time_secs": 0,
        "jax_persistent_cache_min_entry_size_bytes": -1,
    }
    for key, value in settings.items():
        jax.config.update(key, value)
        os.environ[key.upper()] = str(value)
    yield


@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory):
    """The session's own cache directory (the CPU peak cache of ultrajax.train.peaks), for this
    process and the runs it starts: tests never write into the user's ~/.cache."""
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))
    yield


@pytest.fixture(autouse=True)
def xla_flags_restored():
    """XLA_FLAGS as it was before each test. The train command and bench_step.py add the
    GPU overlap flags to their own process's XLA_FLAGS (train/overlap.py); a test that
    calls their main in-process would hand them to the next test in its worker, and
    bench_overlap.py refuses to compare the flags with them set (seen in a full run: a
    failure that depended on which worker ran which file)."""
    before = os.environ.get("XLA_FLAGS")
    yield
    if before is None:
        os.environ.pop("XLA_FLAGS", None)
    else:
        os.environ["XLA_FLAGS"] = before


@pytest.fixture(scope="session")
def random_params():
    """make(cfg, seed) -> a parameter dict shaped like model.init_params, filled from numpy.

    Compiling `init_params` costs seconds per shape on a busy CPU; tests that only need
    some weights of the right structure build them here instead (norm scales near 1).
    """
    from ultrajax.model.llama import NORMS, init_params

    def make(cfg, seed=0, scale=1.0):
        shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
        rng = np.random.default_rng(seed)

        def leaf(path, s):
            name = path[-1].key
            if name in NORMS:
                value = 1.0 + 0.1 * rng.standard_normal(s.shape)
            else:
                fan_in = s.shape[-1] if name == "embed" else s.shape[1 if name != "lm_head" else 0]
                value = rng.standard_normal(s.shape) * scale * fan_in**-0.5
            return jax.numpy.asarray(value, s.dtype)

        return jax.tree_util.tree_map_with_path(leaf, shapes)

    return make


_CRASHES = pytest.StashKey[dict]()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's file scheduler (--dist loadfile), less a stall after a worker dies.

    When a worker dies, xdist 3.8 puts back in the queue every file the worker was ever
    given, the finished ones too. A worker handed a finished file gets no tests, and it
    holds its last test until it gets more (pytest runs a test knowing the next), so
    nothing reports again: with both workers holding one, the run waited for ever (CI,
    2026-11-27, after a worker aborted inside XLA:CPU; then here, with a debugger on the
    controller: the queue's front was 14 finished files). This scheduler leaves finished
    files out of the queue before it hands one out."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class Scheduling(LoadFileScheduling):
        def _reschedule(self, node):
            for scope in [s for s, unit in self.workqueue.items() if all(unit.values())]:
                del self.workqueue[scope]
            super()._reschedule(node)

    return Scheduling(config, log)


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched):
    """A test whose worker died runs once more in a fresh worker; a second death fails it.

    XLA:CPU killed a worker a few times in full runs (a segfault or an abort inside
    compile or executable.serialize(): out of memory mappings, pytest_runtest_teardown),
    and a hung test is ended the same way (pytest-timeout). xdist's file scheduler
    already runs the dead worker's unfinished tests again, the crashed one first; this
    marks the first crash a rerun instead of a failure. The crash stays in the summary
    (pytest_terminal_summary)."""
    crashes = sched.config.stash.setdefault(_CRASHES, {})
    crashes[crashitem] = crashes.get(crashitem, 0) + 1
    if crashes[crashitem] == 1:
        report.outcome = "rerun"
        return
    # the scheduler would run it again until its worker restarts run out: mark it done
    # (a file left with nothing to run leaves the queue: pytest_xdist_make_scheduler)
    for unit in getattr(sched, "workqueue", {}).values():
        if crashitem in unit:
            unit[crashitem] = True


def pytest_report_teststatus(report):
    if report.outcome == "rerun":
        return "rerun", "R", "RERUN"
    return None


def pytest_terminal_summary(terminalreporter):
    reruns = terminalreporter.stats.get("rerun", [])
    if reruns:
        terminalreporter.section("worker crashes, each test run again")
        for report in reruns:
            terminalreporter.line(f"{report.nodeid}: {report.longrepr}")


def _mappings() -> tuple[int, int]:
    """(this process's memory mappings, the kernel's limit on them); (0, 0) off Linux."""
    try:
        with open("/proc/self/maps") as maps, open("/proc/sys/vm/max_map_count") as limit:
            return sum(1 for _ in maps), int(limit.read())
    except OSError:
        return 0, 0


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """Past 45% of the kernel's limit on a process's memory mappings after a test file
    (80% after any test), jax's caches are emptied: a worker runs the whole suite's
    compiles in one process. Between files, the next file's tests compile little of what
    the last one kept; within a file, its tests share compiles (a full run: 2 to 3
    emptyings a worker, nearly all between files).

    XLA:CPU maps memory for each program it compiles (about 15 mappings for a small
    8-device program here) and keeps it while jax's caches hold the executable. A worker
    compiling thousands of programs reaches vm.max_map_count (65,530 by default): LLVM's
    next allocation fails ("LLVM compilation error: Cannot allocate memory") and XLA
    segfaults in the compile. That was the worker crash in full runs, at whichever test
    compiled next (seen 2026-11-28: filling the mappings to the limit then compiling
    crashes the same way). Emptying jax's caches frees the executables' mappings; what a
    later test compiles again comes from the persistent cache (compile_once)."""
    used, limit = _mappings()
    last_of_file = nextitem is None or nextitem.path != item.path
    if limit and used > (0.45 if last_of_file else 0.8) * limit:
        import gc

        jax.clear_caches()
        gc.collect()
