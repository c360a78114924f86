"""Pipeline schedule tables (parallel/pipeline/schedules.py): every builder's table obeys the
dependencies, hits its schedule's textbook bubble exactly, and holds the activations the
schedule promises; `check` rejects broken tables. Pure numpy: no compiles."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ultrajax.parallel.pipeline import schedules as sched

GRID = [
    (kind, p, m, v)
    for kind in sched.SCHEDULES
    for p in (1, 2, 3, 4, 8)
    for m in sorted({p, 2 * p, 8, 16})
    for v in ((2, 3) if kind == "interleaved" else (1,))
    if m >= p and (kind != "interleaved" or m % p == 0)
]
IDS = [f"{kind}-p{p}-m{m}-v{v}" for kind, p, m, v in GRID]


def _render(table: np.ndarray) -> str:
    """ASCII picture, one line per device: F3 forward, B3 backward, b3 input gradient,
    W3 weight gradient, . idle (micro-batch 3); a chunk letter follows when v > 1 (F3a
    is chunk 0, F3b chunk 1)."""
    cell = {sched.FORWARD: "F", sched.BACKWARD: "B", sched.BACKWARD_INPUT: "b"}
    cell[sched.BACKWARD_WEIGHT] = "W"
    table = np.asarray(table)
    v = int(table[..., 2][table[..., 0] != sched.IDLE].max(initial=0)) + 1
    cells = [
        [
            "." if op == sched.IDLE else f"{cell[op]}{i}" + (chr(ord("a") + j) if v > 1 else "")
            for op, i, j in row
        ]
        for row in table.transpose(1, 0, 2).tolist()
    ]
    width = max((len(c) for row in cells for c in row), default=1)
    return "\n".join(" ".join(c.ljust(width) for c in row).rstrip() for row in cells)


def _ticks(table: np.ndarray, p: int) -> dict[tuple[int, int, int], list[int]]:
    """(op, stage, micro) -> the ticks it runs at."""
    ticks: dict[tuple[int, int, int], list[int]] = {}
    for t, d in zip(*np.nonzero(table[..., 0]), strict=True):
        op, i, j = (int(x) for x in table[t, d])
        ticks.setdefault((op, j * p + int(d), i), []).append(int(t))
    return ticks


@pytest.mark.parametrize("kind,p,m,v", GRID, ids=IDS)
def test_schedule(kind, p, m, v):
    table = sched.build(kind, p, m, v)
    assert table.dtype == np.int32 and table.ndim == 3 and table.shape[1:] == (p, 3)
    sched.check(table, p, m, v)
    assert math.isclose(sched.bubble(table), sched.formula(kind, p, m, v))

    # independently of check: each (stage, micro) runs one forward and one backward, after it
    split = kind == "zb-h1"
    backward = sched.BACKWARD_INPUT if split else sched.BACKWARD
    ticks = _ticks(table, p)
    for s in range(v * p):
        for i in range(m):
            (f,) = ticks[(sched.FORWARD, s, i)]
            (b,) = ticks[(backward, s, i)]
            assert f < b
            if split:
                (w,) = ticks[(sched.BACKWARD_WEIGHT, s, i)]
                assert b < w
    assert sum(len(t) for t in ticks.values()) == v * p * m * (3 if split else 2)

    held = sched.in_flight(table)
    if kind == "afab":
        assert held == m
    elif kind in ("1f1b", "zb-h1"):
        assert held == p
    else:  # device 0's warm-up plus one, in chunk activations
        assert held == min((v + 1) * p - 1, v * m)
        assert held < v * m or m == p
    assert sched.p2p_messages(table) == (m * (v * p - 1),) * 2
    lines = _render(table).splitlines()
    assert len(lines) == p and all(len(line.split()) == table.shape[0] for line in lines)


def test_render():
    assert _render(sched.build("1f1b", 2, 2)) == "F0 F1 .  B0 .  B1\n.  F0 B0 F1 B1 ."
    assert _render(sched.build("interleaved", 1, 1, 2)) == "F0a F0b B0b B0a"
    assert _render(sched.build("zb-h1", 1, 2)) == "F0 b0 W0 F1 b1 W1"


def _swap(table, a, b):
    table = table.copy()
    table[a], table[b] = table[b].copy(), table[a].copy()
    return table


def _corruptions():
    """Tables check must reject, each with what its error names."""
    p, m = 2, 2
    base = sched.build("1f1b", p, m)  # F0 F1 . B0 . B1 / . F0 B0 F1 B1 .
    zb = sched.build("zb-h1", p, m)  # device 1: . F0 b0 F1 b1 W0 W1
    dropped, repeated, idle = base.copy(), base.copy(), base.copy()
    dropped[5, 0] = (sched.IDLE, 0, 0)
    repeated[2, 0] = (sched.FORWARD, 0, 0)
    idle[2, 0] = (sched.IDLE, 1, 0)
    cases = [
        ("backward before forward", _swap(base, (1, 1), (2, 1)), m, 1, "before its FORWARD"),
        ("forward early", _swap(base, (0, 1), (1, 1)), m, 1, "before FORWARD of stage 0"),
        ("backward early", _swap(base, (2, 0), (3, 0)), m, 1, "before the backward of stage 1"),
        ("weight before input", _swap(zb, (2, 1), (5, 1)), m, 1, "before its BACKWARD_INPUT"),
        ("dropped backward", dropped, m, 1, "no backward of stage 0 micro 1"),
        ("repeated forward", repeated, m, 1, "duplicate: FORWARD of stage 0 micro 0"),
        ("idle with a micro", idle, m, 1, "IDLE with micro 1"),
        ("micro out of range", base, m - 1, 1, "out of range"),
        ("chunk out of range", sched.build("interleaved", p, m, 2), m, 1, "out of range"),
    ]
    return [pytest.param(table, p, m, v, message, id=name) for name, table, m, v, message in cases]


@pytest.mark.parametrize("table,p,m,v,message", _corruptions())
def test_check_rejects(table, p, m, v, message):
    with pytest.raises(ValueError, match=message):
        sched.check(table, p, m, v)


def test_check_names_tick_and_device():
    table = _swap(sched.build("1f1b", 2, 2), (1, 1), (2, 1))  # B0 at tick 1 on device 1
    with pytest.raises(ValueError, match="at tick 1, device 1"):
        sched.check(table, 2, 2, 1)


@pytest.mark.parametrize(
    "kind,p,m,v,message",
    [
        ("1f1b", 4, 2, 1, r"train.grad_accum \(m=2\) must be >= mesh.pipeline \(p=4\)"),
        ("zb-h1", 4, 3, 1, "must be >="),
        ("afab", 2, 4, 2, "v=2"),
        ("1f1b", 2, 4, 2, "v=2"),
        ("zb-h1", 2, 4, 2, "v=2"),
        ("interleaved", 4, 6, 2, "multiple"),
        ("gpipe", 2, 4, 1, "unknown"),
        ("1f1b", 0, 4, 1, ">= 1"),
    ],
)
def test_build_rejects(kind, p, m, v, message):
    with pytest.raises(ValueError, match=message):
        sched.build(kind, p, m, v)


def test_draw(tmp_path):
    pytest.importorskip("matplotlib")
    from ultrajax.tools import schedule_plot

    for kind, v in (("zb-h1", 1), ("interleaved", 2)):
        path = schedule_plot.draw(sched.build(kind, 4, 8, v), tmp_path / f"{kind}.png")
        assert path.stat().st_size > 1000
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_lockstep_time_counts_the_slowest_op_of_each_tick():
    """One SPMD program: a tick lasts its slowest op. p=4, m=8: AFAB's forwards and
    backwards never share a tick (33 forward-times); 1F1B's steady state pairs forwards
    on some devices with backwards on others, each such tick a backward long (40); ZB-H1's
    ops are all one forward long (27 = 3m + p - 1)."""
    times = {k: sched.lockstep(sched.build(k, 4, 8))[0] for k in ("afab", "1f1b", "zb-h1")}
    assert times == {"afab": 33.0, "1f1b": 40.0, "zb-h1": 27.0}
    time, bubble = sched.lockstep(sched.build("zb-h1", 4, 8))
    assert bubble == pytest.approx(3 / 27)
