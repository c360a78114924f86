"""DiLoCo against data parallelism on the tiny model, at the same tokens (docs/diloco.md).

    python scripts/diloco_tiny.py [--runs runs/diloco-tiny] [--plot docs/diloco/tiny.png]

Trains configs/tiny.yaml on 8 simulated CPU devices, data=2 x fsdp=4 (2 replicas under
DiLoCo), micro-batch 1 x 2 accumulated: the tiny run's global batch of 16 sequences in
every run. One run of data parallelism, then DiLoCo at H = 4 and 16, each with the
paper's outer step (lr 0.7, Nesterov 0.9) and with plain averaging (lr 1, no momentum),
and streaming DiLoCo at H = 4 in 2 fragments with averaging.
A run whose metrics.jsonl is already in --runs is read, not trained again. Prints the
final eval losses against data parallelism's and draws the eval curves.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import tiny_runs

COMMON = [
    "--config", "configs/tiny.yaml", "--cpu-devices", "8", "mesh.data=2", "mesh.fsdp=4",
    "train.micro_batch_size=1", "train.grad_accum=2", "train.eval_every=25",
    "train.log_every=25",
]  # fmt: skip
RUNS = {
    "data parallelism": [],
    "H=4, outer 0.7 / Nesterov 0.9": ["parallel.diloco_steps=4"],
    "H=4, averaging (outer 1, no momentum)": [
        "parallel.diloco_steps=4", "parallel.diloco_outer_lr=1", "parallel.diloco_outer_momentum=0"
    ],
    "H=4, 2 fragments (streaming), averaging": [
        "parallel.diloco_steps=4", "parallel.diloco_fragments=2", "parallel.diloco_outer_lr=1",
        "parallel.diloco_outer_momentum=0",
    ],
    "H=16, outer 0.7 / Nesterov 0.9": ["parallel.diloco_steps=16"],
    "H=16, averaging (outer 1, no momentum)": [
        "parallel.diloco_steps=16", "parallel.diloco_outer_lr=1", "parallel.diloco_outer_momentum=0"
    ],
}  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", default="runs/diloco-tiny", help="where the runs are kept")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="the eval curves")
    args = p.parse_args(argv)
    curves = tiny_runs.compare(Path(args.runs), COMMON, RUNS, "data parallelism")
    if args.plot:
        xlabel = "step (16 sequences of 256 tokens each, in every run)"
        title = "tiny, 8 CPU devices: DiLoCo (2 replicas) against data parallelism"
        tiny_runs.plot(curves, args.plot, xlabel, title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
