"""python -m ultrajax.plan: the fastest layouts of a config on N GPUs, predicted.

    python -m ultrajax.plan --config configs/llama-8b.yaml --gpus 64 [--gpu h100]
        [--gpus-per-node 8] [--tokens-per-step T] [--top K] [--json] [--plot FILE.png]
        [--sites N --wan-gbps B [--wan-km D]] [key=value ...]

Every layout that divides the model and the batch (cost/candidates.py) gets a predicted step
time (cost/steptime.py) and, in order of speed, its memory (memory.estimate) until the
`top` fastest that fit are found; the others are listed with why they lost, and the
config's own layout with its rank (or why it has none), what #1 changes and the gain.
No device is used and nothing is compiled. docs/planner.md explains the model and its accuracy.
With --sites the GPUs and the batch split over N sites joined by a wide-area link: each site
gets the plan, and the link's cost of data parallelism and of DiLoCo across the sites is
printed after it (cost/wan.py, docs/diloco.md).
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import dataclass

from ultrajax import cli
from ultrajax.config import validate
from ultrajax.config.schema import Config, ConfigError
from ultrajax.cost import candidates, flops, hardware, steptime, wan
from ultrajax.cost.units import GiB, dtype_bytes
from ultrajax.model import llama
from ultrajax.parallel.pipeline import schedules
from ultrajax.tools.plots import _pyplot

LOSERS_SHOWN = 5
PLOTTED = 500  # --plot: the fastest layouts whose memory is estimated and drawn
# steptime.StepTime's parts as the table names them, with what each is: "data 0%"
# read like data loading
PARTS = {
    "compute": ("compute", "the model's FLOPs at the fitted efficiency"),
    "host": ("host-bound", "the host's per-layer dispatch time beyond the compute"),
    "tensor": ("TP/EP comm", "tensor-parallel collectives and expert parallelism's all-to-alls"),
    "pipeline_sends": ("PP sends", "pipeline sends between stages"),
    "context": (
        "CP/gather comm",
        "context-parallel ring and ZeRO-3 weight gathers not hidden behind compute",
    ),
    "bubble": ("PP bubble", "pipeline stages idle"),
    "data": ("DP comm", "data-parallel / ZeRO gradient reduction not hidden by the backward"),
    "optimizer": ("optimizer", "the optimizer update"),
    "overhead": ("step overhead", "fixed per-step time and the wait for the slowest node"),
}


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
    p.add_argument(
        "--sites",
        type=int,
        default=1,
        metavar="N",
        help="the GPUs split over N sites joined by a wide-area link (docs/diloco.md)",
    )
    p.add_argument(
        "--wan-gbps", type=float, default=None, metavar="B", help="each site's link, Gbit/s a way"
    )
    p.add_argument(
        "--wan-km", type=float, default=0.0, metavar="D", help="km between neighbouring sites"
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


def _mfu(e: candidates.Evaluated | steptime.StepTime, base, acc) -> float:
    t = e.time if isinstance(e, candidates.Evaluated) else e
    peak = flops.model_peak(base.model, acc.flops)
    return t.tokens_per_s_per_gpu * flops.flops_per_token(base.model) / peak


def _where(t: steptime.StepTime) -> str:
    """Compute's share of the step, then the two largest other parts, by their labels."""
    shares = [f"compute {t.compute / t.total:.0%}"]
    shares += [f"{PARTS[k][0]} {t.parts()[k] / t.total:.0%}" for k in _shown_parts(t)]
    return ", ".join(shares)


def _grown(t: steptime.StepTime, best: steptime.StepTime) -> str:
    """The two parts of `t` that exceed `best`'s most, as shares of best's step."""
    a, b = t.parts(), best.parts()
    diff = sorted(((a[k] - b[k], k) for k in a), reverse=True)[:2]
    return ", ".join(f"{PARTS[k][0]} +{d / best.total:.0%}" for d, k in diff if d > 0)


def _behind(t: steptime.StepTime, best: steptime.StepTime) -> str:
    """candidates.slower_reason with the parts named as the table names them."""
    extra, where = t.total / best.total - 1, _grown(t, best)
    return f"{extra:.0%} slower: {where}" if where else f"{extra:.0%} slower"


