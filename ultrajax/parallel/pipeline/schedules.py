"""Pipeline schedules as data: a table of which op each device runs at each tick.

A schedule is a table, not code, so one executor runs any of them (it only reads the
table), and the bubble, the activations held and the sends are counted from the very
table that runs instead of from a formula about it. `check` proves a table obeys the
dependencies; the tests prove each builder's table hits its schedule's known bubble.

Table: int32 array [T, p, 3]; entry [t, d] is (op, micro, chunk): device d runs `op` on
micro-batch `micro` for its local model chunk `chunk` at tick t. Device d's chunk j is the
virtual stage s = j * p + d of S = v * p stages in model order (v = 1: chunk is 0, s = d).
Every op takes one tick; a result made at tick t is usable from tick t + 1 on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

IDLE = 0
FORWARD = 1
BACKWARD = 2  # input and weight gradients together
BACKWARD_INPUT = 3  # zero bubble's B: the input gradient only, on the critical path
BACKWARD_WEIGHT = 4  # zero bubble's W: the weight gradient, free to fill idle ticks

_NAMES = ("IDLE", "FORWARD", "BACKWARD", "BACKWARD_INPUT", "BACKWARD_WEIGHT")
_NEVER = 1 << 62  # the tick of an op not done yet
# per op: the ops on the same (stage, micro) it may not follow (no op twice, one backward)
_CLASH = (
    (),
    (FORWARD,),
    (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT),
    (BACKWARD, BACKWARD_INPUT),
    (BACKWARD, BACKWARD_WEIGHT),
)

_Op = tuple[int, int, int]  # (op, micro, chunk)


def _chunks(table: np.ndarray) -> int:
    """v read off a table: one more than the largest chunk it runs."""
    return int(table[..., 2][table[..., 0] != IDLE].max(initial=0)) + 1


def _missing(op: int, s: int, i: int, S: int, done: dict, t: int) -> str | None:
    """The dependency that (op, stage s, micro i) at tick t lacks, or None if it may run.

    One copy of the rules, shared by the builders (to wait) and `check` (to reject).
    """

    def before(kind: int, stage: int) -> bool:
        return done.get((kind, stage, i), _NEVER) < t

    if op == FORWARD:
        if s > 0 and not before(FORWARD, s - 1):
            return f"FORWARD of stage {s} micro {i} before FORWARD of stage {s - 1}"
    elif op in (BACKWARD, BACKWARD_INPUT):
        if not before(FORWARD, s):
            return f"{_NAMES[op]} of stage {s} micro {i} before its FORWARD"
        if s < S - 1 and not (before(BACKWARD, s + 1) or before(BACKWARD_INPUT, s + 1)):
            return f"{_NAMES[op]} of stage {s} micro {i} before the backward of stage {s + 1}"
    elif op == BACKWARD_WEIGHT:
        if not before(BACKWARD_INPUT, s):
            return f"BACKWARD_WEIGHT of stage {s} micro {i} before its BACKWARD_INPUT"
    return None


def _list_schedule(p: int, v: int, orders: Sequence[Sequence[_Op]]) -> np.ndarray:
    """Greedy list scheduling: each tick, every device runs the next op of its own order
    if that op's inputs were made at an earlier tick, else idles. The orders decide the
    schedule; this only times them."""
    S = p * v
    done: dict[tuple[int, int, int], int] = {}
    pos = [0] * p
    rows = []
    while any(pos[d] < len(orders[d]) for d in range(p)):
        t = len(rows)
        row = [(IDLE, 0, 0)] * p
        for d in range(p):
            if pos[d] < len(orders[d]):
                op, i, j = orders[d][pos[d]]
                if _missing(op, j * p + d, i, S, done, t) is None:
                    row[d] = (op, i, j)
        if all(op == IDLE for op, _, _ in row):  # nothing new is made: nothing ever will be
            raise RuntimeError(f"pipeline schedule deadlocks at tick {t} (a builder bug)")
        for d, (op, i, j) in enumerate(row):
            if op != IDLE:
                done[(op, j * p + d, i)] = t
                pos[d] += 1
        rows.append(row)
    return np.asarray(rows, dtype=np.int32).reshape(len(rows), p, 3)


def _validate(kind: str, p: int, m: int, v: int) -> None:
    """Reject what no builder makes, in the config's words where they come from it."""
    schedule = SCHEDULES.get(kind)
    if schedule is None:
        raise ValueError(f"unknown pipeline schedule {kind!r}; expected one of {NAMES}")
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"pipeline schedule needs p, m, v >= 1, got p={p}, m={m}, v={v}")
    if v != 1 and not schedule.chunks:
        raise ValueError(f"{kind} holds one model chunk per device (v=1), got v={v}")
    if m < p:
        raise ValueError(
            f"train.grad_accum (m={m}) must be >= mesh.pipeline (p={p}): "
            "the pipeline needs a micro-batch per stage to fill"
        )
    if schedule.chunks and v > 1 and m % p:
        raise ValueError(
            f"{kind} needs train.grad_accum (m={m}) to be a multiple of mesh.pipeline (p={p})"
        )


