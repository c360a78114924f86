"""The planner's models against the Ultra-Scale Playbook's benchmark sweep.

    python scripts/validate_planner.py FILE.csv [--fit] [--cells]

FILE.csv has the sweep's columns (model,nodes,gpus,dp,tp,pp,gas,mbs,zero,status,
tok_s_gpu,mem_gb,...; ../shared/playbook_runs/README.md): nanotron runs on H100 nodes
of 8. For every run it predicts whether the layout runs (memory within the GPU, a
pipeline the framework can build) and its tokens/s per GPU (ultrajax/cost/steptime.py with
the NANOTRON constants, nanotron's mesh order), and prints three figures:

  verdict agreement   share of runs whose fits / does-not-fit verdict matches `status`
  Spearman            rank correlation of predicted and measured tokens/s among the runs
                      that ran, per (model, nodes) cell; the mean over cells of 5+ runs
  median error        median |predicted / measured - 1| of tokens/s per GPU

nanotron's memory is not ultrajax's (bf16 weights beside fp32 master weights, fp32
gradient accumulators, its own activation layout), so the verdict here uses a
framework adjustment: a linear model of nanotron's peak in five per-device quantities and a constant
(MEMORY below, fitted by least squares on the calibration file's runs that ran,
`--fit` refits it and the step-time constants and prints both). ultrajax's own planner
verdict is memory.estimate's (python -m ultrajax.plan); docs/planner.md.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ultrajax.config.schema import Config, ConfigError, ModelConfig  # noqa: E402
from ultrajax.cost import (
    hardware,
    steptime,  # noqa: E402
)

# the sweep's model shapes (../shared/playbook_runs/README.md): d_model, layers, heads
# (= kv heads), d_ff, tied embeddings; vocabulary 128,256
SHAPES = {
    "1.34B": (2048, 16, 32, 8192, True),
    "3.57B": (3072, 28, 24, 8192, True),
    "8.86B": (4096, 32, 32, 14336, False),
    "80B": (8192, 80, 64, 28672, False),
}
VOCAB = 128256
GPU = "h100"
GPUS_PER_NODE = 8
# nanotron's process grid: pipeline slowest, then data, tensor fastest
NANOTRON_ORDER = ("pipeline", "data", "fsdp", "sequence", "tensor")

# nanotron's peak bytes per device = coefficients . (params held, params / ZeRO shards,
# b·s·h/tp x layers in flight, b·s·d_ff/tp x layers in flight, b·s·vocab/tp logits, 1),
# the larger of the first and last pipeline stage; --fit prints these
MEMORY = (6.094, 11.56, 34.96, 5.038, 8.895, 2.475e9)
MEMORY_LIMIT = 74e9  # bytes: the verdict's threshold (fitted; the H100 holds 85.5e9)
FIT_ITERS = 2000  # Nelder-Mead iterations of a step-time fit
FIT_RESTARTS = 2  # Nelder-Mead restarted from its result this many times (a fresh simplex)


@dataclass
class Run:
    row: dict
    cfg: Config | None  # None: a layout the framework cannot build
    why: str = ""

    @property
    def ran(self) -> bool:
        return self.row["status"] == "ok"

    @property
    def measured(self) -> float:
        return float(self.row["tok_s_gpu"])


def model_config(name: str, seq_len: int) -> ModelConfig:
    if name not in SHAPES:
        raise ConfigError(f"model {name!r}: unknown shape (known: {', '.join(SHAPES)})")
    h, layers, heads, d_ff, tied = SHAPES[name]
    return ModelConfig(
        vocab_size=VOCAB,
        d_model=h,
        n_layers=layers,
        n_heads=heads,
        n_kv_heads=heads,
        d_ff=d_ff,
        seq_len=seq_len,
        tie_embeddings=tied,
        dtype="bfloat16",
        param_dtype="float32",
        remat="none",
        attention="cudnn",  # flash attention: nanotron's
    )


def run_config(row: dict) -> Run:
    """The sweep's row as an ultrajax Config: ZeRO-1 runs shard over fsdp, ZeRO-0 runs are
    pure replicas over data; TP with sequence parallelism (nanotron's reduce-scatter
    mode); nanotron's 1F1B."""
    try:
        dp, tp, pp, gas, mbs, zero = (int(row[k]) for k in ("dp", "tp", "pp", "gas", "mbs", "zero"))
        seq = int(row.get("seq_len") or 4096)
    except (KeyError, ValueError) as e:
        raise ConfigError(f"row {row}: {e}") from None
    cfg = Config()
    cfg.model = model_config(row["model"], seq)
    cfg.mesh.tensor, cfg.mesh.pipeline = tp, pp
    cfg.mesh.fsdp, cfg.mesh.data = (dp, 1) if zero else (1, dp)
    cfg.parallel.zero = zero
    cfg.parallel.sequence_parallel = tp > 1
    cfg.train.micro_batch_size, cfg.train.grad_accum = mbs, gas
    # nanotron builds more than ultrajax does (uneven stages, fewer micro-batches than
    # stages, tensor sizes that do not divide the heads), but not a stage without a
    # layer, and a stage of one layer crashed in 35 of the calibration's 40 such runs
    if pp >= cfg.model.n_layers:
        return Run(row, None, f"pipeline {pp} >= {cfg.model.n_layers} layers")
    # nor 1F1B with fewer than p - 1 micro-batches: its engine asserts m >= p - 1
    # (OneForwardOneBackwardPipelineEngine.train_batch_iter); all 125 such runs crashed
    if pp > 1 and gas < pp - 1:
        return Run(row, None, f"1F1B needs {pp - 1} micro-batches, has {gas}")
    return Run(row, cfg)


