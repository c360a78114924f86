"""What a compiled step's kernels move: each kernel of a compiled module (a fusion, a
library call, a copy: an instruction of the entry or of a loop body, not one inside a
fusion) with the bytes it reads and writes and its matmul FLOPs, times its loops' trip
counts.

A static account, not a timing. It says where a step's memory traffic goes and what a
change removes, on any host: scripts/gpu_compile.py compiles the GPU step on a CPU host
and prints it. Bytes / bandwidth is a lower bound on a memory-bound kernel's time, FLOPs /
matmul rate on a matmul's; the rates are the caller's assumption."""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

from ultrajax.cost.comms import KINDS
from ultrajax.tools.hlo import _dims, multiplicities, parse_module, shape_bytes

# instructions that launch no kernel (a loop's own work is in its body)
FREE = {
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional",
    "call", "after-all", "partition-id", "replica-id", "opt-barrier", "add-dependency",
}  # fmt: skip
_OPERANDS = re.compile(r"%([\w.\-]+)")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_LOOP = re.compile(r"\b(?:body|condition)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


@dataclass(frozen=True)
class Kernel:
    name: str
    computation: str  # the entry or the loop body it runs in
    op: str  # "fusion", "custom-call", "copy", ...
    kind: str  # a fusion's kind (kLoop, kInput, kCustom...) or a custom call's target
    shape: str
    count: float  # times it runs per step
    bytes: float  # read + written, per step
    flops: float  # matmul FLOPs, per step
    source: str  # the jax operation it came from (op_name)


def _operands(rest: str) -> list[str]:
    """The operand names of 'op(%a, %b), attrs': the first parenthesised group."""
    depth = 0
    for j, ch in enumerate(rest):
        depth += ch == "("
        depth -= ch == ")"
        if ch == ")" and depth == 0:
            return _OPERANDS.findall(rest[: j + 1])
    return []


class _Module:
    def __init__(self, text: str):
        self.mod = parse_module(text)
        self.mult, _ = multiplicities(self.mod)
        self.shapes = {c: {n: s for n, s, _ in ins} for c, ins in self.mod.computations.items()}

    def kernel_computations(self) -> set[str]:
        """The entry, loop bodies and conditions, branches and called computations."""
        out = {self.mod.entry}
        for instrs in self.mod.computations.values():
            for _n, _s, rest in instrs:
                if rest.startswith("while("):
                    out.update(_LOOP.findall(rest))
                if rest.startswith("call("):
                    out.update(re.findall(r"to_apply=%?([\w.\-]+)", rest))
                b = _BRANCHES.search(rest)
                if b:
                    out.update(_OPERANDS.findall(b.group(1)))
        return out

    def dot_flops(self, comp: str) -> float:
        total = 0.0
        for _n, shape, rest in self.mod.computations.get(comp, []):
            if rest.startswith("dot("):
                lhs = _dims(self.shapes[comp].get(_operands(rest)[0], ""))
                m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest)
                k = 1
                for i in filter(None, m.group(1).split(",") if m else []):
                    k *= lhs[int(i)]
                n = 1
                for d in _dims(shape):
                    n *= d
                total += 2.0 * n * k
            total += sum(self.dot_flops(c) for c in _CALLS.findall(rest))
        return total

    def read(self, fused: str, index: int, full: float) -> float:
        """Bytes a fusion reads of its operand `index`: only the elements it takes where
        every use is a slice, a gather from it or the in-place buffer of a
        dynamic-update-slice."""
        instrs = self.mod.computations[fused]
        param = next((n for n, _s, r in instrs if r.startswith(f"parameter({index})")), None)
        names, uses = {param}, []  # the parameter and its bitcasts; their other uses
        for n, s, r in instrs:
            if names & set(_operands(r)):
                if r.startswith("bitcast("):
                    names.add(n)
                else:
                    uses.append((s, r))
        taken = [s for s, r in uses if r.startswith(("slice(", "dynamic-slice("))]
        taken += [s for s, r in uses if r.startswith("gather(") and _operands(r)[0] in names]
        in_place = [r for _s, r in uses if r.startswith("dynamic-update-slice(")]
        if param is None or not uses or len(taken) + len(in_place) < len(uses):
            return full
        if any(_operands(r)[0] not in names for r in in_place):
            return full
        return sum(shape_bytes(s) for s in taken)

    def written(self, fused: str, full: float) -> float:
        """Bytes a fusion writes: the update only when its root updates a buffer in place."""
        instrs = self.mod.computations[fused]
        root = instrs[-1] if instrs else None  # the printer puts the ROOT last
        if root and root[2].startswith("dynamic-update-slice("):
            return shape_bytes(self.shapes[fused].get(_operands(root[2])[1], ""))
        return full