def afab(p: int, m: int) -> np.ndarray:
    """All forwards, then all backwards (GPipe): simplest, but every device holds all m
    micro-batches' activations at the turn."""
    _validate("afab", p, m, 1)
    orders = [
        [(FORWARD, i, 0) for i in range(m)] + [(BACKWARD, i, 0) for i in range(m)] for _ in range(p)
    ]
    return _list_schedule(p, 1, orders)


def one_f_one_b(p: int, m: int) -> np.ndarray:
    """1F1B (PipeDream-Flush): device d runs p - d - 1 warm-up forwards, then alternates
    one forward and one backward, then drains the backwards. Same bubble as AFAB, but a
    micro-batch's activations are freed as soon as possible: at most p held, not m."""
    _validate("1f1b", p, m, 1)
    orders = []
    for d in range(p):
        warm = min(p - d - 1, m)
        order = [(FORWARD, i, 0) for i in range(warm)]
        for k in range(m - warm):
            order += [(FORWARD, warm + k, 0), (BACKWARD, k, 0)]
        order += [(BACKWARD, k, 0) for k in range(m - warm, m)]
        orders.append(order)
    return _list_schedule(p, 1, orders)


def interleaved(p: int, m: int, v: int) -> np.ndarray:
    """Megatron's interleaved 1F1B (Narayanan et al. 2021): each device holds v chunks
    (virtual stages d, d + p, ...), so a micro-batch crosses the devices v times and the
    fill and drain take 1/v as long; the price is v times the sends.

    Micro-batches go in groups of p: a device runs its k-th forward on chunk
    (k // p) % v of micro-batch (k // (p v)) p + k % p, and its backwards in the same
    order over chunks reversed. Device d warms up with (v - 1) p + 2 (p - d - 1) forwards
    (the ticks until its first backward arrives), then alternates as 1F1B does. Needs
    m % p == 0 so every group is whole. v = 1 is plain 1F1B.
    """
    _validate("interleaved", p, m, v)
    if v == 1:
        return one_f_one_b(p, m)
    n = v * m

    def forward(k: int) -> tuple[int, int]:
        group, r = divmod(k, p * v)
        return group * p + r % p, r // p

    def backward(k: int) -> tuple[int, int]:
        micro, chunk = forward(k)
        return micro, v - 1 - chunk

    orders = []
    for d in range(p):
        warm = min((v - 1) * p + 2 * (p - d - 1), n)
        order = [(FORWARD, *forward(k)) for k in range(warm)]
        for k in range(n - warm):
            order += [(FORWARD, *forward(warm + k)), (BACKWARD, *backward(k))]
        order += [(BACKWARD, *backward(k)) for k in range(n - warm, n)]
        orders.append(order)
    return _list_schedule(p, v, orders)


def zb_h1(p: int, m: int) -> np.ndarray:
    """Zero-bubble H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): the backward
    splits into B (input gradient, which the previous stage waits for) and W (weight
    gradient, which nobody waits for), and Ws are deferred into the drain's idle ticks.

    Device d runs 1F1B's order with B for the backward, and a W after each steady-state
    B except the first d of them; the Ws it owes at the drain fill exactly the ticks 1F1B
    leaves idle there. A W frees its micro-batch's activations, so deferring d Ws on a
    device whose first B comes after p - d forwards holds p, as 1F1B's device 0 does.
    """
    _validate("zb-h1", p, m, 1)
    orders = []
    for d in range(p):
        warm = min(p - d - 1, m)
        order = [(FORWARD, i, 0) for i in range(warm)]
        weights = 0
        for k in range(m - warm):
            order += [(FORWARD, warm + k, 0), (BACKWARD_INPUT, k, 0)]
            if k >= d:
                order.append((BACKWARD_WEIGHT, weights, 0))
                weights += 1
        for k in range(m - warm, m):
            order += [(BACKWARD_INPUT, k, 0), (BACKWARD_WEIGHT, weights, 0)]
            weights += 1
        order += [(BACKWARD_WEIGHT, i, 0) for i in range(weights, m)]
        orders.append(order)
    return _list_schedule(p, 1, orders)


