"""Each collective of a train step: its bytes, what it waits on, and whether anything
could run beside it; with --gpu, the 1B step timed with the collective flags on and off.

    python scripts/bench_overlap.py --config configs/tiny.yaml --cpu-devices 8 \\
        mesh.data=2 mesh.sequence=4
    python scripts/bench_overlap.py --gpu [--steps 10] [overrides ...]   # a GPU host only

The table reads the compiled step (ultrajax/tools/overlap.py; how to read it:
docs/overlap.md). The flags cannot make a collective overlap that the program makes
wait, so on simulated CPU devices the table already says which collectives a GPU's
scheduler could hide.

--gpu times bench_step.py's `1b` shape (its overrides apply on top; the mesh is
`mesh.data=-1` over every GPU unless a `mesh.` override says otherwise) twice: with
`parallel.overlap` and `parallel.pipeline_collectives` both off, then both on. XLA reads
its flags when the backend starts, so each setting runs in a process of its own. On
one GPU the step has no collectives, and the two times differ only by noise.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys

import bench_step
import jax

from ultrajax import cli
from ultrajax.config.parse import load
from ultrajax.config.schema import ConfigError, ParallelConfig
from ultrajax.config.validate import resolve_mesh
from ultrajax.parallel.axes import AXES
from ultrajax.parallel.layout import unsupported
from ultrajax.tools import analyze, overlap
from ultrajax.train import overlap as flags_lib

SETTINGS = {  # the collective flags of ultrajax/train/overlap.py, all off, then all on
    "off": ["parallel.overlap=false", "parallel.pipeline_collectives=false"],
    "on": ["parallel.overlap=true", "parallel.pipeline_collectives=true"],
}
FAST = {"xla_backend_optimization_level": 0}  # the same HLO, half the compile time
MODULES = {
    "compiled": "after this backend's passes: its combining of collectives, its schedule",
    "partitioned": "as the SPMD partitioner left it: each collective the program asks for",
}


def report(args) -> int:
    """Compile the step for the layout and print the overlap table."""
    cli.setup_devices(args)  # before anything asks JAX for devices
    cfg = cli.load_config(args)
    n, sizes = jax.device_count(), cfg.mesh.sizes().values()
    if -1 not in sizes and math.prod(sizes) < n:  # a smaller layout: the first devices
        n = math.prod(sizes)
    resolve_mesh(cfg, n)
    why = unsupported(cfg, jax.default_backend())
    if why:
        raise ConfigError(why)
    compiled, partitioned = analyze.compile_step_partitioned(cfg, jax.devices()[:n], FAST)
    mesh = {a: getattr(cfg.mesh, a) for a in AXES}
    kind, backend = jax.devices()[0].device_kind, jax.default_backend()
    print(f"devices: {n} x {kind} ({backend})")
    print("mesh: " + (", ".join(f"{a}={n}" for a, n in mesh.items() if n > 1) or "one device"))
    texts = {"compiled": compiled.as_text(), "partitioned": partitioned}
    shown = "partitioned" if args.partitioned else "compiled"
    if texts[shown] is None:
        raise ConfigError("--partitioned: one device, nothing was partitioned")
    print(f"module: {shown} ({MODULES[shown]})")
    print(overlap.table(overlap.rows(texts[shown], mesh)))
    other = "compiled" if args.partitioned else "partitioned"
    if texts[other] is not None:
        print(f"the {other} module: {overlap.summary(overlap.rows(texts[other]))}")
    return 0


def timed(setting: str, steps: int, warmup: int, overrides: list[str]) -> int:
    """The child of --gpu: the 1b step with one setting's flags, one JSON line out."""
    cfg = load(None, bench_step.size_overrides("1b", "gpu", overrides + SETTINGS[setting]))
    flags = flags_lib.apply(cfg.parallel)  # before the backend starts
    cli.setup_devices(None)
    if jax.default_backend() != "gpu":
        cli.fail(f"--gpu needs a GPU; this host's JAX backend is {jax.default_backend()}")
    row = bench_step.bench("1b", cfg, steps, warmup)
    row.update(setting=setting, devices=jax.device_count(), device=jax.devices()[0].device_kind)
    row["xla_flags"] = flags.split()
    print(json.dumps(row, default=float))
    return 0


def gpu(args) -> int:
    """Run each setting in a process of its own and print the two steps side by side."""
    ours = {f.split("=", 1)[0] for f in flags_lib.xla_flags(ParallelConfig())}
    mine = [f for f in os.environ.get("XLA_FLAGS", "").split() if f.split("=", 1)[0] in ours]
    if mine:  # they would win over both settings (overlap.apply)
        cli.fail(f"XLA_FLAGS sets {mine[0]}: unset it to compare the flags on and off")
    rows = {}
    for setting in SETTINGS:
        cmd = [sys.executable, __file__, "--timed", setting, "--steps", str(args.steps)]
        cmd += ["--warmup", str(args.warmup), *args.overrides]
        done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        if done.returncode:
            sys.exit(done.returncode)  # the child said why, on stderr
        rows[setting] = json.loads(done.stdout.strip().splitlines()[-1])
    first = rows["off"]
    print(f"device: {first['devices']} x {first['device']}; 1b: {first['layout']}")
    print(f"timing: {args.warmup} warm-up + {args.steps} timed steps, random tokens")
    print("| collective flags | XLA flags that differ | step ms | tokens/s | MFU |")
    print("|---|---|---|---|---|")
    for setting, r in rows.items():
        other = set(rows["on" if setting == "off" else "off"]["xla_flags"])
        differ = " ".join(f for f in r["xla_flags"] if f not in other)
        print(
            f"| {setting}: {' '.join(SETTINGS[setting])} | {differ} | {r['step_ms']:.1f} |"
            f" {r['tokens_per_s']:,.0f} | {r['mfu']:.1%} |"
        )
    print(f"off / on: {first['step_ms'] / rows['on']['step_ms']:.3f}")
    if first["devices"] == 1:
        print("one device: the step has no collectives, the flags have nothing to overlap")
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", help="YAML config (the table; not used by --gpu)")
    p.add_argument("--cpu-devices", type=int, default=None, metavar="N", help="simulate N CPUs")
    p.add_argument(
        "--partitioned",
        action="store_true",
        help="read the module as the partitioner left it, not the compiled one",
    )
    p.add_argument("--gpu", action="store_true", help="time the 1b step, flags off and on")
    p.add_argument("--steps", type=int, default=10, help="--gpu: timed steps (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="--gpu: untimed steps after compiling")
    p.add_argument("--timed", choices=SETTINGS, help=argparse.SUPPRESS)  # --gpu's child
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. mesh.sequence=4")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.timed:
        return timed(args.timed, args.steps, args.warmup, args.overrides)
    if args.gpu:
        if args.cpu_devices is not None:
            cli.fail("--gpu times the GPUs present: leave out --cpu-devices")
        if args.steps < 1 or args.warmup < 0:
            cli.fail("--steps must be >= 1 and --warmup >= 0")
        return gpu(args)
    if not args.config:
        cli.fail("--config is required (or --gpu)")
    return report(args)


if __name__ == "__main__":
    cli.run(main)
