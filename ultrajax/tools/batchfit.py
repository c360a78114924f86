"""Fit how the critical batch grows as the loss falls, B_crit = c * L^-alpha, from the
noise scale that training runs log, and print the batch schedule the fit implies.

    python -m ultrajax.batchfit RUN_DIR... [--plot FILE.png] [--start-tokens B] \
        [--doublings N] [--min-tokens T]

Each RUN_DIR holds a metrics.jsonl (train/metrics.py). The records used are those with
"b_simple" (the smoothed noise scale, ultrajax.noise, in tokens); their loss is
"loss_ema" when logged, else "loss". The first 10% of each run's tokens are left out by
default: the noise scale of a fresh model moves faster than its average can follow. A
resumed run appends to metrics.jsonl; records a crashed run logged past the step it
resumed from are dropped, as TensorBoard's purge drops them.

The fit is least squares on (log L, log B) pooled over the runs. Its standard errors
treat the points as independent; neighbouring records of one smoothed series are not,
so read them as lower bounds.

numpy only (matplotlib for --plot): the trainer can import the functions.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from ultrajax import cli
from ultrajax.config import parse
from ultrajax.config.schema import ConfigError

PROG = "python -m ultrajax.batchfit"
METRICS = "metrics.jsonl"
EARLY_FRACTION = 0.1  # of each run's tokens, left out unless --min-tokens says otherwise
MIN_POINTS = 3  # two parameters and one degree of freedom for their errors
MAX_DOUBLINGS = 30  # a batch 2^30 times the start: past any schedule (2^1024 overflowed)


# --------------------------------------------------------------------------- reading


def _number(record: dict, key: str, where: str) -> float:
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{where}: {key!r} must be a number, got {value!r}")
    return float(value)


def _records(path: Path) -> list[dict]:
    """The run's records in step order, a resume's rewritten steps replacing the old."""
    records: list[dict] = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{where}: not JSON ({e.msg})") from None
            if not isinstance(record, dict):
                raise ConfigError(f"{where}: not a JSON object")
            step = _number(record, "step", where)
            _number(record, "tokens", where)
            _number(record, "loss", where)
            while records and records[-1]["step"] >= step:  # resumed from an earlier step
                records.pop()
            records.append({**record, "_where": where})
    return records


def read_runs(dirs: Iterable[str | Path], min_tokens: float | None = None) -> list[dict]:
    """One dict per run directory: "dir", the kept points as parallel lists "loss",
    "b_simple", "tokens", and "tokens_per_step" (the first logged, or None), "max_loss"
    (the highest loss of a record with b_simple, early ones included), "min_tokens" (the
    cut applied), "early" and "unusable" (records with b_simple left out: before the cut,
    or a non-positive or non-finite value that has no logarithm).

    min_tokens None leaves out the first 10% of each run's tokens."""
    runs = []
    for d in dirs:
        d = Path(d)
        if not d.is_dir():
            raise ConfigError(f"{d} is not a directory")
        path = d / METRICS
        if not path.is_file():
            raise ConfigError(f"{path} does not exist (is {d} a run directory?)")
        records = _records(path)
        max_tokens = max((float(r["tokens"]) for r in records), default=0.0)
        cut = EARLY_FRACTION * max_tokens if min_tokens is None else float(min_tokens)
        run = {
            "dir": str(d),
            "loss": [],
            "b_simple": [],
            "tokens": [],
            "tokens_per_step": None,
            "max_loss": None,
            "min_tokens": cut,
            "early": 0,
            "unusable": 0,
        }
        for r in records:
            if run["tokens_per_step"] is None and r.get("tokens_per_step") is not None:
                run["tokens_per_step"] = _number(r, "tokens_per_step", r["_where"])
            if r.get("b_simple") is None:
                continue
            b = _number(r, "b_simple", r["_where"])
            key = "loss_ema" if r.get("loss_ema") is not None else "loss"
            loss = _number(r, key, r["_where"])
            if not (loss > 0 and b > 0 and math.isfinite(loss) and math.isfinite(b)):
                run["unusable"] += 1
                continue
            run["max_loss"] = loss if run["max_loss"] is None else max(run["max_loss"], loss)
            if r["tokens"] < cut:
                run["early"] += 1
                continue
            run["loss"].append(loss)
            run["b_simple"].append(b)
            run["tokens"].append(float(r["tokens"]))
        runs.append(run)
    return runs