def kernels(text: str) -> list[Kernel]:
    """Every kernel of compiled module `text`, with its bytes and FLOPs per step."""
    m = _Module(text)
    out = []
    for comp in m.kernel_computations():
        count = m.mult.get(comp, 0)
        if not count:
            continue
        shapes = m.shapes[comp]
        for name, shape, rest in m.mod.computations[comp]:
            op = rest.split("(", 1)[0]
            if op in FREE or op.endswith("-done"):
                continue
            ops = _operands(rest)
            fused = _CALLS.search(rest).group(1) if op == "fusion" else None
            full = [shape_bytes(shapes.get(o, "")) for o in ops]
            if fused:
                read = sum(m.read(fused, i, b) for i, b in enumerate(full))
                wrote = m.written(fused, shape_bytes(shape))
            elif op == "dynamic-update-slice":
                read = wrote = full[1]
            else:
                read, wrote = sum(full), shape_bytes(shape)
            kind = re.search(r'custom_call_target="([^"]*)"|kind=(\w+)', rest)
            source = re.search(r'op_name="([^"]*)"', rest)
            kind = next(filter(None, kind.groups())) if kind else ""
            flops = m.dot_flops(fused) * count if fused else 0.0
            source = source.group(1) if source else ""
            out.append(
                Kernel(name, comp, op, kind, shape, count, (read + wrote) * count, flops, source)
            )
    return out


def summary(found: list[Kernel], bandwidth: float, matmul_rate: float, top: int = 15) -> str:
    """The kernels' bytes and FLOPs by kind, each with its lower bound in ms at the given
    rates (bytes/s, FLOP/s), and the `top` kernels that move the most bytes."""
    groups: dict[str, list[Kernel]] = defaultdict(list)
    for k in found:
        if k.flops:
            groups["matmuls"].append(k)
        elif k.op == "custom-call":
            groups[f"calls to {k.kind}"].append(k)
        elif k.op.removesuffix("-start") in KINDS:  # bound by links (cost/comms.py), not HBM
            groups["collectives (operands and results)"].append(k)
        else:
            groups["memory-bound (fusions, copies)"].append(k)
    lines = ["| kernels | runs a step | GiB moved | TFLOP | bound ms |", "|---|---|---|---|---|"]
    for label, ks in sorted(groups.items()):
        moved, flops = sum(k.bytes for k in ks), sum(k.flops for k in ks)
        bound = max(moved / bandwidth, flops / matmul_rate) * 1e3
        shown = "-" if label.startswith("collectives") else f"{bound:,.1f}"  # links' time
        lines.append(
            f"| {label} | {sum(k.count for k in ks):,.0f} | {moved / 2**30:,.1f} |"
            f" {flops / 1e12:,.1f} | {shown} |"
        )
    lines += ["", f"the {top} memory-bound kernels moving the most:", ""]
    lines += ["| GiB a step | runs | kernel | shape | from |", "|---|---|---|---|---|"]
    rest = groups["memory-bound (fusions, copies)"]
    for k in sorted(rest, key=lambda k: -k.bytes)[:top]:
        source = "/".join(k.source.rsplit("/", 2)[-2:])
        lines.append(
            f"| {k.bytes / 2**30:,.2f} | {k.count:,.0f} | {k.op} {k.kind} | {k.shape[:48]} |"
            f" {source} |"
        )
    return "\n".join(lines)
