"""Context parallelism, measured: one table of compiled memory, communication and step time
for each sequence-axis layout of the same model and global batch.

    python scripts/bench_context.py [--seq 2048] [--steps 3] [key=value ...]

Every row compiles the real train step (ultrajax.step, as `python -m ultrajax.train` runs
it) on simulated CPU devices (or the GPUs present) and reports, per device: XLA's compiled
temporaries (the activations and working set), the bytes its context-parallel
collectives send per step, read from the compiled HLO (ultrajax/tools/hlo.py), beside the
formula, the causal attention work of the busiest device over the least busy
(parallel/context.py), and the median step time. On a CPU the times say little about a
GPU cluster; memory, bytes and balance do.
"""

from __future__ import annotations

import argparse
import sys

from timing import median_step_ms

from ultrajax.config import parse, validate
from ultrajax.cost import comms as comms_lib
from ultrajax.tools import hlo

ROWS = (  # (label, overrides)
    ("cp=1, blocked attention", ["model.attention=blocked"]),
    ("cp=1, plain attention", ["model.attention=xla"]),
    ("cp=2 ring, zig-zag", ["mesh.sequence=2"]),
    ("cp=4 ring, zig-zag", ["mesh.sequence=4"]),
    ("cp=4 ring, contiguous", ["mesh.sequence=4", "parallel.context_zigzag=false"]),
    ("cp=4 all-gather, zig-zag", ["mesh.sequence=4", "parallel.context=allgather"]),
    ("cp=8 ring, zig-zag", ["mesh.sequence=8"]),
)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=3, help="timed steps per row (0: compile only)")
    p.add_argument("overrides", nargs="*", help="config key=value for every row")
    args = p.parse_args(argv)
    import jax

    jax.config.update("jax_num_cpu_devices", 8)  # used only where the backend is the CPU
    import numpy as np

    from ultrajax.parallel import context
    from ultrajax.tools import analyze
    from ultrajax.train import batch as batch_lib

    base = [
        "model.n_layers=2",
        f"model.seq_len={args.seq}",
        "train.micro_batch_size=1",
        "train.grad_accum=1",
        "data.cross_doc_mask=true",
        "optim.warmup_steps=0",
        "model.dtype=float32",
        # the rolled layer loop, where the formula's counts hold: unrolled (tiny.yaml's
        # scan_unroll), XLA may reuse the forward ring's blocks in the backward and send less
        "model.scan_unroll=1",
        *args.overrides,
    ]
    print(f"backend {jax.default_backend()}, {jax.device_count()} devices; tiny.yaml with")
    print("  " + " ".join(base))
    head = f"{'layout':<28}{'temp MiB':>10}{'CP MiB':>10}{'formula':>9}{'work max/min':>14}"
    print(head + f"{'ms/step':>10}")
    for label, extra in ROWS:
        cfg = parse.load("configs/tiny.yaml", base + extra)
        validate.resolve_mesh(cfg, cfg.mesh.sequence)
        devices = jax.devices()[: cfg.mesh.sequence]
        compiled = analyze.compile_step(cfg, devices)
        temp = compiled.memory_analysis().temp_size_in_bytes
        found, _ = hlo.collectives(compiled.as_text())
        expected = comms_lib.permute_bytes(cfg)  # the context-parallel kinds and their bytes
        sent = sum(c.traffic * c.count for c in found if c.kind in expected)
        formula = sum(expected.values())
        cp = cfg.mesh.sequence
        work = context.work(cp, cfg.parallel.context_zigzag)
        ms = float("nan")
        if args.steps:
            rng = np.random.default_rng(0)
            packed = batch_lib.random_packed(1, args.seq, cfg.model.vocab_size, rng)
            b = batch_lib.make(packed, True, 1, context.token_order(cfg))
            ms = median_step_ms(compiled, cfg, devices, b, args.steps)
        print(
            f"{label:<28}{temp / 2**20:>10.2f}{sent / 2**20:>10.2f}{formula / 2**20:>9.2f}"
            f"{work.max() / work.min():>14.2f}{ms:>10.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
