"""Which collectives of a compiled step could hide behind compute, read from its HLO.

Flags (train/overlap.py) only let XLA's scheduler overlap what the program allows: a
collective can run beside a computation only if neither waits for the other. So for each
collective we list the compute it depends on inside its own computation (`waits_on`) and
the compute that is neither its ancestor nor its descendant there (`beside`). Nothing
beside it: it is exposed whatever the scheduler does. An async pair (`X-start` ...
`X-done`) starts after its start's operands and is needed by its done's users; `span` is
the compute the module's own schedule puts between the two (a GPU's; XLA:CPU runs
collectives synchronously).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from ultrajax.cost.units import fmt_bytes
from ultrajax.tools import hlo

COMPUTE_OPS = ("dot", "convolution", "custom-call")  # compute wherever they appear
CALLERS = ("fusion", "call", "while", "conditional", "async-start")  # compute if callees are

_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
_CONTROL = re.compile(r"control-predecessors=\{([^}]*)\}")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_NAME = re.compile(r"%?([\w.\-]+)")


@dataclass
class Row:
    name: str  # the collective (its start, for an async pair)
    kind: str  # hlo's kinds: all-reduce, all-gather, reduce-scatter, all-to-all, ...
    computation: str
    group: int  # devices in one replica group (a permute: in its ring)
    bytes: float  # the result's bytes, one execution
    count: int  # executions per step
    dtype: str = ""
    axis: str = ""  # the mesh axes its groups span ("" without a mesh)
    where: str = ""  # the JAX op that asked for it (metadata op_name)
    waits_on: list[str] = field(default_factory=list)
    beside: list[str] = field(default_factory=list)
    span: list[str] = field(default_factory=list)  # async only: compute between start, done

    @property
    def verdict(self) -> str:
        return "can overlap" if self.beside else "exposed"


def _opcode(rest: str) -> str:
    return rest.split("(", 1)[0].strip()


def _callees(rest: str) -> list[str]:
    names = [c for _, c in hlo._CALLEE.findall(rest)]
    b = hlo._BRANCHES.search(rest)
    return names + (_NAME.findall(b.group(1)) if b else [])


def _operands(rest: str, names: set[str]) -> list[str]:
    """The instructions of this computation that `rest` reads: its operands (inside the
    opcode's parentheses) and its control predecessors."""
    start, depth = rest.find("("), 0
    end = len(rest)
    for i in range(start, len(rest)):
        depth += rest[i] == "("
        depth -= rest[i] == ")"
        if depth == 0:
            end = i
            break
    found = _NAME.findall(rest[start + 1 : end])
    c = _CONTROL.search(rest)
    found += _NAME.findall(c.group(1)) if c else []
    return [n for n in found if n in names]


def _computing(mod: hlo.HloModule) -> set[str]:
    """Computations that do compute themselves or through what they call."""
    memo: dict[str, bool] = {}

    def visit(comp: str) -> bool:
        if comp not in memo:
            memo[comp] = False  # computations form a DAG; this only guards a bad module
            memo[comp] = any(
                _opcode(rest) in COMPUTE_OPS or any(visit(c) for c in _callees(rest))
                for _, _, rest in mod.computations.get(comp, [])
            )
        return memo[comp]

    return {c for c in mod.computations if visit(c)}


class _Graph:
    """One computation's instructions as a dependency graph, in printed (schedule) order."""

    def __init__(self, instrs, computing: set[str]):
        self.order = [name for name, _, _ in instrs]
        names = set(self.order)
        self.rest = {name: rest for name, _, rest in instrs}
        self.operands = {n: _operands(r, names) for n, r in self.rest.items()}
        self.users: dict[str, list[str]] = {n: [] for n in self.order}
        for n, ops in self.operands.items():
            for o in ops:
                self.users[o].append(n)
        self.compute = {
            n
            for n, r in self.rest.items()
            if _opcode(r) in COMPUTE_OPS
            or (_opcode(r) in CALLERS and any(c in computing for c in _callees(r)))
        }

    def reach(self, start: str, edges: dict[str, list[str]]) -> set[str]:
        seen, stack = set(), [start]
        while stack:
            for m in edges[stack.pop()]:
                if m not in seen:
                    seen.add(m)
                    stack.append(m)
        return seen

    def done_of(self, start: str) -> str:
        """The `-done` that ends an async `-start` (through any `-update`), else start."""
        if not _opcode(self.rest[start]).endswith("-start"):
            return start
        current, ends = start, ("-update", "-done")
        while True:
            nxt = [u for u in self.users[current] if _opcode(self.rest[u]).endswith(ends)]
            if not nxt:
                return current
            current = nxt[0]
            if _opcode(self.rest[current]).endswith("-done"):
                return current


def _groups(rest: str, kind: str, n_devices: int) -> list[list[int]]:
    m = _PAIRS.search(rest)
    if kind == "collective-permute" and m:
        return [hlo._ints(p) for p in re.findall(r"\{(\d+,\d+)\}", m.group(1))]
    return hlo.replica_groups(rest, n_devices)


def _ring(pairs: list[list[int]]) -> int:
    """Devices in the largest cycle of a permute's source-target pairs."""
    parent = {i: i for p in pairs for i in p}

    def root(i):
        while parent[i] != i:
            i = parent[i]
        return i

    for a, b in pairs:
        parent[root(a)] = root(b)
    return max(Counter(map(root, parent)).values(), default=1)


def axes_of(groups: list[list[int]], mesh: dict[str, int]) -> str:
    """The mesh axes along which a collective's groups (or permute pairs) vary, joined
    with '+': device i of the program is the mesh's flat position i."""
    names, sizes = list(mesh), list(mesh.values())
    ids = [i for g in groups for i in g]
    if not ids or max(ids) >= math.prod(sizes):
        return "?"
    varying = set()
    for g in groups:
        coords = np.array(np.unravel_index(g, sizes))  # [axes, devices of the group]
        varying |= {a for a in range(len(names)) if len(set(coords[a])) > 1}
    return "+".join(names[a] for a in sorted(varying)) or "-"


def _async_callers(mod: hlo.HloModule) -> dict[str, tuple[str, str]]:
    """Wrapped computation -> (caller, its `async-start`): a reduce-scatter or all-to-all
    that a GPU runs asynchronously lives in a computation of its own."""
    out = {}
    for comp, instrs in mod.computations.items():
        for name, _, rest in instrs:
            if _opcode(rest) == "async-start":
                for callee in _callees(rest):
                    out[callee] = (comp, name)
    return out


def rows(hlo_text: str, mesh: dict[str, int] | None = None) -> list[Row]:
    """One row per collective of a compiled module, in module order. `mesh`: axis name ->
    size in the mesh's order, to name the axes each collective runs over."""
    mod = hlo.parse_module(hlo_text)
    found, _ = hlo.collectives(hlo_text)
    computing, wrapped = _computing(mod), _async_callers(mod)
    text = {(comp, n): r for comp, instrs in mod.computations.items() for n, _, r in instrs}
    graphs: dict[str, _Graph] = {}
    out = []
    for c in found:
        rest = text[(c.computation, c.name)]
        comp, start = wrapped.get(c.computation, (c.computation, c.name))
        if comp not in graphs:
            graphs[comp] = _Graph(mod.computations[comp], computing)
        g = graphs[comp]
        done = g.done_of(start)
        before = g.reach(start, g.operands)
        after = g.reach(start, g.users) | g.reach(done, g.users)
        compute = [n for n in g.order if n in g.compute]
        op = _OP_NAME.search(rest)
        lo, hi = g.order.index(start), g.order.index(done)
        groups = _groups(rest, c.kind, mod.n_devices)
        out.append(
            Row(
                name=c.name,
                kind=c.kind,
                computation=comp,
                group=_ring(groups) if c.kind == "collective-permute" else c.group,
                bytes=c.bytes,
                count=c.count,
                dtype=c.dtype,
                axis=axes_of(groups, mesh) if mesh else "",
                where=op.group(1) if op else "",
                waits_on=[n for n in compute if n in before],
                beside=[n for n in compute if n not in before and n not in after],
                span=[n for n in g.order[lo + 1 : hi] if n in g.compute],
            )
        )
    return out


def _names(names: list[str], most: int = 2) -> str:
    if not names:
        return "-"
    more = f" +{len(names) - most}" if len(names) > most else ""
    return ", ".join(names[:most]) + more


def _where(op_name: str) -> str:
    """The op's name without the jit and shard_map around every op, and a loop body
    spelled 'loop': '.../shard_map/jvp()/while/body/closed_call/ppermute' ->
    'jvp()/loop/ppermute'. A combined collective ('(a:b:...)') names its parts."""
    short = re.sub(r"^jit\([^)]*\)/", "", op_name).removeprefix("shard_map/")
    short = short.replace("while/body/closed_call", "loop").replace("while/body", "loop")
    m = re.search(r"(?:^|/)\((.*:.*)\)$", short)
    if m:
        parts = m.group(1).split(":")
        kinds = list(dict.fromkeys(_where(p) for p in parts))
        return f"{short[: m.start(1) - 1]}{len(parts)} combined: {_names(kinds, 1)}"
    return short


def table(found: list[Row]) -> str:
    """The rows as a markdown table, then the bytes per step that could overlap and the
    bytes that are exposed (each row's bytes x its count)."""
    head = "| collective | kind | axis (group) | bytes | per step | where | waits on | beside | in flight over | verdict |"  # noqa: E501
    lines = [head, "|" + "---|" * 10]
    for r in found:
        axis = f"{r.axis} ({r.group})" if r.axis else str(r.group)
        span = _names(r.span) if r.span else "-"
        lines.append(
            f"| {r.name} | {r.kind} | {axis} | {fmt_bytes(r.bytes)} {r.dtype} | {r.count} |"
            f" {_where(r.where)} | {len(r.waits_on)}: {_names(r.waits_on[-2:])} |"
            f" {len(r.beside)}: {_names(r.beside)} | {span} | {r.verdict} |"
        )
    return "\n".join([*lines, "", summary(found)])


def summary(found: list[Row]) -> str:
    """One line: the step's collective bytes, how many could overlap, how many are exposed."""
    total = sum(r.bytes * r.count for r in found)
    parts = []
    for verdict in ("can overlap", "exposed"):
        mine = [r for r in found if r.verdict == verdict]
        b = sum(r.bytes * r.count for r in mine)
        share = f" ({b / total:.0%})" if total else ""
        parts.append(f"{verdict} {fmt_bytes(b)}{share} in {len(mine)}")
    return f"{len(found)} collectives, {fmt_bytes(total)} a step: " + ", ".join(parts)
