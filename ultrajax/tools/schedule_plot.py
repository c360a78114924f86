"""Draw a pipeline schedule table (parallel/pipeline/schedules.py) as the Ultra-Scale Playbook draws
schedules: devices down, ticks across, one coloured box per op with its micro-batch.

Kept apart from the schedules so they stay numpy only; matplotlib is imported when a
picture is asked for.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ultrajax.parallel.pipeline import schedules as sched

# indexed by op (IDLE, FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT); chunk 0 gets
# the colour, later chunks lighter shades of it
_COLOURS = ("#f2f2f2", "#4a7fd4", "#3fa45b", "#f0953a", "#9467bd")
_LABELS = ("idle", "forward", "backward", "backward (input grad)", "backward (weight grad)")


def _shade(colour: str, chunk: int, v: int) -> tuple[float, float, float]:
    """`colour` mixed with white, more for later chunks (chunk 0 unmixed)."""
    rgb = np.array([int(colour[k : k + 2], 16) / 255 for k in (1, 3, 5)])
    mix = 0.55 * chunk / max(v - 1, 1)
    return tuple(float(c) for c in rgb + (1 - rgb) * mix)


def draw(table: np.ndarray, path: str | Path, title: str | None = None) -> Path:
    """Write the schedule `table` as a PNG at `path` and return the path. The title
    defaults to p, m, v and the bubble read off the table; pass one naming the schedule."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch, Rectangle
    except ImportError as e:
        raise RuntimeError('drawing a schedule needs matplotlib: pip install -e ".[plot]"') from e

    table = np.asarray(table)
    T, p = table.shape[:2]
    busy = table[..., 0] != sched.IDLE
    m = int(table[..., 1][busy].max(initial=-1)) + 1
    v = int(table[..., 2][busy].max(initial=0)) + 1
    if title is None:
        title = f"p={p}, m={m}, v={v}, bubble {sched.bubble(table):.1%}"

    fig = Figure(figsize=(max(6.0, 0.3 * T + 1.5), 0.4 * p + 1.6), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)  # Agg without pyplot: no global backend switch
    ax = fig.add_subplot()
    used = set()
    for t in range(T):
        for d in range(p):
            op, micro, chunk = (int(x) for x in table[t, d])
            face = _shade(_COLOURS[op], chunk, v)
            ax.add_patch(Rectangle((t, d), 1, 1, facecolor=face, edgecolor="white", lw=1))
            if op != sched.IDLE:
                used.add((op, chunk))
                text = str(micro) + "'" * chunk
                ax.text(t + 0.5, d + 0.5, text, ha="center", va="center", fontsize=7)
    ax.set_xlim(0, T)
    ax.set_ylim(p, 0)  # device 0 on top
    ax.set_yticks(np.arange(p) + 0.5, [f"GPU {d}" for d in range(p)])
    step = max(1, round(T / 25))
    ax.set_xticks(np.arange(0, T, step) + 0.5, [str(t) for t in range(0, T, step)])
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    ax.set_xlabel("time (ticks)")
    ax.set_title(title)
    handles = []
    for op, chunk in sorted(used):
        prime = "'" * chunk
        label = _LABELS[op] + (f", chunk {chunk} (3{prime})" if v > 1 else "")
        handles.append(Patch(facecolor=_shade(_COLOURS[op], chunk, v), label=label))
    handles.append(Patch(facecolor=_COLOURS[sched.IDLE], label=_LABELS[sched.IDLE]))
    ncol = min(len(handles), 4 if v > 1 else 5)
    fig.legend(handles=handles, loc="outside lower center", ncol=ncol, frameon=False, fontsize=8)
    path = Path(path)
    fig.savefig(path, bbox_inches="tight")
    return path