def memory_features(cfg: Config) -> np.ndarray:
    """Per-device quantities of nanotron's peak, (first stage, last stage) x 6. Its stages
    are balanced by compute with the LM head as one block (steptime's `balanced`): the
    last stage holds the head and the layers that fit beside it, the others share the
    rest."""
    m, mesh, t = cfg.model, cfg.mesh, cfg.train
    h, f, v = m.d_model, m.d_ff, m.vocab_size
    tp, pp = mesh.tensor, mesh.pipeline
    layer = 2 * h * m.hd * (m.n_heads + m.n_kv_heads) + 3 * h * f + 2 * h
    embed = v * h / tp
    L = m.n_layers
    if pp == 1:
        first_layers = last_layers = L
    else:
        share = (L * layer + v * h) / pp  # a stage's share of the matmul weights
        last_layers = min(L, max(0, round((share - v * h) / layer)))
        first_layers = math.ceil((L - last_layers) / (pp - 1))
    first = first_layers * layer / tp + embed
    last = last_layers * layer / tp + (embed if (not m.tie_embeddings or pp > 1) else 0) + h
    if pp == 1:
        first = last = L * layer / tp + embed * (1 if m.tie_embeddings else 2)
    shards = mesh.fsdp if cfg.parallel.zero else 1
    tokens = t.micro_batch_size * m.seq_len
    rows = []
    for stage, params, layers in (("first", first, first_layers), ("last", last, last_layers)):
        in_flight = min(pp, t.grad_accum) if (stage == "first" and pp > 1) else 1
        logits = tokens * v / tp if (stage == "last" or pp == 1) else 0.0
        rows.append(
            [
                params,
                params / shards,
                in_flight * layers * tokens * h / tp,
                in_flight * layers * tokens * f / tp,
                logits,
                1.0,
            ]
        )
    return np.array(rows)


def nanotron_memory(cfg: Config, coef=MEMORY) -> float:
    return float((memory_features(cfg) @ np.asarray(coef)).max())


