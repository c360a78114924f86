"""Pipeline parallelism, measured: one table per (p, m) of every schedule's bubble, the
activations it keeps, XLA's compiled memory per device and the step time, for the same
model and global batch.

    python scripts/bench_pipeline.py [--p 4] [--m 8 16] [--steps 3] [key=value ...]

Every row compiles the real train step (ultrajax.step, as `python -m ultrajax.train`
runs it) on simulated CPU devices (or the GPUs present). Columns: ticks of the schedule
table, its bubble (idle share of device-ticks) beside the formula, the bubble when the
devices advance in lockstep (`schedule.lockstep`: a tick lasts its slowest op, a
backward costing two forwards), the micro-batch
activations one device holds at once (the residual buffer's slots), XLA's temporaries
per device (activations, buffers and working set), and the median step time. A row
without pipeline (p=1, same micro-batches) is the reference. On a CPU the eight devices
share two cores, so the times say little about GPUs; the bubble and memory do.
"""

from __future__ import annotations

import argparse
import sys

from timing import median_step_ms

from ultrajax.config import parse, validate
from ultrajax.parallel.pipeline import plan as plan_lib

KINDS = (("afab", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--p", type=int, default=4)
    ap.add_argument("--m", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per row (0: compile only)")
    ap.add_argument("overrides", nargs="*", help="config key=value for every row")
    args = ap.parse_args(argv)
    import jax

    jax.config.update("jax_num_cpu_devices", max(8, args.p))
    import numpy as np

    from ultrajax.parallel.pipeline import schedules as schedule
    from ultrajax.tools import analyze
    from ultrajax.train import batch as batch_lib

    base = [
        f"model.n_layers={args.layers}",
        "model.seq_len=256",
        "train.micro_batch_size=4",
        "model.dtype=float32",
        "optim.warmup_steps=0",
        *args.overrides,
    ]
    print(f"backend {jax.default_backend()}, {jax.device_count()} devices; tiny.yaml with")
    print("  " + " ".join(base))
    head = f"{'schedule':<18}{'m':>4}{'ticks':>7}{'bubble':>8}{'formula':>9}{'lockstep':>10}"
    print(head + f"{'in flight':>11}{'temp MiB':>10}{'ms/step':>10}")
    for m in args.m:
        rows = [("no pipeline (p=1)", None, 1, [])]
        rows += [
            (kind if v == 1 else f"{kind} v={v}", kind, v, [f"mesh.pipeline={args.p}"])
            for kind, v in KINDS
        ]
        for label, kind, v, extra in rows:
            over = [f"train.grad_accum={m}", *extra]
            if kind:
                over += [f"parallel.pipeline_schedule={kind}", f"parallel.virtual_stages={v}"]
            cfg = parse.load("configs/tiny.yaml", base + over)
            n = cfg.mesh.pipeline
            validate.resolve_mesh(cfg, n)
            devices = jax.devices()[:n]
            compiled = analyze.compile_step(cfg, devices)
            temp = compiled.memory_analysis().temp_size_in_bytes
            if kind:
                plan = plan_lib.make_plan(kind, n, m, v)
                ticks, flight = plan.ticks, plan.slots["res"]
                bubble = schedule.bubble(plan.table)
                formula = schedule.formula(kind, n, m, v)
                lock = schedule.lockstep(plan.table)[1]
            else:  # one micro-batch at a time
                ticks, flight, bubble, formula, lock = m, 1, 0.0, 0.0, 0.0
            ms = float("nan")
            if args.steps:
                rng = np.random.default_rng(0)
                rows_ = m * cfg.train.micro_batch_size
                packed = batch_lib.random_packed(rows_, cfg.model.seq_len, 384, rng)
                b = batch_lib.make(packed, True, m)
                ms = median_step_ms(compiled, cfg, devices, b, args.steps)
            print(
                f"{label:<18}{m:>4}{ticks:>7}{bubble:>8.1%}{formula:>9.1%}{lock:>10.1%}{flight:>11}"
                f"{temp / 2**20:>10.1f}{ms:>10.0f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
