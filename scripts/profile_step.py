"""Where the train step's time goes: a jax.profiler trace and a table per kind of op.

    python scripts/profile_step.py                       # the cpu256 shape of bench_step.py
    python scripts/profile_step.py --size tiny --top 20 model.attention=xla
    python3 scripts/profile_step.py --size 1b --top 25 train.micro_batch_size=8   # a GPU

Builds the step as `python -m ultrajax.train` does (through bench_step.py's sizes), runs
warm-up steps, then traces `--steps` steps with `jax.profiler`. Every op XLA runs shows
up in the trace as an event named after its HLO instruction; the compiled HLO gives each
instruction its opcode and the JAX operation it came from (`op_name` metadata), so the
events are summed per category (matmuls, attention, the layer loop's slicing and copies,
elementwise fusions, the optimizer update, ...) and per instruction. On a GPU the kernels
are read off the device's streams, each tagged with its HLO instruction (`op_times`). Times
are summed over threads (or streams): on a CPU the matmul library splits one dot over
several threads, so the total can exceed the wall time; the shares are what matter. The
trace directory stays for TensorBoard / Perfetto. A benchmark: nothing is asserted.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import sys
import tempfile

# category, a regular expression on "opcode | op_name | instruction name"; first match wins
CATEGORIES = (
    ("optimizer update", r"optax|adam|apply_updates|clip|tree_norm|global_norm"),
    ("attention", r"attention|bkgts|btkgd|rkgts|rkgtd|rksd|softmax|dot_product"),
    ("matmul", r"^dot\b|^convolution|ynn_fusion|dot_general|custom-call.*(matmul|gemm)"),
    ("layer loop: slices, updates", r"dynamic-slice|dynamic-update-slice|dynamic_slice"),
    ("copies, transposes", r"^copy|^transpose|copy_start|copy-done"),
    ("loss and LM head", r"cross_entropy|logsumexp|take_along_axis"),
    ("embedding gather/scatter", r"^gather|^scatter|lookup"),
    ("reductions", r"^reduce\b|reduce-window"),
    ("control flow", r"^while|^conditional|^call\b"),
    ("elementwise fusions", r"^fusion|wrapped_|^add|^multiply|^select|^convert"),
)


def hlo_index(text: str) -> dict[str, str]:
    """Instruction name -> "opcode | op_name | name" from compiled HLO text."""
    out = {}
    pattern = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = [^=]*?\s([\w\-]+)\(")
    for line in text.splitlines():
        m = pattern.match(line)
        if not m:
            continue
        name, opcode = m.group(1), m.group(2)
        op = re.search(r'op_name="([^"]*)"', line)
        out[name] = f"{opcode} | {op.group(1) if op else ''} | {name}"
    return out


def categorize(label: str) -> str:
    for category, pattern in CATEGORIES:
        if re.search(pattern, label, re.IGNORECASE) or re.search(
            pattern, label.split(" | ")[0], re.IGNORECASE
        ):
            return category
    return "other"


def events(trace_dir: str):
    """(name, self time in ns) of every op of the newest trace in trace_dir (`op_times`)."""
    import jax

    files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))
    yield from op_times(jax.profiler.ProfileData.from_file(files[-1]).planes)


def op_times(planes):
    """(HLO instruction name, ns) of every op event in a trace's planes.

    On a GPU the device planes ("/device:GPU:N") hold the kernels, one line per stream,
    each kernel named by its library and tagged with the HLO instruction that launched it
    (its "hlo_op" stat): those are summed, and the host's threads (launches, not work) are
    left out. On a CPU the host's threads run the ops: an event's time is its duration
    minus that of the events nested in it on the same thread (a loop's body ops inside the
    loop), runtime bookkeeping left out."""
    planes = list(planes)
    gpus = [p for p in planes if p.name.startswith("/device:GPU")]
    if gpus:
        for plane in gpus:
            for line in plane.lines:
                if line.name in ("XLA Modules", "XLA Ops", "Steps"):  # derived views, if any
                    continue
                for e in line.events:
                    op = dict(e.stats).get("hlo_op")
                    if op:
                        yield str(op), e.duration_ns
        return
    for plane in planes:
        for line in plane.lines:
            if line.name == "python":
                continue
            stack: list[list] = []  # [name, end_ns, self_ns]
            for e in sorted(line.events, key=lambda e: (e.start_ns, -e.duration_ns)):
                while stack and stack[-1][1] <= e.start_ns:
                    yield from _emit(stack.pop())
                if stack:
                    stack[-1][2] -= e.duration_ns
                stack.append([e.name, e.end_ns, e.duration_ns])
            while stack:
                yield from _emit(stack.pop())


def _emit(item):
    name, _, self_ns = item
    runtime = name.startswith(("ThreadpoolListener", "end: ", "$")) or "::" in name
    if not runtime and self_ns > 0:
        yield name, self_ns


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="cpu256", help="a size of bench_step.py (default cpu256)")
    p.add_argument("--steps", type=int, default=3, help="traced steps")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--top", type=int, default=12, help="instructions listed by time")
    p.add_argument("--trace-dir", default=None, help="where the trace goes (default: temp)")
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. model.attention=xla")
    args = p.parse_args(argv)

    import jax
    import numpy as np

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_step import random_batch, size_overrides

    from ultrajax.config.parse import load
    from ultrajax.train.setup import build_run

    cfg = load(None, size_overrides(args.size, jax.default_backend(), args.overrides))
    mesh, _, _, state, step_fn, _, batch_sh = build_run(cfg)
    trace_dir = args.trace_dir or tempfile.mkdtemp(prefix="ultrajax-profile-")
    with jax.set_mesh(mesh):
        batch = random_batch(cfg, batch_sh, np.random.default_rng(0))
        pos = np.float32(0)  # the schedule's position, as the train loop passes it
        compiled = step_fn.lower(state, batch, pos).compile()
        for _ in range(args.warmup):
            state, out = compiled(state, batch, pos)
        jax.block_until_ready(state)
        jax.profiler.start_trace(trace_dir)
        for _ in range(args.steps):
            state, out = compiled(state, batch, pos)
        jax.block_until_ready((state, out))
        jax.profiler.stop_trace()
    index = hlo_index(compiled.as_text())
    per_category: dict[str, float] = collections.Counter()
    per_op: dict[str, float] = collections.Counter()
    for name, ns in events(trace_dir):
        label = index.get(name, f"? |  | {name}")
        per_category[categorize(label)] += ns
        per_op[label] += ns
    total = sum(per_category.values()) or 1.0
    steps = args.steps
    print(f"{args.size}: {cfg.tokens_per_step:,} tokens/step, {jax.default_backend()}, "
          f"trace in {trace_dir}")  # fmt: skip
    over = "streams" if jax.default_backend() == "gpu" else "threads"
    print(f"\n| category | ms/step (summed over {over}) | share |\n|---|---|---|")
    for category, ns in per_category.most_common():
        print(f"| {category} | {ns / 1e6 / steps:.1f} | {ns / total:.1%} |")
    print("\n| instruction (opcode \\| JAX op \\| name) | ms/step | share |\n|---|---|---|")
    for label, ns in per_op.most_common(args.top):
        opcode, op_name, name = label.split(" | ", 2)
        short = op_name if len(op_name) < 70 else "..." + op_name[-67:]
        print(f"| {opcode} \\| {short} \\| {name} | {ns / 1e6 / steps:.1f} | {ns / total:.1%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
