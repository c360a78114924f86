"""python -m ultrajax.plan: the fastest layouts of a config on N GPUs, predicted.

    python -m ultrajax.plan --config configs/llama-8b.yaml --gpus 64 [--gpu h100]
        [--gpus-per-node 8] [--tokens-per-step T] [--top K] [--json] [--plot FILE.png]
        [key=value ...]

Every layout that divides the model and the batch (cost/candidates.py) gets a predicted step
time (cost/steptime.py) and, in order of speed, its memory (memory.estimate) until the
`top` fastest that fit are found; the others are listed with why they lost. No device
is used and nothing is compiled. docs/planner.md explains the model and its accuracy.
"""

from __future__ import annotations

import json
import time

from ultrajax import cli
from ultrajax.config.schema import ConfigError
from ultrajax.cost import candidates, flops, hardware, steptime
from ultrajax.cost.units import GiB
from ultrajax.tools.plots import _pyplot

LOSERS_SHOWN = 5
PLOTTED = 500  # --plot: the fastest layouts whose memory is estimated and drawn


def _parser():
    p = cli.ArgumentParser(
        prog="python -m ultrajax.plan",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--config", required=True, help="YAML config file (the model and batch)")
    p.add_argument("--gpus", type=int, required=True, metavar="N", help="GPUs to plan for")
    p.add_argument("--gpu", default="h100", help=f"GPU kind: {', '.join(hardware.NAMES)}")
    p.add_argument(
        "--gpus-per-node", type=int, default=None, metavar="G", help="default: the GPU's"
    )
    p.add_argument(
        "--tokens-per-step",
        type=int,
        default=None,
        metavar="T",
        help="global batch in tokens (default: the config's, on N GPUs)",
    )
    p.add_argument("--top", type=int, default=5, metavar="K", help="layouts to rank (5)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument(
        "--plot",
        metavar="FILE.png",
        help=f"tokens/s against memory of the {PLOTTED} fastest layouts (matplotlib)",
    )
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.seq_len=4096")
    return p


def _mfu(e: candidates.Evaluated, base, acc) -> float:
    return (
        e.time.tokens_per_s_per_gpu
        * flops.flops_per_token(base.model)
        / acc.flops(base.model.dtype)
    )


def _row(i, e: candidates.Evaluated, base, acc) -> str:
    t = e.time
    return (
        f"{i:>2}  {e.candidate.short():<54} {t.tokens_per_s_per_gpu:>8,.0f} {t.total:>8.2f} "
        f"{_mfu(e, base, acc):>5.0%} {e.memory / GiB:>7.1f}  {t.where()}"
    )


def plan(args) -> dict:
    if args.gpus < 1:
        raise ConfigError(f"--gpus must be >= 1, got {args.gpus}")
    if args.top < 1:
        raise ConfigError(f"--top must be >= 1, got {args.top}")
    try:
        acc = hardware.by_name(args.gpu)
    except KeyError as e:
        raise ConfigError(f"--gpu: {e.args[0]}") from None
    gpn = acc.gpus_per_node if args.gpus_per_node is None else args.gpus_per_node
    if gpn < 1:
        raise ConfigError(f"--gpus-per-node must be >= 1, got {gpn}")
    base = cli.load_config(args)
    tokens = args.tokens_per_step or candidates.tokens_per_step(base, args.gpus)
    if tokens < 1:
        raise ConfigError(f"--tokens-per-step must be >= 1, got {tokens}")
    start = time.perf_counter()
    evaluated = candidates.evaluate(base, args.gpus, acc, gpn, tokens)
    if not evaluated:
        raise ConfigError(
            f"no layout of {args.gpus} GPUs divides the model and {tokens} tokens per step "
            f"({tokens // base.model.seq_len} sequences of {base.model.seq_len}): change --gpus "
            "or --tokens-per-step"
        )
    shown = PLOTTED if args.plot else 0
    best = candidates.rank(base, evaluated, acc.memory, args.top, at_least=shown)
    seconds = time.perf_counter() - start
    cut = evaluated.index(best[-1]) if best else len(evaluated)
    faster_oom = [e for e in evaluated[:cut] if e.memory is not None and e.memory > acc.memory]
    slower = [e for e in evaluated[cut + 1 :] if e not in best]
    return {
        "base": base,
        "acc": acc,
        "gpus": args.gpus,
        "gpus_per_node": gpn,
        "tokens": tokens,
        "evaluated": evaluated,
        "best": best,
        "faster_oom": faster_oom,
        "slower": slower,
        "seconds": seconds,
    }


def _summary(e: candidates.Evaluated, base, acc, best=None) -> dict:
    out = {
        "layout": e.candidate.short(),
        "overrides": e.candidate.overrides(),
        "tokens_per_s_per_gpu": e.time.tokens_per_s_per_gpu,
        "step_s": e.time.total,
        "mfu": _mfu(e, base, acc),
        "memory_bytes": e.memory,
        "parts_s": e.time.parts(),
    }
    if e.memory is not None and e.memory > acc.memory:
        out["lost"] = f"does not fit: {(e.memory - acc.memory) / GiB:.1f} GiB over"
    elif best is not None:
        out["lost"] = candidates.slower_reason(e, best)
    return out


def report(r: dict, args) -> str:
    base, acc, best = r["base"], r["acc"], r["best"]
    seq = base.model.seq_len
    lines = [
        f"plan: {args.config} on {args.gpus} x {acc.name} ({r['gpus_per_node']} per node), "
        f"{r['tokens']:,} tokens per step ({r['tokens'] // seq} x {seq}); "
        f"{len(r['evaluated'])} layouts in {r['seconds']:.1f} s",
        f"memory: memory.estimate per device against {acc.memory / GiB:.1f} GiB; time: "
        "cost/steptime.py (docs/planner.md: what is fitted, and its measured accuracy)",
        "",
        f" #  {'layout':<54} {'tok/s/GPU':>8} {'step s':>8} {'MFU':>5} {'GiB':>7}  "
        "where the time goes",
    ]
    for i, e in enumerate(best, 1):
        lines.append(_row(i, e, base, acc))
    if not best:
        lines.append("    nothing fits: every layout needs more memory than the GPU has")
    oom = r["faster_oom"]
    if oom:
        lines += [
            "",
            f"faster, but do not fit ({len(oom)}; the fastest {min(len(oom), LOSERS_SHOWN)}):",
        ]
        for e in oom[:LOSERS_SHOWN]:
            lines.append(
                f"    {e.candidate.short():<54} {e.time.tokens_per_s_per_gpu:>8,.0f} tok/s/GPU, "
                f"needs {e.memory / GiB:.1f} GiB: {(e.memory - acc.memory) / GiB:.1f} GiB over"
            )
    slower = r["slower"]
    if slower and best:
        lines += [
            "",
            f"slower ({len(slower)}; the next {min(len(slower), LOSERS_SHOWN)}), against #1:",
        ]
        for e in slower[:LOSERS_SHOWN]:
            lines.append(f"    {e.candidate.short():<54} {candidates.slower_reason(e, best[0])}")
    if best:
        lines += [
            "",
            f"#1: python -m ultrajax.train --config {args.config} {best[0].candidate.overrides()}",
        ]
    return "\n".join(lines)


def plot(r: dict, path: str) -> None:

    plt = _pyplot()
    acc = r["acc"]
    pts = [e for e in r["evaluated"] if e.memory is not None]
    fig, ax = plt.subplots(figsize=(8, 5))
    fits = [e for e in pts if e.memory <= acc.memory]
    over = [e for e in pts if e.memory > acc.memory]
    for group, color, label in ((fits, "tab:blue", "fits"), (over, "tab:gray", "does not fit")):
        ax.scatter(
            [e.memory / GiB for e in group],
            [e.time.tokens_per_s_per_gpu for e in group],
            s=8,
            c=color,
            alpha=0.6,
            label=label,
        )
    for i, e in enumerate(r["best"], 1):
        ax.annotate(str(i), (e.memory / GiB, e.time.tokens_per_s_per_gpu), fontsize=8)
    ax.axvline(acc.memory / GiB, color="tab:red", lw=1, label=f"{acc.name} memory")
    ax.set_xlabel("predicted memory per GPU (GiB)")
    ax.set_ylabel("predicted tokens/s per GPU")
    ax.set_title(f"the {len(pts)} fastest layouts on {r['gpus']} x {acc.name}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    r = plan(args)
    if args.plot:
        plot(r, args.plot)
    if args.json:
        base, acc, best = r["base"], r["acc"], r["best"]
        out = {
            "config": args.config,
            "gpus": args.gpus,
            "gpu": acc.name,
            "gpus_per_node": r["gpus_per_node"],
            "tokens_per_step": r["tokens"],
            "layouts": len(r["evaluated"]),
            "seconds": r["seconds"],
            "device_memory": acc.memory,
            "best": [_summary(e, base, acc) for e in best],
            "faster_oom": [_summary(e, base, acc) for e in r["faster_oom"]],
            "slower": [_summary(e, base, acc, best[0]) for e in r["slower"][:100]] if best else [],
            "fit": vars(steptime.ULTRAJAX),
        }
        print(json.dumps(out, indent=1))
    else:
        print(report(r, args))
        if args.plot:
            print(f"plot: {args.plot}")
    return 0 if r["best"] else 1