def points(runs: Sequence[dict]) -> list[tuple[float, float]]:
    """(loss, b_simple) pooled over the runs."""
    return [p for r in runs for p in zip(r["loss"], r["b_simple"], strict=True)]


# --------------------------------------------------------------------------- the fit


def fit(points: Sequence[tuple[float, float]]) -> dict:
    """Least squares of log B = log c - alpha log L. Returns c, alpha, their standard
    errors c_se and alpha_se (c's by the delta method from log_c_se), r2 and n."""
    pts = np.asarray(list(points), dtype=np.float64).reshape(-1, 2)
    n = len(pts)
    if n < MIN_POINTS:
        raise ConfigError(f"{n} point{'s' * (n != 1)} to fit; need at least {MIN_POINTS}")
    if np.any(pts <= 0) or not np.all(np.isfinite(pts)):
        raise ConfigError("losses and critical batches must be positive and finite")
    x, y = np.log(pts[:, 0]), np.log(pts[:, 1])
    design = np.stack([np.ones(n), x], axis=1)
    xtx = design.T @ design
    if np.ptp(x) == 0 or np.linalg.cond(xtx) > 1e12:
        raise ConfigError(f"all {n} points have the same loss: no slope to fit")
    coef = np.linalg.solve(xtx, design.T @ y)
    resid = y - design @ coef
    rss = float(resid @ resid)
    tss = float(((y - y.mean()) ** 2).sum())
    cov = rss / (n - 2) * np.linalg.inv(xtx)
    log_c, slope = float(coef[0]), float(coef[1])
    log_c_se, alpha_se = float(math.sqrt(cov[0, 0])), float(math.sqrt(cov[1, 1]))
    c = math.exp(log_c)
    return {
        "c": c,
        "alpha": -slope,
        "c_se": c * log_c_se,
        "alpha_se": alpha_se,
        "log_c": log_c,
        "log_c_se": log_c_se,
        "r2": 1.0 - rss / tss if tss > 0 else float("nan"),
        "n": n,
    }


def thresholds(fit: dict, start_tokens: float, doublings: int) -> list[float]:
    """The losses L_k at which the fitted critical batch reaches start_tokens * 2^k,
    k = 1..doublings: L_k = (c / (start_tokens * 2^k))^(1/alpha), falling with k."""
    if not fit["alpha"] > 0:
        raise ConfigError(
            f"the fitted critical batch does not grow as the loss falls (alpha = "
            f"{fit['alpha']:.3g}): no schedule to derive"
        )
    if not start_tokens > 0:
        raise ConfigError(f"--start-tokens must be positive, got {start_tokens}")
    return [
        (fit["c"] / (start_tokens * 2**k)) ** (1.0 / fit["alpha"]) for k in range(1, doublings + 1)
    ]


def schedule(
    losses: Sequence[float], start_tokens: int, max_loss: float | None, min_fitted=None
) -> tuple[list[dict], list[str]]:
    """The train.batch_schedule entries and a note for each threshold left out: one above
    the highest loss seen is passed before the noise scale could be measured. A threshold
    below the lowest loss fitted (`min_fitted`) is kept, with a note: the law is carried
    past the points it was fitted on."""
    entries, notes, beyond = [], [], []
    for k, loss in enumerate(losses, 1):
        tokens = int(start_tokens * 2**k)
        if max_loss is not None and loss > max_loss:
            notes.append(
                f"{tokens:,} tokens per step from loss {loss:.3f}: left out, above the "
                f"highest loss seen ({max_loss:.3f}), so already passed; a larger "
                f"--start-tokens starts there"
            )
            continue
        if min_fitted is not None and loss < min_fitted:
            beyond.append(f"{loss:.3f}")
        entries.append({"tokens_per_step": tokens, "from_loss": round(loss, 3)})
    if beyond:
        notes.append(
            f"from loss {', '.join(beyond)}: below the lowest loss fitted ({min_fitted:.3f}), "
            "so the law is extrapolated there; runs that reach those losses test it"
        )
    return entries, notes