def load(path: str) -> list[Run]:
    try:
        with open(path, newline="") as fh:
            rows = list(csv.DictReader(fh))
    except OSError as e:
        raise ConfigError(f"{path}: {e.strerror or e}") from None
    need = {"model", "nodes", "dp", "tp", "pp", "gas", "mbs", "zero", "status", "tok_s_gpu"}
    if not rows or need - set(rows[0]):
        missing = sorted(need - set(rows[0])) if rows else sorted(need)
        raise ConfigError(f"{path}: no runs, or columns missing: {', '.join(missing)}")
    return [run_config(r) for r in rows]


def spearman(x, y) -> float:
    """Rank correlation (ties get their mean rank)."""

    def ranks(a):
        a = np.asarray(a, float)
        order = np.argsort(a, kind="mergesort")
        r = np.empty(len(a))
        r[order] = np.arange(len(a))
        for value in np.unique(a):  # mean rank for ties
            same = a == value
            r[same] = r[same].mean()
        return r

    rx, ry = ranks(x), ranks(y)
    if rx.std() == 0 or ry.std() == 0:
        return float("nan")
    return float(np.corrcoef(rx, ry)[0, 1])


def _features(runs: list[Run]) -> list:
    acc = hardware.by_name(GPU)
    return [
        steptime.features(r.cfg, acc, GPUS_PER_NODE, NANOTRON_ORDER, balanced=True)
        if r.cfg
        else None
        for r in runs
    ]


def evaluate(runs: list[Run], feats=None, fit=steptime.NANOTRON, coef=MEMORY, limit=MEMORY_LIMIT):
    """The three figures, per-cell Spearman and the predictions."""
    feats = _features(runs) if feats is None else feats
    fits, speed = [], []
    for r, f in zip(runs, feats, strict=True):
        fits.append(r.cfg is not None and nanotron_memory(r.cfg, coef) <= limit)
        speed.append(steptime.step_time(f, fit).tokens_per_s_per_gpu if f else float("nan"))
    agree = np.mean([fit_ == r.ran for fit_, r in zip(fits, runs, strict=True)])
    ok = [i for i, r in enumerate(runs) if r.ran and r.cfg is not None]
    errors = [abs(speed[i] / runs[i].measured - 1) for i in ok]
    cells = {}
    for i in ok:
        key = (runs[i].row["model"], int(runs[i].row["nodes"]))
        cells.setdefault(key, []).append(i)
    rho = {
        k: spearman([speed[i] for i in v], [runs[i].measured for i in v]) for k, v in cells.items()
    }
    big = [v for k, v in rho.items() if len(cells[k]) >= 5 and not math.isnan(v)]
    by_nodes = {}
    for nodes in sorted({int(r.row["nodes"]) for r in runs}):
        mine = [i for i, r in enumerate(runs) if int(r.row["nodes"]) == nodes]
        err = [abs(speed[i] / runs[i].measured - 1) for i in ok if i in set(mine)]
        rhos = [v for k, v in rho.items() if k[1] == nodes and len(cells[k]) >= 5]
        rhos = [v for v in rhos if not math.isnan(v)]
        by_nodes[nodes] = {
            "runs": len(mine),
            "ran": len(err),
            "verdict_agreement": float(np.mean([fits[i] == runs[i].ran for i in mine])),
            "spearman_mean": float(np.mean(rhos)) if rhos else float("nan"),
            "median_error": float(np.median(err)) if err else float("nan"),
        }
    return {
        "runs": len(runs),
        "ran": sum(r.ran for r in runs),
        "verdict_agreement": float(agree),
        "spearman_mean": float(np.mean(big)) if big else float("nan"),
        "spearman_cells": {
            f"{k[0]} x {k[1]} nodes": (v, len(cells[k])) for k, v in sorted(rho.items())
        },
        "median_error": float(np.median(errors)) if errors else float("nan"),
        "unbuildable_that_ran": sum(r.ran and r.cfg is None for r in runs),
        "by_nodes": by_nodes,
        "predicted": speed,
        "fits": fits,
    }


