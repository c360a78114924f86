"""Runs of the tiny model side by side: each trained once into its own directory (a run
whose metrics.jsonl is there is read, not trained again), the final eval losses printed
against a baseline run's, and the eval curves drawn. scripts/diloco_tiny.py and
scripts/fp8_tiny.py are its tables of runs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path


def run_dir(runs: Path, name: str) -> Path:
    """A run's directory, named after it."""
    return runs / re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def _check_kept(where: Path, args: list[str]) -> None:
    """A run kept in `where` must be the one `args` would train (the same run identity:
    model, data, optimizer, seed); another (a seed of another call) is an error, not read."""
    from ultrajax import cli
    from ultrajax.config import parse

    asked = cli.parser("ultrajax.train", "").parse_args(args)  # the train command's own
    want = parse.run_identity(parse.load(asked.config, asked.overrides))
    have = parse.run_identity(parse.load(where / "config.yaml"))
    if want != have:
        raise SystemExit(
            f"error: {where} holds a run of other settings (identity {have}, asked for "
            f"{want}): remove it, or give another --runs"
        )


def evals(run: Path) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    return [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]


def compare(runs: Path, common: list[str], table: dict[str, list[str]], base: str) -> dict:
    """{name: eval curve} of every run in `table` (trained with `common` + its own
    overrides where it has no metrics yet), and a markdown table of the final eval
    losses against `base`'s, printed."""
    curves = {}
    for name, extra in table.items():
        where = run_dir(runs, name)
        if (where / "metrics.jsonl").is_file():
            _check_kept(where, [*common, *extra])
        else:
            cmd = [sys.executable, "-m", "ultrajax.train", *common, *extra]
            subprocess.run([*cmd, f"train.run_dir={where}"], check=True)
        curves[name] = evals(where)
    reference = curves[base][-1][1]
    print(f"| run | final eval loss | against {base} |")
    print("|---|---|---|")
    for name, points in curves.items():
        step, loss = points[-1]
        print(f"| {name} | {loss:.4f} (step {step}) | {loss / reference - 1:+.1%} |")
    return curves


def plot(curves: dict, path: str, xlabel: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, points in curves.items():
        ax.plot(*zip(*points, strict=True), marker="o", ms=3, label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("eval loss")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")
