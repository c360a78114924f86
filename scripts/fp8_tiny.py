"""FP8 against bf16 on the tiny model, 300 steps, same data and seed (docs/fp8.md).

    python scripts/fp8_tiny.py [--runs runs/fp8-tiny] [--plot docs/fp8/tiny.png] [--seeds 0,1,2]

Trains configs/tiny.yaml in bf16 for 300 steps (evaluated every 25), once without FP8
and once per recipe (model.fp8=tensorwise, rowwise, delayed). A run whose metrics.jsonl is
already in --runs is read, not trained again. Prints each final eval loss against
bf16's (issue 30 asks for parity within 1.5%) and draws the eval curves.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import tiny_runs

COMMON = [
    "--config", "configs/tiny.yaml", "model.dtype=bfloat16", "train.steps=300",
    "train.eval_every=25", "train.log_every=25",
]  # fmt: skip
RUNS = {
    "bf16": [],
    "fp8 tensorwise": ["model.fp8=tensorwise"],
    "fp8 rowwise": ["model.fp8=rowwise"],
    "fp8 delayed": ["model.fp8=delayed"],
}
WITHIN = 0.015  # of bf16's final eval loss


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", default="runs/fp8-tiny", help="where the runs are kept")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="the eval curves")
    p.add_argument(
        "--seeds", default="0", help="train.seed values, comma-separated: each its own runs "
        "(in --runs/seed-N but for seed 0 alone), then each recipe's gap over them"
    )  # fmt: skip
    args = p.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    gaps: dict[str, list[float]] = {}
    first = None
    for seed in seeds:
        runs = Path(args.runs) if seeds == [0] else Path(args.runs) / f"seed-{seed}"
        common = COMMON + ([f"train.seed={seed}"] if seed else [])
        curves = tiny_runs.compare(runs, common, RUNS, "bf16")
        first = first or curves
        base = curves["bf16"][-1][1]
        for name, points in curves.items():
            gap = points[-1][1] / base - 1  # either way: parity, not only "no worse"
            gaps.setdefault(name, []).append(gap)
            verdict = "within" if abs(gap) <= WITHIN else "NOT within"
            said = f"{name}: {gap:+.2%} of bf16's final eval loss, {verdict} ±{WITHIN:.1%}"
            print(said if len(seeds) == 1 else f"seed {seed}: {said}")
    if len(seeds) > 1:
        for name, each in gaps.items():
            mean = sum(each) / len(each)
            verdict = "within" if abs(mean) <= WITHIN else "NOT within"
            print(f"{name} over seeds {args.seeds}: mean {mean:+.2%} ({min(each):+.2%} to "
                  f"{max(each):+.2%}), {verdict} ±{WITHIN:.1%}")  # fmt: skip
    if args.plot:
        xlabel = "step (16 sequences of 256 tokens each, in every run)"
        title = f"tiny on a CPU, bf16, seed {seeds[0]}: FP8 matmuls against bf16"
        tiny_runs.plot(first, args.plot, xlabel, title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
