"""A schedule table turned, on the host, into what the executor reads each tick: the
branch every device runs and the buffer slot every op reads and writes."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ultrajax.parallel.pipeline import schedules as sched

# what a device does at a tick (the op, with the first / last stage's extra work),
# decided per device and tick on the host
IDLE, FWD, FWD_FIRST, FWD_LAST, BWD, BWD_FIRST, BWD_IN, BWD_IN_FIRST, BWD_W = range(9)
# columns of the per-tick plan
COLUMNS = ("branch", "micro", "chunk", "res", "act", "grad", "cot", "act_in", "grad_in")


@dataclass(frozen=True)
class TickPlan:
    """A schedule table turned into what the executor reads each tick, per device.

    rows: (ticks, p, len(COLUMNS)) int32. res/act/grad/cot: the slot of the residual,
    input activation, input gradient and (zero bubble) W-pair buffers the op uses;
    act_in/grad_in: the slot an arriving activation / gradient goes to (the last slot of
    each buffer is a sink for "nothing arrives"). sends: (ticks, 2) bool, whether any
    device sends an activation / a gradient at that tick."""

    kind: str
    p: int
    m: int
    v: int
    table: np.ndarray
    rows: np.ndarray
    sends: np.ndarray
    slots: dict  # buffer -> number of real slots

    @property
    def ticks(self) -> int:
        return self.table.shape[0]


class _Pool:
    """Slots of one buffer on one device: take the lowest free, give back when read."""

    def __init__(self):
        self.held: dict = {}
        self.peak = 0

    def take(self, key) -> int:
        used = set(self.held.values())
        slot = next(i for i in range(len(used) + 1) if i not in used)
        self.held[key] = slot
        self.peak = max(self.peak, len(self.held))
        return slot

    def give(self, key) -> int:
        return self.held.pop(key)


FORWARD_ONLY = "forward"  # the evaluation's schedule: forwards only, nothing kept


def make_plan(kind: str, p: int, m: int, v: int = 1) -> TickPlan:
    """The table of `kind` (a schedule, or FORWARD_ONLY) and every buffer slot it needs,
    assigned on the host."""
    training = kind != FORWARD_ONLY
    if training:
        table = sched.build(kind, p, m, v)
        sched.check(table, p, m, v)
    else:
        table = sched.forward_only(p, m, v)
    ticks, n_stages = table.shape[0], v * p
    pools = {k: [_Pool() for _ in range(p)] for k in ("res", "act", "grad", "cot")}
    rows = np.zeros((ticks, p, len(COLUMNS)), np.int32)
    sends = np.zeros((ticks, 2), bool)
    col = {c: i for i, c in enumerate(COLUMNS)}
    for t in range(ticks):
        arrivals = []
        for d in range(p):
            op, i, j = (int(x) for x in table[t, d])
            s = j * p + d
            r = rows[t, d]
            r[col["act_in"]] = r[col["grad_in"]] = -1
            r[col["act"]] = r[col["grad"]] = r[col["res"]] = r[col["cot"]] = -1
            r[col["micro"]], r[col["chunk"]] = i, j
            first, last = s == 0, s == n_stages - 1
            if op == sched.IDLE:
                r[col["branch"]] = IDLE
                continue
            if op == sched.FORWARD:
                r[col["branch"]] = FWD_FIRST if first else FWD_LAST if last else FWD
                if not first:
                    r[col["act"]] = pools["act"][d].give((s, i))
                if training:
                    r[col["res"]] = pools["res"][d].take((s, i))
                if last and training:  # the loss gradient, read by this stage's backward
                    r[col["grad"]] = pools["grad"][d].take((s, i))
                elif not last:
                    arrivals.append(("act", (d + 1) % p, (s + 1, i)))
                    sends[t, 0] = True
                continue
            if op != sched.BACKWARD_WEIGHT:
                r[col["grad"]] = pools["grad"][d].give((s, i))
            if op == sched.BACKWARD:
                r[col["branch"]] = BWD_FIRST if first else BWD
                r[col["res"]] = pools["res"][d].give((s, i))
            elif op == sched.BACKWARD_INPUT:  # the residuals are done with: W reads pairs
                r[col["branch"]] = BWD_IN_FIRST if first else BWD_IN
                r[col["res"]] = pools["res"][d].give((s, i))
                r[col["cot"]] = pools["cot"][d].take((s, i))
            else:  # BACKWARD_WEIGHT
                r[col["branch"]] = BWD_W
                r[col["cot"]] = pools["cot"][d].give((s, i))
            if op != sched.BACKWARD_WEIGHT and not first:
                arrivals.append(("grad", (d - 1) % p, (s - 1, i)))
                sends[t, 1] = True
        for buf, dest, key in arrivals:  # after this tick's reads: slots may be reused
            rows[t, dest, col[f"{buf}_in"]] = pools[buf][dest].take(key)
    # a slot nobody uses (-1): the arriving buffers' extra last slot (written, never read);
    # the residuals and pairs are touched only under their own ops: slot 0, never used
    slots = {k: max(1, max(pl.peak for pl in pools[k])) for k in pools}
    for k in slots:
        for c in (k, f"{k}_in") if k in ("act", "grad") else (k,):
            column = rows[..., col[c]]
            column[column < 0] = slots[k] if k in ("act", "grad") else 0
    for k, pool in pools.items():
        leftover = [pl.held for pl in pool if pl.held]
        if leftover:
            raise RuntimeError(f"schedule {kind}: {k} slots still held at the end: {leftover}")
    return TickPlan(kind, p, m, v, table, rows, sends, slots)


def layer_order(n_layers: int, p: int, v: int) -> np.ndarray:
    """Model layer index of each row of the stack as the executor holds it: device d's
    rows are its chunks d, d + p, ... in turn (the identity unless interleaved)."""
    per = n_layers // (p * v)
    order = [(j * p + d) * per + k for d in range(p) for j in range(v) for k in range(per)]
    return np.asarray(order, np.int32)