def _row(i, e: candidates.Evaluated, base, acc) -> str:
    t = e.time
    return (
        f"{i:>2}  {e.candidate.short():<54} {t.tokens_per_s_per_gpu:>9,.0f} {t.total:>7.2f} "
        f"{_mfu(e, base, acc):>5.0%} {e.memory / GiB:>8.1f}  {_where(t)}"
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
    link = _wan(args)
    base = cli.load_config(args)
    tokens = args.tokens_per_step
    if tokens is None:
        tokens = candidates.tokens_per_step(base, args.gpus)
    elif tokens < 1:  # 0 included: it was taken as "the config's"
        raise ConfigError(f"--tokens-per-step must be >= 1, got {tokens}")
    # with sites, each runs the layout on its share of the GPUs and of the batch
    gpus, site_tokens = args.gpus // args.sites, tokens // args.sites
    if gpus > gpn and gpus % gpn:  # the step-time model prices whole nodes
        raise ConfigError(
            f"{gpus} GPUs{' a site' if args.sites > 1 else ''} do not fill nodes of "
            f"{gpn} (--gpus-per-node): give a multiple of {gpn}, or fewer than one node"
        )
    if args.sites > 1 and tokens % (args.sites * base.model.seq_len):
        raise ConfigError(
            f"--tokens-per-step ({tokens}) must be a multiple of --sites x model.seq_len "
            f"({args.sites} x {base.model.seq_len}): each site's batch is whole sequences"
        )
    start = time.perf_counter()
    evaluated = candidates.evaluate(base, gpus, acc, gpn, site_tokens)
    if not evaluated:
        raise ConfigError(
            f"no layout of {gpus} GPUs divides the model and {site_tokens} tokens per step "
            f"({site_tokens // base.model.seq_len} sequences of {base.model.seq_len}): change "
            "--gpus, --sites or --tokens-per-step"
        )
    shown = PLOTTED if args.plot else 0
    best = candidates.rank(base, evaluated, acc.memory, args.top, at_least=shown)
    cut = evaluated.index(best[-1]) if best else len(evaluated)
    faster_oom = [e for e in evaluated[:cut] if e.memory is not None and e.memory > acc.memory]
    slower = [e for e in evaluated[cut + 1 :] if e not in best]
    r = {
        "base": base,
        "acc": acc,
        "gpus": gpus,
        "gpus_per_node": gpn,
        "tokens": site_tokens,
        "evaluated": evaluated,
        "best": best,
        "faster_oom": faster_oom,
        "slower": slower,
    }
    r["own"] = own_layout(base, r)
    r["wan"] = _across(base, link, best[0].time) if link is not None and best else None
    r["seconds"] = time.perf_counter() - start
    return r


def _wan(args) -> wan.Wan | None:
    """The wide-area link of --sites, checked, or None (one site)."""
    if args.sites < 1:
        raise ConfigError(f"--sites must be >= 1, got {args.sites}")
    if args.sites == 1:
        if args.wan_gbps is not None or args.wan_km:
            raise ConfigError("--wan-gbps and --wan-km price the link between sites: add --sites N")
        return None
    if args.gpus % args.sites:
        raise ConfigError(f"--gpus ({args.gpus}) must divide by --sites ({args.sites})")
    if args.wan_gbps is None or args.wan_gbps <= 0:
        raise ConfigError("--sites > 1 needs --wan-gbps B > 0: each site's link, Gbit/s a way")
    if args.wan_km < 0:
        raise ConfigError(f"--wan-km must be >= 0, got {args.wan_km}")
    return wan.Wan(args.sites, args.wan_gbps, args.wan_km)


def _across(base: Config, link: wan.Wan, step: steptime.StepTime) -> dict:
    """The sites joined by `link`, each running the plan's #1 (its step `step`): one
    synchronisation of the whole model, data parallelism across the sites (its gradients
    every step) and DiLoCo at each H of wan.INTERVALS (its pseudo-gradients every H)."""
    n = llama.param_count(base.model)
    par = base.parallel
    sync = link.all_reduce_s(n * dtype_bytes(par.diloco_dtype))
    grads = link.all_reduce_s(n * dtype_bytes(par.grad_reduce_dtype))
    per_gpu = step.tokens_per_device
    rows = {h: wan.step_with_sync(step.total, sync, h) for h in wan.INTERVALS}
    return {
        "sites": link.sites,
        "gbps": link.gbps,
        "km": link.km,
        "latency_s": link.latency_s,
        "params": n,
        "sync_bytes": n * dtype_bytes(par.diloco_dtype),
        "sync_dtype": par.diloco_dtype,
        "sync_s": sync,
        "step_s": step.total,
        "data_parallel_step_s": step.total + grads,
        "data_parallel_tokens_per_s_per_gpu": per_gpu / (step.total + grads),
        "diloco": {h: {"step_s": t, "tokens_per_s_per_gpu": per_gpu / t} for h, t in rows.items()},
        "hiding_h": wan.hiding_interval(step.total, sync),
    }


def _wan_lines(w: dict) -> list[str]:
    km = f", {w['km']:,.0f} km apart ({w['latency_s'] * 1e3:.1f} ms a crossing)" if w["km"] else ""
    gb = w["sync_bytes"] / 1e9
    lines = [
        f"across {w['sites']} sites{km}, {w['gbps']:,.0f} Gbit/s each way per site; each site "
        f"runs #1 on its GPUs ({w['step_s']:.2f} s a step):",
        f"    one synchronisation of the {w['params'] / 1e9:,.2f}B parameters "
        f"({w['sync_dtype']}, {gb:,.1f} GB): {w['sync_s']:,.2f} s (cost/wan.py: a bidirectional "
        "ring, the link's bandwidth and the fibre's latency only)",
        f"    data parallelism across the sites (gradients every step): "
        f"{w['data_parallel_step_s']:,.2f} s a step, "
        f"{w['data_parallel_tokens_per_s_per_gpu']:,.0f} tok/s/GPU",
    ]
    rows = ", ".join(
        f"H={h} {r['step_s']:,.2f} s ({r['tokens_per_s_per_gpu']:,.0f} tok/s/GPU)"
        for h, r in w["diloco"].items()
    )
    lines.append(f"    DiLoCo, the sync waited for every H steps: {rows}")
    lines.append(
        f"    the smallest H whose steps last as long as one sync: {w['hiding_h']:,} (hidden "
        "only if the sync overlaps the next steps: streaming DiLoCo, not in ultrajax yet)"
    )
    return lines


@dataclass
class Own:
    """The config's own layout on the plan's GPUs: where it ranks, or why it does not."""

    layout: str | None = None  # as the table writes layouts
    settings: dict[str, str] | None = None  # key -> value of every setting a layout fixes
    time: steptime.StepTime | None = None
    memory: float | None = None
    rank: int | None = None  # among the layouts that fit (the table's #)
    by_speed: int | None = None  # among every layout, memory aside
    note: str = ""  # why it has no rank


def _candidate_of(cfg: Config) -> candidates.Candidate:
    """A resolved config's layout in the planner's terms (no ZeRO without fsdp ranks)."""
    m, par, t = cfg.mesh, cfg.parallel, cfg.train
    remat = cfg.model.remat if isinstance(cfg.model.remat, str) else str(cfg.model.remat)
    kind = par.pipeline_schedule if m.pipeline > 1 else schedules.PLAIN
    zero = par.zero if m.fsdp > 1 else 0
    return candidates.Candidate(
        m.data, m.fsdp, m.tensor, m.pipeline, m.sequence, zero,
        t.micro_batch_size, t.grad_accum, remat, kind, par.virtual_stages, m.expert,
    )  # fmt: skip


def _settings(c: candidates.Candidate, sequence_parallel: bool) -> dict[str, str]:
    """Every setting a layout fixes (virtual stages too, to compare two layouts)."""
    out = dict(kv.split("=", 1) for kv in c.overrides().split())
    out["parallel.sequence_parallel"] = str(sequence_parallel).lower()
    return out


def _outside(c: candidates.Candidate, sequence_parallel: bool, gpus_per_node: int) -> str:
    """Why a valid layout is not among those the planner tries (candidates.py)."""
    why = []
    if c.tensor > 1 and not sequence_parallel:
        why.append("sequence parallelism off")
    if c.remat not in candidates.REMATS:
        why.append(f"remat={c.remat}")
    if c.micro_batch not in candidates.MICRO_BATCHES:
        why.append(f"micro-batch {c.micro_batch}")
    kind = schedules.SCHEDULES.get(c.schedule)
    if c.pipeline > 1 and kind is not None and not kind.planned:
        why.append(f"schedule {c.schedule}")
    elif c.pipeline > 1 and kind is not None and kind.chunks and c.virtual != 2:
        why.append(f"{c.virtual} virtual stages")
    if max(c.tensor, c.sequence) > gpus_per_node:
        why.append("tensor or context parallelism across nodes")
    if c.expert > gpus_per_node:
        why.append("expert parallelism across nodes")
    return ", ".join(why) or "a layout it does not try"


def own_layout(base: Config, r: dict) -> Own:
    """Where the config's own layout ranks among the plan's: predicted like every layout,
    with the memory of each faster one estimated to count those that fit before it."""
    gpus, acc, evaluated = r["gpus"], r["acc"], r["evaluated"]
    cfg = copy.deepcopy(base)
    try:
        validate.resolve_mesh(cfg, gpus)
    except ConfigError as e:
        return Own(note=f"not a valid layout on {gpus} GPUs: {e}")
    c, sp = _candidate_of(cfg), cfg.parallel.sequence_parallel
    planned = c.tensor == 1 or sp
    own = Own(c.short() + ("" if planned else " no-SP"), _settings(c, sp))
    cache: dict = {}
    match = next((e for e in evaluated if planned and e.candidate == c), None)
    if match is not None:
        own.time, pos = match.time, evaluated.index(match)
        own.memory = candidates.memory_of(c.config(base), cache)
    else:
        own.time = steptime.predict(cfg, acc, r["gpus_per_node"])
        pos = sum(1 for e in evaluated if e.time.total < own.time.total)
        own.memory = candidates.memory_of(cfg, cache)
        own.note = f"not among the layouts planned ({_outside(c, sp, r['gpus_per_node'])})"
    if cfg.tokens_per_step != r["tokens"]:
        batch = f"{cfg.tokens_per_step:,} tokens per step, the plan's {r['tokens']:,}"
        own.note = f"not ranked: its batch is {batch}"
        return own
    own.by_speed = pos + 1
    if own.memory > acc.memory:
        over = (own.memory - acc.memory) / GiB
        n = len(evaluated)
        own.note = f"does not fit, {over:.1f} GiB over (#{own.by_speed} of {n} by speed)"
        return own
    for e in evaluated[:pos]:
        if e.memory is None:
            e.memory = candidates.memory_of(e.candidate.config(base), cache)
    own.rank = 1 + sum(1 for e in evaluated[:pos] if e.memory <= acc.memory)
    return own


def _changes(own: Own, best: candidates.Evaluated) -> str:
    """The overrides that turn the config's layout into `best`, pasteable."""
    target = _settings(best.candidate, best.candidate.tensor > 1)
    return " ".join(f"{k}={v}" for k, v in target.items() if own.settings.get(k) != v)


def _gain(g: float) -> str:
    return f"{g:+.1%}" if abs(g) < 0.095 else f"{g:+.0%}"


def _own_lines(own: Own, r: dict, base) -> list[str]:
    """Two lines: the config's layout (rank, speed, MFU, memory, or why unranked), then
    what #1 changes and the predicted gain."""
    acc, best = r["acc"], r["best"]
    if own.time is None:
        return [f"your config: {own.note}"]
    t = own.time
    where = own.note
    if own.rank is not None:
        n = len(r["evaluated"])
        where = f"#{own.rank} of the layouts that fit (#{own.by_speed} of {n} by speed)"
        where += f"; {own.note}" if own.note else ""
    figures = (
        f"{t.tokens_per_s_per_gpu:,.0f} tok/s/GPU, {_mfu(t, base, acc):.0%} MFU, "
        f"{own.memory / GiB:.1f} GiB"
    )
    lines = [f"your config: {own.layout}: {where}; {figures}"]
    changes = _changes(own, best[0]) if best else ""
    if best and changes:
        b = best[0].time
        gain = b.tokens_per_s_per_gpu / t.tokens_per_s_per_gpu - 1
        line = (
            f"#1 changes {changes}: {_gain(gain)} tokens/s ({b.tokens_per_s_per_gpu:,.0f} "
            f"tok/s/GPU, {_mfu(b, base, acc):.0%} MFU)"
        )
        if own.rank is None and own.by_speed is not None:
            line += ", and fits"
        elif gain > 0 and _grown(t, b):
            line += f"; yours spends more on {_grown(t, b)} of #1's step"
        lines.append(line)
    elif best:
        lines.append("#1 is your config's layout: nothing to change")
    return lines


def _own_json(own: Own, r: dict, base) -> dict:
    out = {
        "layout": own.layout,
        "overrides": " ".join(f"{k}={v}" for k, v in (own.settings or {}).items()) or None,
        "rank": own.rank,
        "rank_by_speed": own.by_speed,
        "layouts": len(r["evaluated"]),
        "note": own.note or None,
    }
    if own.time is None:
        return out
    t, acc = own.time, r["acc"]
    out.update(
        tokens_per_s_per_gpu=t.tokens_per_s_per_gpu,
        step_s=t.total,
        mfu=_mfu(t, base, acc),
        memory_bytes=own.memory,
        fits=own.memory <= acc.memory,
        parts_s=t.parts(),
    )
    if r["best"]:
        b = r["best"][0].time
        out["best_changes"] = _changes(own, r["best"][0])
        out["gain"] = b.tokens_per_s_per_gpu / t.tokens_per_s_per_gpu - 1
    return out


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
        out["lost"] = _behind(e.time, best.time)
    return out


HEADER = (
    f" #  {'layout':<54} {'tok/s/GPU':>9} {'step s':>7} {'MFU':>5} {'mem GiB':>8}  "
    "share of the step: compute, the two largest others"
)


def _legend(best: list[candidates.Evaluated]) -> list[str]:
    """What each part the table shows is, for those it shows."""
    shown = {k for e in best for k in _shown_parts(e.time)}
    return [f"    {PARTS[k][0]}: {PARTS[k][1]}" for k in PARTS if k in shown and k != "compute"]


def _shown_parts(t: steptime.StepTime) -> list[str]:
    parts = sorted(((v, k) for k, v in t.parts().items() if k != "compute" and v > 0), reverse=True)
    return [k for _, k in parts[:2]]


def report(r: dict, args) -> str:
    base, acc, best = r["base"], r["acc"], r["best"]
    seq = base.model.seq_len
    site = f" a site, {args.sites} sites" if args.sites > 1 else ""
    lines = [
        f"plan: {args.config} on {r['gpus']} x {acc.name} ({r['gpus_per_node']} per node), "
        f"{r['tokens']:,} tokens per step ({r['tokens'] // seq} x {seq}){site}; "
        f"{len(r['evaluated'])} layouts in {r['seconds']:.1f} s",
        f"memory: memory.estimate per device against {acc.memory / GiB:.1f} GiB; time: "
        "cost/steptime.py (docs/planner.md: what is fitted, and its measured accuracy)",
        "",
        HEADER,
    ]
    for i, e in enumerate(best, 1):
        lines.append(_row(i, e, base, acc))
    if not best:
        lines.append("    nothing fits: every layout needs more memory than the GPU has")
        least = min((e for e in r["faster_oom"] if e.memory is not None), key=lambda e: e.memory)
        lines.append(
            f"    the least any layout needs: {least.memory / GiB:.1f} GiB "
            f"({least.candidate.short()}), {(least.memory - acc.memory) / GiB:.1f} GiB over "
            f"{acc.memory / GiB:.1f}: more GPUs, or a GPU with more memory"
        )
    lines += _legend(best)
    lines += ["", *_own_lines(r["own"], r, base)]
    if r.get("wan"):
        lines += ["", *_wan_lines(r["wan"])]
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
            lines.append(f"    {e.candidate.short():<54} {_behind(e.time, best[0].time)}")
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
    cli.check_picture(args.plot, "--plot")
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
            "own": _own_json(r["own"], r, base),
            "wan": r["wan"],
            "parts": {k: f"{label}: {what}" for k, (label, what) in PARTS.items()},
            "fit": vars(steptime.ULTRAJAX),
        }
        print(json.dumps(out, indent=1))
    else:
        print(report(r, args))
        if args.plot:
            print(f"plot: {args.plot}")
    return 0 if r["best"] else 1
