"""The analyzer's pictures (matplotlib, an optional extra): the memory breakdown, a
sweep of one key, the pipeline schedule."""

from __future__ import annotations

from ultrajax.config.schema import Config, ConfigError
from ultrajax.cost import activations, hardware, memory, units
from ultrajax.cost.memory import sweep
from ultrajax.model.llama import param_count
from ultrajax.parallel.pipeline import schedules as schedule
from ultrajax.tools import schedule_plot


def plot_schedule(cfg: Config, path: str) -> str:
    """Draw the configured pipeline schedule (schedule_plot.draw); compiles nothing."""

    p, v, m = cfg.mesh.pipeline, cfg.parallel.virtual_stages, cfg.train.grad_accum
    kind = cfg.parallel.pipeline_schedule
    if p == 1:
        raise ConfigError(
            "--plot-schedule: mesh.pipeline=1, so there is no pipeline schedule to draw; "
            "set mesh.pipeline > 1 (and train.grad_accum >= it)"
        )
    table = activations.pipeline_plan(cfg).table
    title = (
        f"{kind}: p={p}, m={m}, v={v}, bubble {schedule.bubble(table):.1%} "
        f"(formula {schedule.formula(kind, p, m, v):.1%})"
    )
    try:
        schedule_plot.draw(table, path, title=title)
    except RuntimeError as e:  # no matplotlib
        raise ConfigError(f"--plot-schedule: {e}") from None
    return title


# --------------------------------------------------------------------------- plots


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError('--plot needs matplotlib: pip install -e ".[plot]"') from None
    return plt


def plot_breakdown(r: dict, path: str) -> None:
    """Stacked bars: the predicted breakdown beside XLA's compiled figures."""
    plt = _pyplot()
    p, c = r["predicted"], r.get("compiled")
    unit, uname = (units.GiB, "GiB") if p["peak"] > units.GiB else (2**20, "MiB")
    fig, ax = plt.subplots(figsize=(9, 6))
    colors = plt.get_cmap("tab20").colors
    bottom = 0.0
    for i, (label, v) in enumerate(_predicted_bars(p)):
        if v <= 0:
            continue
        ax.bar(0, v / unit, bottom=bottom, color=colors[i % 20], label=label, width=0.6)
        bottom += v / unit
    if c:
        _compiled_bar(ax, c, p["peak"], unit, uname)
    ax.text(0, p["peak"] / unit, f"{p['peak'] / unit:.2f} {uname}", ha="center", va="bottom")
    top = max(p["peak"], c["peak"] if c else 0) / unit
    ax.set_ylim(0, top * 1.15)
    ax.set_xticks([0, 1] if c else [0])
    ax.set_xticklabels(["predicted"] + (["compiled (XLA)"] if c else []))
    ax.set_xlim(-0.6, 2.9)
    ax.set_ylabel(f"{uname} per device")
    cf = r["config"]
    ax.set_title(
        f"Memory per device: {cf['parameters'] / 1e6:.1f}M params, ZeRO-{cf['zero']}, "
        f"remat {cf['remat']}, mbs {cf['micro_batch_size']} x seq {cf['seq_len']}"
    )
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _predicted_bars(p: dict) -> list[tuple[str, float]]:
    """(label, bytes) from the bottom of the predicted bar up: the state, then what the
    peak phase holds (the optimizer's temporaries, or gradients, saved activations and
    the working set at the backward)."""
    parts, phase = p["parts"], p["peak_phase"]
    bars = [
        ("master weights", parts["master"]),
        ("Adam moments", parts["optimizer"]),
        ("batch + outputs", parts["batch"] + p["outputs"] + 8),
    ]
    if phase in memory.AFTER_BACKWARD:
        return bars + [("optimizer temporaries", p["phases"][phase])]
    # mesh.pipeline > 1: the gradients are reduced after the ticks, not during them
    held = [
        ("compute copy", parts["compute_copy"]),
        ("gradients", 0 if p["pipelined"] else parts["gradients"]),
        ("fp32 accumulators", parts["accumulators"]),
        ("whole embedding gradient", 0 if p["pipelined"] else parts["embed_grad"]),
    ]
    if phase == memory.Phase.LOOKUP_BACKWARD:  # after the layers': no activations saved
        return bars + held + [("lookup gradient and its copy", p["phases"][phase] - p["held"])]
    saved = [(f"saved: {k}", v) for k, v in p["activations"].items()]
    work = p["phases"][phase] - p["held"] - parts["saved"]
    return bars + held + saved + [(f"working set ({phase})", work)]


def _compiled_bar(ax, c: dict, predicted_peak: float, unit: float, uname: str) -> None:
    """XLA's memory_analysis as the second bar, its peak and the ratio on top."""
    bottom = 0.0
    for label, v, col in (
        ("XLA: arguments", c["argument"], "#555555"),
        ("XLA: outputs not aliased", c["output"] - c["alias"], "#999999"),
        ("XLA: temporaries", c["temp"], "#cccccc"),
    ):
        ax.bar(1, v / unit, bottom=bottom, color=col, label=label, width=0.6, hatch="//")
        bottom += v / unit
    ax.text(
        1,
        bottom,
        f"{c['peak'] / unit:.2f} {uname}\npredicted / compiled {predicted_peak / c['peak']:.3f}",
        ha="center",
        va="bottom",
    )


def plot_sweep(cfg: Config, path: str, device_memory: int | None = None) -> dict:
    plt = _pyplot()
    data = sweep(cfg)
    fig, ax = plt.subplots(figsize=(9, 6))
    markers = {"none": "o", "selective": "s", "full": "^"}
    for i, (pol, d) in enumerate(data["policies"].items()):
        color = plt.get_cmap("tab10").colors[i]
        ax.plot(
            data["seq_len"],
            [a / units.GiB for a in d["activations"]],
            color=color,
            marker=markers.get(pol, "."),
            label=f"activations, remat={pol}",
        )
        ax.plot(
            data["seq_len"],
            [p / units.GiB for p in d["peak"]],
            color=color,
            ls=":",
            label=f"peak per device, remat={pol}",
        )
    ax.axhline(
        data["model_states"] / units.GiB, color="k", ls="--", label="weights + Adam (master)"
    )
    if device_memory:
        ax.axhline(device_memory / units.GiB, color="r", ls="-.", label="device memory")
    else:
        h100 = hardware.by_name("h100").memory
        ax.axhline(h100 / units.GiB, color="r", ls="-.", label="H100 memory (80 GB)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("GiB per device (log)")
    m = cfg.model
    mesh = " x ".join(f"{k}={v}" for k, v in cfg.mesh.sizes().items() if v > 1) or "1 device"
    ax.set_title(
        f"Memory per device vs sequence length: {param_count(m) / 1e6:.1f}M params, "
        f"micro-batch {cfg.train.micro_batch_size}, {m.dtype}\n{mesh}, ZeRO-{cfg.parallel.zero}"
        f"{' + SP' if cfg.parallel.sequence_parallel else ''}, attention {m.attention} "
        "(predicted)"
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return data