def fit_memory(runs: list[Run]) -> np.ndarray:
    """Least squares of nanotron's peak on the runs that ran (the larger stage by the
    current coefficients, iterated)."""
    built = [r for r in runs if r.cfg is not None and r.ran and r.row.get("mem_gb")]
    coef = np.asarray(MEMORY)
    for _ in range(10):
        x = np.array(
            [memory_features(r.cfg)[np.argmax(memory_features(r.cfg) @ coef)] for r in built]
        )
        y = np.array([float(r.row["mem_gb"]) * 1e9 for r in built])
        coef = np.linalg.lstsq(x, y, rcond=None)[0]
    return coef


def _fit_space(terms):
    """The fitted names, their start (steptime.Fit's defaults, SCALE_TERMS' starts) and
    the map from the optimizer's log-space vector to a Fit."""
    names = list(steptime.BASE_TERMS) + list(terms)
    start = [getattr(steptime.Fit(), n) for n in steptime.BASE_TERMS]
    start += [steptime.SCALE_TERMS[n] for n in terms]
    fractions = [names.index(n) for n in ("e_max", "eta_intra", "eta_inter", "overlap")]

    def make(z):
        p = np.exp(z)
        p[fractions] = np.minimum(p[fractions], 1.0)  # efficiencies and shares: at most 1
        return steptime.Fit(**{n: float(v) for n, v in zip(names, p, strict=True)})

    return np.log(np.array(start)), make


def fit_steptime(
    runs: list[Run], feats, terms=steptime.FITTED_TERMS, iters=FIT_ITERS,
    restarts=FIT_RESTARTS,
):  # fmt: skip
    """Nelder-Mead on the two figures the targets name (the sweep holds broken runs,
    10-50x slower than their neighbours, that a least-squares fit would chase): the mean
    over node counts of the median error, so that no node count's error is traded for
    another's, and the mean Spearman over cells. In log space (every constant is
    positive and they span 1e-5 to 1e6), restarted `restarts` times from its result: a
    simplex over 12 constants collapses before the medians' steps are done (one run of
    2000 iterations left the 1-node leave-out at 26.5%, three at 24.4%)."""
    idx = [i for i, r in enumerate(runs) if r.ran and feats[i] is not None]
    measured = np.array([runs[i].measured for i in idx])
    cells, counts = {}, {}
    for j, i in enumerate(idx):
        cells.setdefault((runs[i].row["model"], runs[i].row["nodes"]), []).append(j)
        counts.setdefault(runs[i].row["nodes"], []).append(j)
    start, make = _fit_space(terms)
    from scipy.optimize import minimize  # only a fit needs scipy

    def objective(z):
        fit = make(z)
        pred = np.array([steptime.step_time(feats[i], fit).tokens_per_s_per_gpu for i in idx])
        err = abs(pred / measured - 1)
        med = np.mean([np.median(err[v]) for v in counts.values()])
        rhos = [spearman(pred[v], measured[v]) for v in cells.values() if len(v) >= 5]
        rho = np.mean(rhos) if rhos else 0.0
        return med + 0.5 * max(0.0, 0.85 - rho) - 0.1 * rho

    z = start
    for _ in range(restarts + 1):
        z = minimize(objective, z, method="Nelder-Mead", options={"maxiter": iters}).x
    return make(z)


def fit_all(runs: list[Run], terms=steptime.FITTED_TERMS, iters=FIT_ITERS):
    """Refit the memory coefficients, the verdict's threshold (the best agreement; the
    highest of equal ones) and the step-time constants on `runs`."""
    coef = fit_memory(runs)
    feats = _features(runs)
    fit = fit_steptime(runs, feats, terms, iters)
    best = max(
        (evaluate(runs, feats, fit, coef, lim)["verdict_agreement"], lim)
        for lim in np.arange(60e9, 86e9, 1e9)
    )
    return coef, fit, best[1], feats


