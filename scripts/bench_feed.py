"""The trainer against the bare step on one shape: how much of the device the loop around
the step (data, placement, logging) leaves idle. Issue 14's target is 97% on a GPU.

    python scripts/bench_feed.py                       # CPU: configs/tiny.yaml's shape
    python scripts/bench_feed.py --size 1b --steps 30  # GPU: the 1B shape, micro-batch 8

It prepares a bytes corpus from this interpreter's standard library (once, into
--data-dir), trains `--steps` steps from it with `python -m ultrajax.train`, reads the
median tokens/s of the log intervals after the first, then times the same step fed
random batches already on the device (`bench_step.py`), and prints both with the ratio.
Nothing is asserted: a benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SIZES = {  # size: (bench_step size, overrides of both runs)
    "tiny": ("tiny", ["train.grad_accum=2", "model.scan_unroll=4"]),
    "1b": ("1b", ["train.micro_batch_size=8", "model.remat=none", "model.attention=auto"]),
}


def _run(cmd: list[str]) -> str:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"error: {' '.join(cmd[:4])} ... exited {out.returncode}:\n{out.stderr[-2000:]}")
    return out.stdout


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="tiny", choices=sorted(SIZES))
    p.add_argument("--steps", type=int, default=40, help="trainer steps (default 40)")
    p.add_argument("--data-dir", default=str(Path(tempfile.gettempdir()) / "ultrajax-feed"))
    p.add_argument("overrides", nargs="*", help="config overrides for both runs")
    args = p.parse_args(argv)
    size, shape = SIZES[args.size]
    overrides = [*shape, *args.overrides]
    shards = Path(args.data_dir) / "stdlib-bytes"
    if not (shards / "manifest.json").exists():
        stdlib = sysconfig.get_paths()["stdlib"]
        _run([sys.executable, "-m", "ultrajax.data", "prepare", "--input", f"{stdlib}/*.py",
              "--tokenizer", "bytes", "--out", str(shards)])  # fmt: skip

    sys.path.insert(0, str(ROOT / "scripts"))
    import jax
    from bench_step import size_overrides

    platform = jax.default_backend()
    cfg_overrides = size_overrides(size, platform, overrides)
    run_dir = Path(args.data_dir) / f"run-{args.size}-{os.getpid()}"
    log_every = max(args.steps // 10, 1)
    base = Path(args.data_dir) / "defaults.yaml"  # bench_step's base: the defaults
    base.write_text("{}\n")
    train = [sys.executable, "-m", "ultrajax.train", "--config", str(base), *cfg_overrides]
    train += [f"train.steps={args.steps}", f"train.log_every={log_every}", "train.eval_batches=0"]
    train += ["data.source=prepared", f"data.path={shards}", f"train.run_dir={run_dir}"]
    _run([*train, "checkpoint.resume=never"])
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    trainer = statistics.median(r["tokens_per_s"] for r in records[2:] or records)
    shutil.rmtree(run_dir, ignore_errors=True)  # its final checkpoint: the whole state
    out = _run([sys.executable, "scripts/bench_step.py", "--sizes", size, "--steps", "10",
                "--warmup", "2", *overrides])  # fmt: skip
    row = [line for line in out.splitlines() if line.startswith(f"| {size} |")][-1]
    step = float(row.strip("|").split("|")[5].replace(",", ""))
    print(f"device: {jax.devices()[0].device_kind} ({platform}); shape {args.size}; "
          f"overrides {' '.join(overrides)}")  # fmt: skip
    print("| run | tokens/s |")
    print("|---|---|")
    print(f"| bare step (bench_step.py, random batches on the device) | {step:,.0f} |")
    print(f"| trainer, prepared data, {args.steps} steps (median of log intervals) | "
          f"{trainer:,.0f} |")  # fmt: skip
    print(f"trainer / bare step: {trainer / step:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