def forward_only(p: int, m: int, v: int = 1) -> np.ndarray:
    """Forwards only (evaluation): every micro-batch through every chunk in turn, as soon
    as its input exists; (m + p - 1) v-ish ticks, nothing held between ticks but the
    activations in flight."""
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"pipeline schedule needs p, m, v >= 1, got p={p}, m={m}, v={v}")
    orders = [[(FORWARD, i, j) for j in range(v) for i in range(m)] for _ in range(p)]
    return _list_schedule(p, v, orders)


@dataclass(frozen=True)
class Schedule:
    """A schedule's builder and the properties the executor, the memory and step-time
    models, the planner and the config's validation read (never its name)."""

    name: str
    make: Callable[[int, int, int], np.ndarray]  # (p, m, v) -> table
    chunks: bool  # v > 1 model chunks per device (then m must be a multiple of p)
    splits_backward: bool  # B (input gradient) and W (weight gradient) apart: zero bubble
    work: Callable[[int, int], int]  # ticks of work per device, (m, v) -> ticks
    bubble: str  # the textbook bubble fraction, as printed
    planned: bool  # the planner tries it (AFAB: 1F1B's bubble, m micro-batches held)


SCHEDULES = {
    s.name: s
    for s in (
        Schedule("afab", lambda p, m, v: afab(p, m), False, False, lambda m, v: m,
                 "(p-1)/(m+p-1)", False),
        Schedule("1f1b", lambda p, m, v: one_f_one_b(p, m), False, False, lambda m, v: m,
                 "(p-1)/(m+p-1)", True),
        Schedule("zb-h1", lambda p, m, v: zb_h1(p, m), False, True, lambda m, v: 3 * m,
                 "(p-1)/(3m+p-1)", True),
        Schedule("interleaved", interleaved, True, False, lambda m, v: v * m,
                 "(p-1)/(v·m+p-1)", True),
    )
}  # fmt: skip
NAMES = tuple(SCHEDULES)
PLAIN = "1f1b"  # one chunk, one backward: the reference the step-time model scales from


def build(kind: str, p: int, m: int, v: int = 1) -> np.ndarray:
    """The table of schedule `kind` (a name of SCHEDULES) for p devices, m >= p
    micro-batches and v model chunks per device (v > 1 only where the schedule chunks)."""
    _validate(kind, p, m, v)
    return SCHEDULES[kind].make(p, m, v)


def check(table: np.ndarray, p: int, m: int, v: int = 1) -> None:
    """Raise ValueError naming the broken rule (with its tick and device) unless `table`
    runs every (stage, micro) forward once and its backward once (as BACKWARD, or as
    BACKWARD_INPUT then BACKWARD_WEIGHT), each after what it needs."""
    table = np.asarray(table)
    if table.ndim != 3 or table.shape[1:] != (p, 3):
        raise ValueError(f"table shape {table.shape} is not [T, p={p}, 3]")
    S = p * v
    done: dict[tuple[int, int, int], int] = {}
    for t in range(table.shape[0]):
        for d in range(p):
            op, i, j = (int(x) for x in table[t, d])
            where = f"at tick {t}, device {d}"
            if op == IDLE:
                if i or j:
                    raise ValueError(f"IDLE with micro {i}, chunk {j} {where}")
                continue
            if not IDLE < op <= BACKWARD_WEIGHT:
                raise ValueError(f"unknown op {op} {where}")
            if not (0 <= i < m and 0 <= j < v):
                raise ValueError(f"micro {i} or chunk {j} out of range (m={m}, v={v}) {where}")
            s = j * p + d
            for c in _CLASH[op]:
                if (c, s, i) in done:
                    raise ValueError(
                        f"duplicate: {_NAMES[op]} of stage {s} micro {i} after its {_NAMES[c]} "
                        f"at tick {done[(c, s, i)]}, {where}"
                    )
            missing = _missing(op, s, i, S, done, t)
            if missing:
                raise ValueError(f"{missing} {where}")
            done[(op, s, i)] = t
    for s in range(S):
        for i in range(m):
            where = f"(device {s % p}, chunk {s // p})"
            if (FORWARD, s, i) not in done:
                raise ValueError(f"no FORWARD of stage {s} micro {i} {where}")
            split = (BACKWARD_INPUT, s, i) in done
            if (BACKWARD, s, i) not in done and not split:
                raise ValueError(f"no backward of stage {s} micro {i} {where}")
            if split and (BACKWARD_WEIGHT, s, i) not in done:
                raise ValueError(f"no BACKWARD_WEIGHT of stage {s} micro {i} {where}")