def _unit_notes(entries: Sequence[dict], run_dir: Path) -> list[str]:
    """A note when the entries are batches the trainer refuses in the run's own layout:
    train.batch_schedule grows the batch by accumulation, so each must be a multiple of
    micro_batch_size x dp x seq_len of its config.yaml (the resolved one, mesh filled).
    A note, not an error: the schedule may be meant for another layout."""
    try:
        cfg = parse.load(run_dir / "config.yaml")
    except (ConfigError, OSError):  # no config.yaml (metrics copied alone), or unreadable
        return []
    if -1 in cfg.mesh.sizes().values():
        return []
    unit = cfg.micro_tokens
    off = [e["tokens_per_step"] for e in entries if e["tokens_per_step"] % unit]
    if not off:
        return []
    return [
        f"{', '.join(f'{t:,}' for t in off)} tokens per step {'is' if len(off) == 1 else 'are'} "
        f"not a multiple of micro_batch_size x dp x seq_len = {unit:,} tokens in "
        f"{run_dir}/config.yaml: that layout refuses such a train.batch_schedule entry "
        "(choose --start-tokens as a multiple of it)"
    ]


def override(entries: Sequence[dict]) -> str:
    """The entries as a ready-to-paste key=value override, YAML flow style."""
    items = ", ".join(
        f"{{tokens_per_step: {e['tokens_per_step']}, from_loss: {e['from_loss']!r}}}"
        for e in entries
    )
    return f"train.batch_schedule='[{items}]'"


# --------------------------------------------------------------------------- output


