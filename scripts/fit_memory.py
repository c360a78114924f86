"""Fit the memory model's working-set coefficients (ultrajax/memory.py, WORK) to XLA.

`python scripts/fit_memory.py` compiles the train step for a set of small fp32 shapes and
layouts on 8 simulated CPU devices (nothing runs), takes each compiled temporary size
minus everything the model predicts exactly (saved activations, gradients, copies), and
solves for the coefficients of one layer's backward working set per remat policy by
least squares (copies bounded below by zero). It prints the fitted table to paste into WORK, and the
predicted/compiled peak ratio of every shape with it. Run it after a change to the step
changes what the compiled program keeps (the tests' grid then checks the fit).
"""

from __future__ import annotations

import itertools
import os
import sys
from concurrent.futures import ThreadPoolExecutor

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def shapes() -> list[tuple[str, ...]]:
    out = []
    model = [
        ("model.seq_len=32",),
        ("model.seq_len=128",),
        ("model.d_ff=512",),
        ("model.seq_len=16", "model.d_ff=1024"),
        ("model.d_model=128", "model.n_heads=8", "model.n_kv_heads=4"),
        ("train.micro_batch_size=4",),
    ]
    layouts = [(), ("mesh.fsdp=8", "parallel.zero=3"), ("mesh.tensor=2",),
               ("mesh.tensor=2", "parallel.sequence_parallel=true")]  # fmt: skip
    for remat, layout, shape in itertools.product(("none", "full", "selective"), layouts, model):
        out.append((f"model.remat={remat}", *layout, *shape))
    return out


def main() -> int:
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import numpy as np
    from scipy.optimize import lsq_linear

    from ultrajax import analyze, config, memory

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.join(root, "tests"))
    from analysis_shapes import BASE, FAST, TINY

    def one(overrides):
        cfg = config.load(TINY, BASE + list(overrides))
        n = int(np.prod(list(cfg.mesh.sizes().values())))
        config.resolve_mesh(cfg, n)
        compiled = analyze.compiled_memory(analyze.compile_step(cfg, jax.devices()[:n], FAST))
        return overrides, cfg, compiled

    with ThreadPoolExecutor(2) as pool:  # XLA compiles outside the GIL
        results = list(pool.map(one, shapes()))
    rows: dict[str, list] = {}
    for _overrides, cfg, compiled in results:
        est = memory.estimate(cfg)
        if est.peak_phase != "layer backward":
            continue
        pol, common, mlp = memory.work_features(cfg)
        known = est.phases["layer backward"] - memory.layer_work(cfg)
        d = memory.dims(cfg)
        target = compiled["temp"] - known - d.c * memory.layer_weight_elements(cfg)["norm"]
        rows.setdefault(pol, []).append(([*common.values(), *mlp.values()], target))
    names = [*common, *mlp]
    for pol, data in rows.items():
        a = np.array([f for f, _ in data])
        b = np.array([t for _, t in data])
        # copies are non-negative; Z (ZeRO-3's gathered layer) may also correct the
        # exact terms downwards where XLA reuses a buffer they count
        lower = [-np.inf if k == "Z" else 0.0 for k in names]
        coef = lsq_linear(a, b, bounds=(lower, np.inf)).x
        fitted = {k: round(float(v), 1) for k, v in zip(names, coef, strict=True)}
        memory.WORK[pol] = fitted
        print(f'    "{pol}": {fitted},'.replace("'", '"'))
    worst = 1.0
    for overrides, cfg, compiled in results:
        ratio = memory.estimate(cfg).peak / compiled["peak"]
        worst = max(worst, ratio, 1 / ratio)
        print(f"  {ratio:6.3f}  {' '.join(overrides)}")
    print(f"worst ratio with the fitted table: {worst:.3f} over {len(results)} shapes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