def leave_out(runs: list[Run], held: int, terms=steptime.FITTED_TERMS, iters=FIT_ITERS):
    """Fit on the runs of every node count but `held`, and the three figures on `held`'s:
    how the model does on a cluster size it was not fitted to."""
    train = [r for r in runs if int(r.row["nodes"]) != held]
    test = [r for r in runs if int(r.row["nodes"]) == held]
    if not train or not test:
        raise ConfigError(f"--leave-out {held}: need runs on {held} nodes and on others")
    coef, fit, limit, _ = fit_all(train, terms, iters)
    return evaluate(test, None, fit, coef, limit), fit


def _print_nodes(title: str, by_nodes: dict) -> None:
    print(title)
    print(
        f"  {'nodes':>5} {'runs':>5} {'ran':>4} {'verdict':>8} {'Spearman':>9} {'median err':>11}"
    )
    for nodes, f in by_nodes.items():
        print(
            f"  {nodes:>5} {f['runs']:>5} {f['ran']:>4} {f['verdict_agreement']:>8.1%} "
            f"{f['spearman_mean']:>9.3f} {f['median_error']:>11.1%}"
        )


def _terms(text: str) -> tuple[str, ...]:
    if text in ("", "none"):
        return ()
    terms = tuple(t.strip() for t in text.split(","))
    unknown = [t for t in terms if t not in steptime.SCALE_TERMS]
    if unknown:
        known = ", ".join(steptime.SCALE_TERMS)
        raise ConfigError(f"--terms: unknown {', '.join(unknown)} (known: {known}, or none)")
    return terms


def _leave_out_table(runs: list[Run], held: list[int], terms, iters: int) -> None:
    """Per held-out node count: fit on the others, the figures on it."""
    counts = sorted({int(r.row["nodes"]) for r in runs}) if held == [0] else held
    rows = {}
    for nodes in counts:
        r, fit = leave_out(runs, nodes, terms, iters)
        rows[nodes] = r["by_nodes"][nodes]
        kept = {k: float(f"{v:.4g}") for k, v in vars(fit).items()}
        print(f"fit without {nodes} nodes: {kept}")
    _print_nodes("left out (each row fitted on the other node counts):", rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="validate_planner.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", help="runs of the playbook's sweep (its columns)")
    ap.add_argument("--fit", action="store_true", help="refit the constants first and print them")
    ap.add_argument("--cells", action="store_true", help="print the Spearman of every cell")
    ap.add_argument("--nodes", action="store_true", help="print the figures per node count")
    ap.add_argument(
        "--leave-out", type=int, action="append", metavar="NODES",
        help="fit without the runs on NODES nodes and print the figures on them (0: each count)",
    )  # fmt: skip
    ap.add_argument(
        "--terms", default=",".join(steptime.FITTED_TERMS),
        help="the scale terms a fit fits (comma-separated, or none); default NANOTRON's",
    )  # fmt: skip
    ap.add_argument("--iters", type=int, default=FIT_ITERS, help="Nelder-Mead iterations a fit")
    args = ap.parse_args(argv)
    try:
        runs = load(args.csv)
        terms = _terms(args.terms)
        if args.leave_out:
            _leave_out_table(runs, args.leave_out, terms, args.iters)
            return 0
        fit, coef, limit, feats = steptime.NANOTRON, MEMORY, MEMORY_LIMIT, None
        if args.fit:
            coef, fit, limit, feats = fit_all(runs, terms, args.iters)
            print("MEMORY =", tuple(float(f"{c:.4g}") for c in coef))
            print(f"MEMORY_LIMIT = {limit:.3g}")
            print("NANOTRON =", fit)
        r = evaluate(runs, feats, fit, coef, limit)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.csv}: {r['runs']} runs, {r['ran']} ran")
    if args.cells:
        for k, (rho, n) in r["spearman_cells"].items():
            print(f"  {k:<20} {n:>4} runs  Spearman {rho:.3f}")
    if args.nodes:
        _print_nodes("by node count:", r["by_nodes"])
    print(f"verdict agreement      {r['verdict_agreement']:.1%}")
    print(f"Spearman (mean/cell)   {r['spearman_mean']:.3f}")
    print(f"median error tok/s/GPU {r['median_error']:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
