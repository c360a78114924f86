"""Reading compiled programs: every collective in `compiled.as_text()`, counted as
many times as it runs, with its payload and ring traffic per device; and the
module as the SPMD partitioner left it."""

from __future__ import annotations

import glob
import math
import os
import re
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field

import jax
import numpy as np
from jax.experimental.compilation_cache import compilation_cache

from ultrajax.config.schema import Config
from ultrajax.cost.comms import KINDS, expected, expected_by_kind
from ultrajax.parallel.grads import LAST_MICRO_BATCH

DTYPE_BYTES = {
    "pred": 1,
    "s4": 0.5,
    "u4": 0.5,
    "s8": 1,
    "u8": 1,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "f8e4m3": 1,
    "f8e5m2fnuz": 1,
    "f8e4m3fnuz": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}

_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\) -> .*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*)$")
_CALLEE = re.compile(
    r"\b(calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'known_trip_count"?\s*:\s*\{\s*"?n"?\s*:\s*"?(\d+)')


def _split_shape(rest: str) -> tuple[str, str]:
    """'(f32[2], f32[3]) all-reduce(...)' -> ('(f32[2], f32[3])', 'all-reduce(...)')."""
    rest = rest.strip()
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return rest[: i + 1], rest[i + 1 :].strip()
    shape, _, tail = rest.partition(" ")
    return shape, tail.strip()


def _top_level(shape: str) -> list[str]:
    """Elements of a tuple shape at depth one ('(a, (b, c))' -> ['a', '(b, c)'])."""
    shape = re.sub(r"/\*.*?\*/", "", shape).strip()
    if not shape.startswith("("):
        return [shape]
    inner, parts, depth, cur = shape[1:-1], [], 0, ""
    for ch in inner:
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
            continue
        depth += ch in "([{"
        depth -= ch in ")]}"
        cur += ch
    if cur.strip():
        parts.append(cur.strip())
    return parts


def shape_bytes(shape: str) -> float:
    """Bytes of an HLO shape string, tuples summed; layouts `{1,0}` ignored."""
    total = 0.0
    for dtype, dims in _ARRAY.findall(shape):
        if dtype not in DTYPE_BYTES:
            continue
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * DTYPE_BYTES[dtype]
    return total


_MESH_GROUPS = re.compile(  # mesh[a=2,b=4][, device_ids=(...)] {a[:(pre)size],...}
    r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(((?:[^()]|\([^()]*\))*)\))?"
    r"\s*\{([^}]*)\}"
)
_IOTA_GROUPS = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_LIST_GROUPS = re.compile(r"replica_groups=\{((?:\{[\d,\s]*\},?\s*)*)\}")
_AXIS_REF = re.compile(r"^'?([^':]*)'?(?::\((\d+)\)(\d+))?$")


def _ints(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", text or "")]


def _iota(dims: list[int], perm: list[int] | None = None) -> np.ndarray:
    """XLA's iota device list `[dims]T(perm)`: 0..N-1 shaped to dims, then transposed."""
    a = np.arange(math.prod(dims)).reshape(dims)
    return a.transpose(perm) if perm else a


def _mesh_devices(sizes: list[int], device_ids: str | None) -> np.ndarray:
    """The mesh's devices as an array of its axis sizes. `device_ids` is absent for a
    plain iota, `[dims]T(perm)` for a transposed iota, or the ids listed."""
    if not device_ids:
        return np.arange(math.prod(sizes)).reshape(sizes)
    m = re.fullmatch(r"\s*\[([\d,]+)\](?:T\(([\d,]+)\))?\s*", device_ids)
    flat = _iota(_ints(m.group(1)), _ints(m.group(2))) if m else np.array(_ints(device_ids))
    return flat.reshape(sizes)


def _mesh_groups(mesh: str, device_ids: str | None, refs: str) -> np.ndarray:
    """[groups, size] of the mesh form: the named axes vary within a group, the others
    across groups. A sub-axis `a:(pre)size` is the middle piece of axis a split major to
    minor as [pre, size, rest] (XLA's MeshAxesReplicaGroupList)."""
    names, sizes = [], []
    for item in filter(None, (x.strip() for x in mesh.split(","))):
        name, _, size = item.rpartition("=")
        names.append(name.strip().strip("'\""))
        sizes.append(int(size))
    wanted = []  # (axis index, pre, size) in the order printed
    for ref in filter(None, (r.strip() for r in refs.split(","))):
        name, pre, sub = _AXIS_REF.match(ref).groups()
        i = names.index(name)
        wanted.append((i, int(pre or 1), int(sub or sizes[i])))
    dims, where = [], {}  # every axis cut into its pieces, major to minor
    for i, full in enumerate(sizes):
        prefix = 1
        for _, pre, sub in sorted(w for w in wanted if w[0] == i and w[2] != full):
            if pre != prefix:
                dims.append(pre // prefix)
            where[(i, pre, sub)] = len(dims)
            dims.append(sub)
            prefix = pre * sub
        if prefix == 1:
            where[(i, 1, full)] = len(dims)
            dims.append(full)
        elif prefix != full:
            dims.append(full // prefix)
    grouped = [where[w] for w in wanted]
    rest = [d for d in range(len(dims)) if d not in grouped]
    size = math.prod(dims[d] for d in grouped)
    devices = _mesh_devices(sizes, device_ids).reshape(dims)
    return devices.transpose(rest + grouped).reshape(-1, size)


def replica_groups(attrs: str, n_devices: int) -> list[list[int]]:
    """The device groups of a collective, from any form XLA prints: `{{0,1},{2,3}}`,
    the iota list `[G,S]<=[dims]T(perm)` (0..N-1 shaped to dims, transposed by perm,
    split into G groups of S), and the mesh form `mesh[a=2,b=4], device_ids=(...) {b}`
    (the named axes of the mesh's device array). `{}` or none: every device."""
    m = _MESH_GROUPS.search(attrs)
    if m:
        return _mesh_groups(m.group(1), m.group(2), m.group(3)).tolist()
    m = re.search(r"replica_groups=maximal_mesh\[device_id=(\d+)\]", attrs)
    if m:
        return [[int(m.group(1))]]
    m = _IOTA_GROUPS.search(attrs)
    if m:
        groups, ids = _ints(m.group(1)), _iota(_ints(m.group(2)), _ints(m.group(3)))
        return ids.reshape(groups).tolist()
    m = _LIST_GROUPS.search(attrs)
    if m and m.group(1).strip():
        return [_ints(g) for g in re.findall(r"\{([^}]*)\}", m.group(1))]
    return [list(range(n_devices))]


def group_size(attrs: str, n_devices: int) -> int:
    """Devices in one replica group of a collective (the N of its ring traffic)."""
    return len(replica_groups(attrs, n_devices)[0])


@dataclass
class Collective:
    kind: str
    name: str
    computation: str
    group: int
    bytes: float  # the result's bytes (for async starts: the output part)
    count: float = 1  # times it runs per step (product of enclosing trip counts)
    dtype: str = ""  # element type of the result ("bf16", "f32", ...)

    @property
    def payload(self) -> float:
        return self.bytes * self.group if self.kind == "reduce-scatter" else self.bytes

    @property
    def traffic(self) -> float:
        """Bytes one device sends per execution (ring algorithms)."""
        n, b = self.group, self.bytes
        if n <= 1 and self.kind != "collective-permute":
            return 0.0
        if self.kind == "all-reduce":
            return 2.0 * b * (n - 1) / n
        if self.kind == "reduce-scatter":
            return b * (n - 1)
        if self.kind == "collective-permute":
            return b
        return b * (n - 1) / n  # all-gather, all-to-all


@dataclass
class HloModule:
    computations: dict[str, list[tuple[str, str, str]]] = field(default_factory=dict)
    entry: str | None = None
    n_devices: int = 1


def parse_module(text: str) -> HloModule:
    """Computations -> [(instruction name, shape, opcode + operands + attributes)]."""
    mod = HloModule()
    m = re.search(r"num_partitions=(\d+)", text)
    mod.n_devices = int(m.group(1)) if m else 1
    current = None
    for line in text.splitlines():
        h = _HEADER.match(line)
        if h:
            current = h.group(1)
            mod.computations[current] = []
            if line.startswith("ENTRY"):
                mod.entry = current
            continue
        if current is None:
            continue
        if line.strip() == "}":
            current = None
            continue
        i = _INSTR.match(line)
        if i:
            shape, rest = _split_shape(i.group(2))
            mod.computations[current].append((i.group(1), shape, rest))
    return mod


def _trip_count(rest: str, mod: HloModule, condition: str | None) -> int | None:
    m = _TRIP.search(rest)
    if m:
        return int(m.group(1))
    # fall back on the loop condition: compare(counter, constant(N)), direction=LT, the
    # constant perhaps behind copies (the partitioned module of a scan under gspmd)
    consts = {}
    for name, _shape, op in mod.computations.get(condition, []):
        c = re.match(r"constant\((-?\d+)\)", op)
        if c:
            consts[name] = int(c.group(1))
        c = re.match(r"copy\(%?([\w.\-]+)\)", op)
        if c and c.group(1) in consts:
            consts[name] = consts[c.group(1)]
    for _name, _shape, op in mod.computations.get(condition, []):
        if op.startswith("compare(") and "direction=LT" in op:
            for operand in re.findall(r"%([\w.\-]+)", op.split(")")[0]):
                if operand in consts:
                    return consts[operand]
    return None


def _reaches_collective(mod: HloModule, edges, comp: str, seen=None) -> bool:
    seen = set() if seen is None else seen
    if comp in seen:
        return False
    seen.add(comp)
    for _name, _shape, rest in mod.computations.get(comp, []):
        op = rest.split("(")[0]
        if op.removesuffix("-start") in KINDS:
            return True
    return any(_reaches_collective(mod, edges, c, seen) for c, _ in edges.get(comp, []))


def multiplicities(mod: HloModule, branch: float = 1) -> tuple[dict[str, float], list[str]]:
    """How many times each computation runs per call of the entry; notes on unknown loops.
    A conditional's branches count `branch` times a call (1: as if each ran every time;
    DiLoCo's synchronisation, 1/H of the steps), but the last micro-batch's (every step)."""
    edges: dict[str, list[tuple[str, int]]] = defaultdict(list)
    unknown = []  # (while instruction, its body) with no trip count in the HLO
    for comp, instrs in mod.computations.items():
        for name, _shape, rest in instrs:
            callees = dict((k, v) for k, v in _CALLEE.findall(rest))
            factor = 1
            if rest.startswith("while("):
                trip = _trip_count(rest, mod, callees.get("condition"))
                if trip is None:
                    unknown.append((name, callees.get("body")))
                    trip = 1
                factor = trip
            for key, callee in callees.items():
                # the condition runs trip + 1 times; collectives never live there
                edges[comp].append((callee, factor if key in ("body", "condition") else 1))
            b = _BRANCHES.search(rest)
            if b:  # the last micro-batch's branch runs every step (its other, never)
                weight = 1 if LAST_MICRO_BATCH in rest else branch
                for callee in re.findall(r"%?([\w.\-]+)", b.group(1)):
                    edges[comp].append((callee, weight))
    # a loop that runs no collective (context parallelism's 0-or-1-trip "skip this
    # pair" loops) cannot change the communication: no note
    notes = [
        f"{name}: trip count unknown, counted once"
        for name, body in unknown
        if body is None or _reaches_collective(mod, edges, body)
    ]
    # computations form a DAG: accumulate in topological order from the entry
    indeg: dict[str, int] = defaultdict(int)
    for comp in mod.computations:
        for callee, _ in edges.get(comp, []):
            indeg[callee] += 1
    mult: dict[str, int] = defaultdict(int)
    roots = [mod.entry] if mod.entry else [c for c in mod.computations if indeg[c] == 0]
    for r in roots:
        mult[r] = 1
    queue = [c for c in mod.computations if indeg[c] == 0]
    while queue:
        comp = queue.pop()
        for callee, factor in edges.get(comp, []):
            mult[callee] += mult[comp] * factor
            indeg[callee] -= 1
            if indeg[callee] == 0:
                queue.append(callee)
    return dict(mult), notes


_OPERAND = re.compile(r"%([\w.\-]+)")


def _sliced_to_share(name: str, nbytes: float, group: int, instrs) -> float | None:
    """The bytes of one device's share when every user of all-reduce `name` is a
    dynamic-slice keeping 1/group of it, else None. XLA:GPU's ReduceScatterCreator
    rewrites that pair into one reduce-scatter: the SPMD partitioner writes a
    reduce-scatter that way (its module, read here, is from before that pass)."""
    users = [(shape, rest) for _, shape, rest in instrs if name in _OPERAND.findall(rest)]
    if group <= 1 or not users:
        return None
    for shape, rest in users:
        operands = _OPERAND.findall(rest.split(")", 1)[0])
        if not rest.startswith("dynamic-slice(") or operands[:1] != [name]:
            return None
        if shape_bytes(shape) * group != nbytes:
            return None
    return shape_bytes(users[0][0])


def collectives(text: str, branch: float = 1) -> tuple[list[Collective], list[str]]:
    """Every collective of a compiled HLO module with its per-step execution count
    (`branch`: a conditional branch's share of the calls, `multiplicities`). An
    all-reduce whose users only keep this device's 1/n of it counts as the reduce-scatter
    a GPU runs there (`_sliced_to_share`)."""
    mod = parse_module(text)
    mult, notes = multiplicities(mod, branch)
    found = []
    rewritten = 0
    for comp, instrs in mod.computations.items():
        for name, shape, rest in instrs:
            op = rest.split("(", 1)[0]
            kind = op[: -len("-start")] if op.endswith("-start") else op
            if kind not in KINDS:
                continue
            parts = _top_level(shape)
            if op.endswith("-start") and kind in ("all-gather", "collective-permute"):
                # async forms return (operands, outputs[, contexts]): keep the outputs
                parts = parts[1:2] if len(parts) >= 2 else parts
            nbytes = sum(shape_bytes(p) for p in parts)
            group = group_size(rest, mod.n_devices)
            if op == "all-reduce":
                share = _sliced_to_share(name, nbytes, group, instrs)
                if share is not None:
                    kind, nbytes = "reduce-scatter", share
                    rewritten += 1
            types = sorted({t for p in parts for t, _ in _ARRAY.findall(p) if t in DTYPE_BYTES})
            found.append(
                Collective(
                    kind=kind,
                    name=name,
                    computation=comp,
                    group=group,
                    bytes=nbytes,
                    count=mult.get(comp, 0),
                    dtype="+".join(types),
                )
            )
    if rewritten:
        notes = [
            *notes,
            f"{rewritten} all-reduces whose users keep only this device's share counted "
            "as reduce-scatters (XLA:GPU's ReduceScatterCreator makes them one)",
        ]
    return found, notes


def summarize(found: list[Collective]) -> dict[str, dict]:
    """kind -> {ops (in the HLO), count (executions per step), payload, traffic} per device."""
    out = {k: {"ops": 0, "count": 0, "payload": 0.0, "traffic": 0.0, "dtypes": {}} for k in KINDS}
    for c in found:
        row = out[c.kind]
        row["ops"] += 1
        row["count"] += c.count
        row["payload"] += c.payload * c.count
        row["traffic"] += c.traffic * c.count
        if c.dtype:
            row["dtypes"][c.dtype] = row["dtypes"].get(c.dtype, 0.0) + c.traffic * c.count
    return out


def compile_partitioned(lowered, compiler_options: dict | None = None):
    """(the compiled program, the module as XLA's SPMD partitioner left it, or None when
    nothing was partitioned).

    The partitioned module holds every collective the program asks for, in the dtype it
    asks for. Later passes of a backend may change that (XLA:CPU promotes bf16
    all-reduces to f32 and computes bf16 dots in f32), so the program's own dtypes and
    bytes are read there."""

    enabled = jax.config.jax_enable_compilation_cache
    with tempfile.TemporaryDirectory() as tmp:
        options = dict(compiler_options or {})
        options.update(xla_dump_to=tmp, xla_dump_hlo_pass_re="spmd-partitioning")
        # a persistent-cache hit (whose key leaves dump options out) would skip the
        # passes, and so the dump: compile this once without the cache
        jax.config.update("jax_enable_compilation_cache", False)
        compilation_cache.reset_cache()
        try:
            compiled = lowered.compile(options)
        finally:
            jax.config.update("jax_enable_compilation_cache", enabled)
            compilation_cache.reset_cache()
        files = sorted(glob.glob(os.path.join(tmp, "*after_spmd-partitioning*")))
        if not files:
            return compiled, None
        with open(files[-1]) as f:
            return compiled, f.read()


def report(cfg: Config, hlo_text: str) -> dict:
    """Measured (from the HLO) beside expected (the formulas), per kind, JSON-ready."""
    h = cfg.parallel.diloco_steps
    found, notes = collectives(hlo_text, 1 / h if h else 1)
    if h:
        notes = [
            *notes,
            f"DiLoCo: the synchronisation's branch runs once every {h} steps, counted 1/{h} "
            "of a step",
        ]
    if cfg.mesh.pipeline > 1:
        notes = [
            *notes,
            "pipeline: a collective in a branch of the tick loop (the sends; tensor "
            "parallelism's inside the stage) is counted at every tick, as if every branch "
            "ran at every tick: an upper bound (the pipeline section has the sends' ticks)",
        ]
    measured = summarize(found)
    terms = expected(cfg)
    want = expected_by_kind(terms)
    rows = {}
    for k in KINDS:
        got = measured[k]["traffic"]
        rows[k] = dict(measured[k], expected=want[k], ratio=(got / want[k]) if want[k] else None)
    total_got = sum(r["traffic"] for r in measured.values())
    total_want = sum(want.values())
    return {
        "kinds": rows,
        "total": {
            "traffic": total_got,
            "expected": total_want,
            "ratio": total_got / total_want if total_want else None,
        },
        "terms": [vars(t) for t in terms],
        "notes": notes,
        "largest": [
            {
                "kind": c.kind,
                "name": c.name,
                "group": c.group,
                "bytes": c.bytes,
                "count": c.count,
                "traffic": c.traffic * c.count,
            }
            for c in sorted(found, key=lambda c: -c.traffic * c.count)[:8]
        ],
    }


def _dims(shape: str) -> list[int]:
    m = _ARRAY.search(shape)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


def matmul_flops(text: str) -> tuple[float, float]:
    """(FLOPs of every dot per step, the same counting each dot once) in a compiled module.

    A dot's FLOPs are 2 x (output elements) x (contracted size). The first figure
    multiplies each by the trip counts of its enclosing loops; the second is what
    XLA's cost analysis does (it reads a loop body once), for comparison.
    """
    mod = parse_module(text)
    mult, _ = multiplicities(mod)
    total = once = 0.0
    for comp, instrs in mod.computations.items():
        shapes = {name: shape for name, shape, _ in instrs}
        for _name, shape, rest in instrs:
            if not rest.startswith("dot("):
                continue
            operands = re.findall(r"%([\w.\-]+)", rest.split(")", 1)[0])
            lhs = _dims(shapes.get(operands[0], "")) if operands else []
            m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest)
            contracted = math.prod(lhs[int(i)] for i in m.group(1).split(",") if i) if m else 1
            flops = 2.0 * math.prod(_dims(shape)) * contracted
            once += flops
            total += flops * mult.get(comp, 0)
    return total, once
