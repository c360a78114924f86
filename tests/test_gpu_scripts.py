"""The one-call GPU scripts ask only for what exists: every Python command that
scripts/gpu_check.sh (every part), bench_gpu.sh (every run), gpu_fp8.sh and
gpu_check_step.sh would start on a GPU machine parses its flags, its config overrides
load, and its XLA flags are ones XLA knows.

A GPU comes for minutes, at times; a flag renamed since the last lease costs that call.
So the shell scripts run here with `python3`, `timeout` and `nvidia-smi` replaced: python3
only records its arguments and XLA_FLAGS. Each recorded command is then parsed here, not
run: argparse's parse_args is stopped once it has parsed."""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

RECORD = "import json, os, sys\n" + (
    "with open(os.environ['DRY_LOG'], 'a') as f:\n"
    "    f.write(json.dumps({'argv': sys.argv[1:], 'xla': os.environ.get('XLA_FLAGS', '')}))\n"
    "    f.write('\\n')\n"
)


def dry_run(tmp_path: Path, script: str, **env) -> list[dict]:
    """Run scripts/`script` in a scratch directory holding links to scripts/ and tests/,
    with the stand-ins first on PATH; the python3 commands it would have run."""
    work, stand_ins = tmp_path / "work", tmp_path / "bin"
    for d in (work / "ultrajax", stand_ins):
        d.mkdir(parents=True, exist_ok=True)
    for name in ("scripts", "tests"):
        (work / name).symlink_to(ROOT / name)
    (tmp_path / "record.py").write_text(RECORD)
    tools = {
        "python3": f'exec "{sys.executable}" "{tmp_path / "record.py"}" "$@"',
        "timeout": 'shift; exec "$@"',  # timeout LIMIT COMMAND...
        "nvidia-smi": "echo 'a stand-in GPU, 0 MiB, 0'",
    }
    for name, body in tools.items():
        (stand_ins / name).write_text(f"#!/bin/sh\n{body}\n")
        (stand_ins / name).chmod(0o755)
    log = tmp_path / "calls.jsonl"
    log.write_text("")
    full = {
        **os.environ,
        "PATH": f"{stand_ins}{os.pathsep}{os.environ['PATH']}",
        "DRY_LOG": str(log),
        "BUDGET": "100000",  # no part skipped for time
        **env,
    }
    full.pop("XLA_FLAGS", None)  # the test run's own CPU flags are not the scripts'
    done = subprocess.run(
        ["bash", f"scripts/{script}", str(tmp_path / "out")],
        cwd=work,
        env=full,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "skipped" not in done.stdout, done.stdout
    return [json.loads(line) for line in log.read_text().splitlines()]


class Parsed(Exception):
    """Raised by the stopped parse_args with what it parsed."""


def parse(script: str, args: list[str], monkeypatch) -> argparse.Namespace:
    """`args` as scripts/`script`'s main parses them (SystemExit on a flag it lacks)."""
    module = importlib.import_module(Path(script).stem)
    original = argparse.ArgumentParser.parse_args

    def stop(self, argv=None, namespace=None):
        raise Parsed(original(self, argv, namespace))

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", stop)
        m.setattr(sys, "argv", [script, *args])
        try:
            module.main(args) if inspect.signature(module.main).parameters else module.main()
        except Parsed as p:
            return p.args[0]
    raise AssertionError(f"{script}'s main returned without parsing its arguments")


def overrides_load(script: str, ns: argparse.Namespace) -> None:
    """A step script's config overrides make a valid config for each size it names."""
    import bench_step

    from ultrajax.config.parse import load

    sizes = ns.sizes.split(",") if script.endswith("bench_step.py") else [ns.size]
    for size in sizes:
        load(None, bench_step.size_overrides(size, "gpu", ns.overrides))


def xla_accepts(flags: set[str]) -> None:
    """XLA aborts the process on a flag it does not know (this jaxlib's XLA; a GPU image
    with a later one may know more, rarely fewer)."""
    env = {**os.environ, "XLA_FLAGS": " ".join(sorted(flags)), "JAX_PLATFORMS": "cpu"}
    code = "import jax.numpy as jnp; jnp.zeros(2).block_until_ready()"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[:1500]


CASES = {  # script, its environment, the scripts it must start (at least), XLA flags set
    "gpu_check": (
        "gpu_check.sh",
        {"PARTS": "all"},
        {
            "check_flash_gpu",
            "bench_attention",
            "bench_step",
            "torch_step",
            "bench_norm",
            "profile_step",
            "check_moe_gpu",
            "step_table",
        },
        3,  # the flags part's
    ),  # fmt: skip
    "bench_gpu": ("bench_gpu.sh", {}, {"bench_step", "torch_step", "step_table"}, 0),
    "gpu_fp8": ("gpu_fp8.sh", {}, {"bench_step"}, 0),
    "gpu_check_step": ("gpu_check_step.sh", {}, {"bench_step"}, 0),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_gpu_script_commands_parse(case, tmp_path, monkeypatch):
    script, env, expected, n_flags = CASES[case]
    calls = dry_run(tmp_path, script, **env)
    flags = {flag for call in calls for flag in call["xla"].split()}
    assert len(flags) >= n_flags, flags
    if flags:
        xla_accepts(flags)
    started, checked = set(), 0
    for call in calls:
        argv = call["argv"]
        if not argv or argv[0] == "-":  # `python3 -` reading a heredoc: the versions
            continue
        if argv[:2] == ["-m", "pytest"]:  # the norm's GPU tests: a file and names that exist
            path = next(a for a in argv if a.startswith("tests/"))
            names = re.findall(r"def (test_\w+)", (ROOT / path).read_text())
            words = argv[argv.index("-k") + 1].split(" or ")
            assert any(w in n for w in words for n in names), (path, words)
            continue
        if argv[:2] == ["-m", "pip"]:
            continue
        path = Path(argv[0])
        assert path.parts[0] == "scripts" and (ROOT / path).is_file(), argv
        started.add(path.stem)
        if path.stem == "step_table":  # OUT_DIR and the runs, positional
            assert len(argv) == 3, argv
            continue
        ns = parse(str(path), argv[1:], monkeypatch)
        if path.stem in ("bench_step", "profile_step"):
            overrides_load(str(path), ns)
        checked += 1
    assert expected <= started, expected - started
    assert checked >= len(expected) - 1
