"""Fit the blocked grouped matmuls' working set (BLOCKED and BLOCKED_EXCHANGE in
ultrajax/cost/activations.py) to XLA:CPU's compiled MoE steps.

`python scripts/fit_moe_memory.py [--cache FILE]` compiles SHAPES (8 experts, top-2, fp32,
d_model 64-256, hidden 32-512, one device and three expert-parallel layouts, every remat
policy; nothing runs), takes each compiled peak minus the estimate without the rows'
terms, and solves per policy, by least squares weighted by each peak, for the fp32
copies of R' x d_model, of R' x hidden, and of R' x d_model more under expert
parallelism (R' = activations.expert_rows). The weights' term is kept. It prints the
coefficients to paste and every shape's predicted / compiled peak with them.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
from fit_memory import compile_all

from ultrajax.cost import activations, memory

BASE = (
    "model.moe_experts=8", "model.moe_top_k=2", "model.n_layers=2", "model.vocab_size=512",
    "model.n_heads=4", "model.n_kv_heads=2", "model.attention=xla", "train.micro_batch_size=2",
)  # fmt: skip
LAYOUTS = ((), ("mesh.expert=8",), ("mesh.data=2", "mesh.expert=4"), ("mesh.expert=2",))
WIDTHS = ((128, 256, 128), (128, 32, 128), (256, 512, 128), (128, 64, 256), (64, 256, 128))
SHAPES = [
    (*BASE, *layout, f"model.d_model={d}", f"model.moe_d_ff={f}", f"model.seq_len={s}",
     f"model.remat={policy}")
    for policy in ("none", "selective", "full")
    for layout in LAYOUTS
    for d, f, s in WIDTHS
]  # fmt: skip


def features(cfg) -> list[float]:
    """Bytes of one fp32 copy of R' x d_model, R' x hidden, and R' x d_model again where
    the experts are split over `expert`."""
    rows, m = activations.expert_rows(cfg), cfg.model
    f = m.expert_ff // cfg.mesh.tensor
    return [4.0 * rows * m.d_model, 4.0 * rows * f, 4.0 * rows * m.d_model * (cfg.mesh.expert > 1)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cache", help="JSON file of compiled figures to reuse and extend")
    args = ap.parse_args(argv)
    results = compile_all(SHAPES, cache=args.cache)
    fitted = dict(activations.BLOCKED)
    for policy in ("none", "selective", "full"):
        rows = [(o, cfg, c["peak"]) for o, cfg, c in results if f"model.remat={policy}" in o]
        weights = fitted[policy][2]
        activations.BLOCKED[policy] = (0.0, 0.0, weights)
        saved = activations.BLOCKED_EXCHANGE[policy]
        activations.BLOCKED_EXCHANGE[policy] = 0.0
        base = np.array([memory.estimate(cfg).peak for _, cfg, _ in rows])
        activations.BLOCKED[policy], activations.BLOCKED_EXCHANGE[policy] = fitted[policy], saved
        peak = np.array([p for *_, p in rows])
        a = np.array([features(cfg) for _, cfg, _ in rows])
        coef, *_ = np.linalg.lstsq(a / peak[:, None], (peak - base) / peak, rcond=None)
        ratio = (base + a @ coef) / peak
        print(f"{policy}: BLOCKED ({coef[0]:.2f}, {coef[1]:.2f}, {weights}), "
              f"BLOCKED_EXCHANGE {coef[2]:.2f}; predicted / compiled "
              f"{ratio.min():.3f}-{ratio.max():.3f}")  # fmt: skip
        for (overrides, _, _), r in zip(rows, ratio, strict=True):
            print(f"  {' '.join(overrides[len(BASE) :]):<100} {r:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