def _plot(runs: Sequence[dict], f: dict, entries: Sequence[dict], path: str) -> None:
    """Log-log scatter of each run's (loss, b_simple), the fitted line, the schedule."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import FuncFormatter
    except ImportError:
        raise ConfigError('--plot needs matplotlib: pip install -e ".[plot]"') from None
    fig = Figure(figsize=(7, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for r in runs:
        if r["loss"]:
            ax.scatter(r["loss"], r["b_simple"], s=8, alpha=0.6, label=Path(r["dir"]).name)
    all_loss = [x for r in runs for x in r["loss"]]
    grid = np.geomspace(min(all_loss), max(all_loss), 100)
    ax.plot(
        grid,
        f["c"] * grid ** -f["alpha"],
        color="black",
        label=f"B = {f['c']:.3g} L^-{f['alpha']:.3g}",
    )
    ax.set_xscale("log")
    ax.set_yscale("log")
    for e in entries:
        ax.axvline(e["from_loss"], color="gray", linestyle=":", linewidth=1)
        ax.annotate(
            f" {e['tokens_per_step']:,}",
            (e["from_loss"], 0.99),
            xycoords=("data", "axes fraction"),
            va="top",
            fontsize=7,
            color="gray",
        )
    plain = FuncFormatter(lambda v, _: f"{v:g}")  # losses read better as 3 than as 3x10^0
    ax.xaxis.set_major_formatter(plain)
    ax.xaxis.set_minor_formatter(plain)
    ax.set_xlabel("training loss")
    ax.set_ylabel("critical batch B_simple (tokens)")
    ax.invert_xaxis()  # training runs left to right
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parser() -> argparse.ArgumentParser:

    p = cli.ArgumentParser(  # argparse errors as one line, exit status 2, like every ultrajax tool
        prog=PROG,
        description="Fit B_crit = c * L^-alpha to the noise scale that runs logged and "
        "print the train.batch_schedule it implies.",
    )
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="directories with metrics.jsonl")
    p.add_argument("--plot", metavar="FILE.png", help="draw the points and the fit")
    p.add_argument(
        "--start-tokens",
        type=int,
        default=None,
        metavar="B",
        help="tokens per step the schedule starts from (default: the first run's)",
    )
    p.add_argument(
        "--doublings",
        type=int,
        default=3,
        metavar="N",
        help="schedule entries: the critical batch at 2x, 4x, ... the start (default 3)",
    )
    p.add_argument(
        "--min-tokens",
        type=float,
        default=None,
        metavar="T",
        help="leave out records before T tokens (default: each run's first 10%%)",
    )
    return p


def _too_few(pts, runs: Sequence[dict], min_tokens: float | None) -> str:
    """Too few points to fit, and why: records with b_simple before the cut, or with a
    value that has no logarithm (a run whose every b_simple was negative read as if it
    had logged none)."""
    cut = "each run's first 10%" if min_tokens is None else "--min-tokens"
    unusable = sum(r["unusable"] for r in runs)
    why = f", and {unusable} more not positive or not finite (no logarithm)" if unusable else ""
    return (
        f"{len(pts)} record{'s' * (len(pts) != 1)} with b_simple past {cut} of tokens in "
        f"{len(runs)} run{'s' * (len(runs) != 1)}{why}; need at least {MIN_POINTS} (train "
        "longer, or lower --min-tokens)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """The command line. Errors: one line, exit status 2."""

    args = parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        cli.check_picture(args.plot, "--plot")
        if not 1 <= args.doublings <= MAX_DOUBLINGS:
            raise ConfigError(f"--doublings must be in 1..{MAX_DOUBLINGS}, got {args.doublings}")
        runs = read_runs(args.runs, args.min_tokens)
        pts = points(runs)
        if len(pts) < MIN_POINTS:
            raise ConfigError(_too_few(pts, runs, args.min_tokens))
        f = fit(pts)
        start = args.start_tokens
        if start is None:
            start = runs[0]["tokens_per_step"]
            if start is None:
                raise ConfigError(
                    f"{runs[0]['dir']}/{METRICS} logs no tokens_per_step: pass --start-tokens"
                )
        losses = thresholds(f, start, args.doublings)
        seen = [r["max_loss"] for r in runs if r["max_loss"] is not None]
        lowest = min(loss for loss, _ in pts)
        entries, notes = schedule(losses, int(start), max(seen) if seen else None, lowest)
        notes += _unit_notes(entries, Path(runs[0]["dir"]))
        if args.plot:
            _plot(runs, f, entries, args.plot)
    except ConfigError as e:
        cli.fail(str(e))
    used = [r for r in runs if r["loss"]]
    print(f"fit B_crit = c * L^-alpha over {f['n']} points from {len(used)} of {len(runs)} runs:")
    for r in runs:
        left = f"; left out {r['early']} before {r['min_tokens']:,.0f} tokens"
        left += f", {r['unusable']} not positive or not finite" if r["unusable"] else ""
        print(f"  {r['dir']}: {len(r['loss'])} points{left}")
    log_c = f"log c = {f['log_c']:.4f} ± {f['log_c_se']:.2g}"
    print(f"  c     = {f['c']:.4g} ± {f['c_se']:.2g}  ({log_c})")
    print(f"  alpha = {f['alpha']:.4f} ± {f['alpha_se']:.2g}")
    print(f"  R^2   = {f['r2']:.4f}  (errors assume independent points: lower bounds)")
    print(f"schedule from {int(start):,} tokens per step, {args.doublings} doublings:")
    for note in notes:
        print(f"  note: {note}")
    for e in entries:
        print(f"  {e['tokens_per_step']:,} tokens per step from loss {e['from_loss']:.3f}")
    if entries:
        print(override(entries))
    else:
        print("no schedule entry: every threshold is above the highest loss seen")
    if args.plot:
        print(f"plot: {args.plot}")
    return 0