def bubble(table: np.ndarray) -> float:
    """Idle (device, tick) slots over all slots."""
    return float(np.mean(np.asarray(table)[..., 0] == IDLE))


def formula(kind: str, p: int, m: int, v: int = 1) -> float:
    """The textbook bubble fraction, in this module's unit-time convention: every op
    takes one tick, so 1F1B's and AFAB's BACKWARD counts as one tick, like a FORWARD.

    afab, 1f1b: (p - 1) / (m + p - 1): each device works 2m ticks of 2 (m + p - 1).
    interleaved: (p - 1) / (v m + p - 1): a tick is one chunk's op (1/v of a stage's), so
    2 v m ticks of work and the same 2 (p - 1) idle.
    zb-h1: (p - 1) / (3 m + p - 1): F, B and W a tick each, 3m ticks of work and p - 1
    idle (1F1B's drain is filled with Ws; its fill is still idle).
    """
    _validate(kind, p, m, v)
    work = SCHEDULES[kind].work(m, v)
    return (p - 1) / (work + p - 1)


# Relative cost of each op when the stage's forward costs 1: a backward does two matmuls
# per forward matmul; zero bubble splits it in halves (Qi et al. 2023's assumption).
COSTS = {IDLE: 0.0, FORWARD: 1.0, BACKWARD: 2.0, BACKWARD_INPUT: 1.0, BACKWARD_WEIGHT: 1.0}


def lockstep(table: np.ndarray, costs: dict | None = None) -> tuple[float, float]:
    """(time, bubble) of a table run as one SPMD program, in units of a stage forward.

    The devices exchange activations and gradients every tick, so a tick lasts as long
    as the slowest op in it: time = sum over ticks of the most expensive op that tick
    (a chunk's op costs 1/v). The bubble is the share of that time a device would not
    need alone: 1 - (its work) / time. Unit-time tables hide this: in 1F1B's steady
    state half the devices run a forward while the others run a backward, so every
    such tick costs a backward."""
    costs = COSTS if costs is None else costs
    ops = np.asarray(table)[..., 0]
    v = _chunks(table)
    cost = np.vectorize(lambda o: costs[int(o)])(ops) / v
    time = float(cost.max(axis=1).sum())
    work = float(cost.sum(axis=0).max())
    return time, 1.0 - work / time


def in_flight(table: np.ndarray) -> int:
    """The most micro-batch activations (one per micro-batch and chunk) any device holds
    at once: a FORWARD stores one; BACKWARD frees it, and for zero bubble
    BACKWARD_WEIGHT does (the weight gradient still reads the stored input).

    Measured from the tables: afab m (every device); 1f1b p on device 0 (p - d on device
    d); zb-h1 p on every device (later devices defer more Ws); interleaved
    min((v + 1) p - 1, v m) chunk activations on device 0 (its warm-up plus one; 2 fewer
    per device down), e.g. 11 for p=4, m=8, v=2. A chunk is 1/v of a device's layers, so
    that is p + (p - 1)/v devices' worth of layers against 1F1B's p.
    """
    return max(in_flight_per_device(table), default=0)


def in_flight_per_device(table: np.ndarray) -> list[int]:
    """`in_flight`'s count for each device."""
    ops = np.asarray(table)[..., 0]
    stored = (ops == FORWARD).astype(np.int64) - ((ops == BACKWARD) | (ops == BACKWARD_WEIGHT))
    return [int(x) for x in np.cumsum(stored, axis=0).max(axis=0, initial=0)]


def p2p_messages(table: np.ndarray) -> tuple[int, int]:
    """(activation sends, gradient sends): a FORWARD sends its output to the next stage
    unless it is the last; a backward (BACKWARD or BACKWARD_INPUT) sends its input
    gradient to the previous stage unless it is the first."""
    table = np.asarray(table)
    p = table.shape[1]
    S = p * _chunks(table)
    stage = table[..., 2] * p + np.arange(p)[None, :]
    ops = table[..., 0]
    activations = int(np.sum((ops == FORWARD) & (stage < S - 1)))
    backward = (ops == BACKWARD) | (ops == BACKWARD_INPUT)
    gradients = int(np.sum(backward & (stage > 0)))
    return activations, gradients
