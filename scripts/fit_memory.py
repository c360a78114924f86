"""Fit the memory model's working-set coefficients (ultrajax/cost/activations.py) to XLA, and check
them on shapes they were not fitted to.

`python scripts/fit_memory.py` compiles the train step for FIT_SHAPES (small fp32 shapes
and layouts on 8 simulated CPU devices; nothing runs), takes each compiled temporary size
minus everything the model predicts exactly (saved activations, gradients, copies), and
solves for
  - WORK: one layer's backward working set per remat policy, by least squares (copies
    bounded below by zero), over the shapes whose peak is the layer backward;
  - CP_WORK: the ring's own working set (context parallelism), by least squares over the
    mesh.sequence > 1 shapes;
  - PIPE_WORK and PIPE_ATTN_S: the share of a layer's working set a pipeline tick keeps
    and its attention's copies of the scores, by a grid search for the smallest worst
    error over the mesh.pipeline > 1 shapes.
It prints the fitted values to paste into cost/activations.py, and the predicted/compiled peak
ratio of every fitting shape with them.

`python scripts/fit_memory.py --validate` compiles VALIDATION_SHAPES, kept apart from the
fitting shapes (sequences to 4096, every remat policy, ZeRO 0-3, TP and SP, context and
pipeline parallelism, gradient accumulation: tests/test_memory.py asserts the two sets
are disjoint and compiles a subset), and prints the markdown table of docs/memory.md.

Run the fit after a change to the step changes what the compiled program keeps, then
the validation.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import platform
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from ultrajax.cost import activations

os.environ.setdefault("JAX_PLATFORMS", "cpu")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LONG = ("train.micro_batch_size=1",)  # long sequences: one row keeps the compiles cheap


def _fit_shapes() -> list[tuple[str, ...]]:
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
    policies = ("none", "full", "selective")
    for remat, layout, shape in itertools.product(policies, layouts, model):
        out.append((f"model.remat={remat}", *layout, *shape))
    # context parallelism (CP_WORK)
    for remat, (cp, s, b) in itertools.product(policies, ((2, 256, 2), (4, 1024, 1), (2, 2048, 2))):
        out.append((f"mesh.sequence={cp}", f"model.remat={remat}", f"model.seq_len={s}",
                    f"train.micro_batch_size={b}"))  # fmt: skip
    # pipeline parallelism (PIPE_WORK, PIPE_ATTN_S)
    for kind, remat, s in itertools.product(("1f1b", "afab", "zb-h1"), policies, (256, 2048)):
        out.append(("mesh.pipeline=2", "train.grad_accum=4", f"parallel.pipeline_schedule={kind}",
                    f"model.remat={remat}", f"model.seq_len={s}", *LONG))  # fmt: skip
    # attention tiled and blocked (KERNEL_WORK)
    for remat, s, b in itertools.product(policies, (1024, 2048), (1, 2)):
        out.append(("model.attention=blocked", f"model.remat={remat}", f"model.seq_len={s}",
                    f"train.micro_batch_size={b}"))  # fmt: skip
    for remat, layout in itertools.product(
        policies, (("mesh.tensor=2",), ("mesh.fsdp=8", "parallel.zero=3"))
    ):
        out.append((*layout, "model.attention=blocked", f"model.remat={remat}",
                    "model.seq_len=1024", "train.micro_batch_size=2"))  # fmt: skip
    for remat, s, b in itertools.product(policies, (128, 256), (1, 4)):
        out.append(("model.attention=tiled", f"model.remat={remat}", f"model.seq_len={s}",
                    f"train.micro_batch_size={b}"))  # fmt: skip
    return out


FIT_SHAPES: list[tuple[str, ...]] = _fit_shapes()

# Shapes the coefficients never see: longer sequences (to 4096), every remat policy and a
# list of names, ZeRO 0-3 over fsdp, TP with and without SP, context parallelism, every
# pipeline schedule, gradient accumulation, wider layers, vocabulary- and weight-bound
# shapes. On top of the harness's BASE (tests/harness.py: L=2, b=2, s=64, h=64, 4 heads,
# 2 kv heads, d_ff 192, vocabulary 256, fp32).
# The first of them, compiled by tests/test_memory.py (under a minute): long sequences on
# both sides of XLA:CPU's softmax split, names, ZeRO 0-3, TP, SP, 3-D, context and
# pipeline parallelism, gradient accumulation, the tiled and blocked attentions.
TESTED: list[tuple[str, ...]] = [
    ("model.remat=selective", "model.seq_len=1024", *LONG),
    ("model.remat=full", "model.seq_len=4096", *LONG),
    ("model.remat=[query,key,value]", "model.seq_len=2048", *LONG),
    ("mesh.data=8", "model.remat=none"),
    ("mesh.fsdp=8", "parallel.zero=1", "model.remat=selective", "model.seq_len=1024", *LONG),
    (
        "mesh.fsdp=8",
        "parallel.zero=3",
        "model.remat=selective",
        "model.seq_len=1024",
        "model.d_model=256",
        "model.d_ff=768",
        "model.vocab_size=4096",
        *LONG,
    ),  # fmt: skip
    (
        "mesh.tensor=2",
        "parallel.sequence_parallel=true",
        "model.remat=none",
        "model.seq_len=1024",
        *LONG,
    ),  # fmt: skip
    (
        "mesh.data=2",
        "mesh.fsdp=2",
        "mesh.tensor=2",
        "parallel.zero=3",
        "parallel.sequence_parallel=true",
        "model.remat=none",
        "model.seq_len=1024",
        *LONG,
    ),  # fmt: skip
    ("mesh.sequence=2", "model.remat=none", "model.seq_len=1024", *LONG),
    ("mesh.sequence=4", "model.remat=selective", "model.seq_len=2048", *LONG),
    (
        "mesh.pipeline=2",
        "train.grad_accum=4",
        "parallel.pipeline_schedule=zb-h1",
        "model.remat=selective",
        "model.seq_len=1024",
        *LONG,
    ),  # fmt: skip
    (
        "mesh.pipeline=2",
        "train.grad_accum=4",
        "parallel.pipeline_schedule=afab",
        "model.remat=full",
        "model.seq_len=1024",
        *LONG,
    ),  # fmt: skip
    (
        "mesh.fsdp=4",
        "parallel.zero=2",
        "train.grad_accum=4",
        "model.remat=selective",
        "model.seq_len=1024",
        *LONG,
    ),  # fmt: skip
    ("model.attention=tiled", "model.remat=selective", "model.seq_len=512", *LONG),
    ("model.attention=blocked", "model.remat=full", "model.seq_len=4096", *LONG),
]
VALIDATION_SHAPES: list[tuple[str, ...]] = TESTED + [
    ("model.remat=none", "model.seq_len=1024", *LONG),
    ("model.remat=full", "model.seq_len=1024", *LONG),
    ("model.remat=none", "model.seq_len=4096", *LONG),
    ("model.remat=selective", "model.seq_len=4096", *LONG),
    ("model.remat=selective", "model.seq_len=512", "train.micro_batch_size=2"),
    ("model.remat=full", "model.seq_len=896", *LONG),
    ("model.remat=[attn_out]", "model.seq_len=1024", *LONG),
    ("model.remat=[mlp_in]", "model.seq_len=1024", *LONG),
    ("model.remat=selective", "model.seq_len=256", "train.micro_batch_size=16"),
    ("model.remat=full", "model.seq_len=768", "model.n_heads=8", "model.n_kv_heads=8", *LONG),
    ("model.remat=none", "model.vocab_size=2048"),  # the LM head's phase is the peak
    ("model.remat=none", "model.seq_len=256", "model.vocab_size=8192", "train.micro_batch_size=4"),
    ("model.remat=none", "model.seq_len=8", "model.d_ff=2048"),  # weights dominate
    ("model.remat=selective", "model.n_layers=4", "model.seq_len=2048", *LONG),
    ("mesh.data=8", "model.remat=full", "model.n_layers=4", "model.seq_len=4096", *LONG),
    ("mesh.fsdp=8", "parallel.zero=0", "model.remat=none", "model.seq_len=1024", *LONG),
    ("mesh.fsdp=8", "parallel.zero=2", "model.remat=full", "model.seq_len=1024", *LONG),
    ("mesh.fsdp=8", "parallel.zero=3", "model.remat=none", "model.seq_len=1024", *LONG),
    ("mesh.fsdp=8", "parallel.zero=3", "model.remat=full", "model.seq_len=2048", *LONG),
    ("mesh.fsdp=8", "parallel.zero=1", "model.remat=none"),
    ("mesh.fsdp=8", "parallel.zero=2", "model.remat=none"),
    ("mesh.tensor=2", "model.remat=none", "model.seq_len=1024", *LONG),
    ("mesh.tensor=2", "model.remat=selective", "model.seq_len=2048", *LONG),
    ("mesh.tensor=4", "model.n_kv_heads=4", "model.remat=full", "model.seq_len=1024", *LONG),
    ("mesh.tensor=4", "model.n_kv_heads=4", "model.remat=none"),
    (
        "mesh.tensor=2",
        "parallel.sequence_parallel=true",
        "model.remat=selective",
        "model.seq_len=2048",
        *LONG,
    ),  # fmt: skip
    (
        "mesh.tensor=4",
        "model.n_kv_heads=4",
        "parallel.sequence_parallel=true",
        "model.remat=full",
        "model.seq_len=4096",
        *LONG,
    ),  # fmt: skip
    ("mesh.sequence=2", "model.remat=full", "model.seq_len=4096", *LONG),
    ("mesh.sequence=4", "model.remat=none", "model.seq_len=4096", *LONG),
    ("mesh.sequence=8", "model.remat=full", "model.seq_len=4096", *LONG),
    ("mesh.sequence=2", "mesh.tensor=2", "model.remat=none", "model.seq_len=2048", *LONG),
    ("mesh.pipeline=2", "train.grad_accum=4", "model.remat=none", "model.seq_len=1024", *LONG),
    (
        "mesh.pipeline=2",
        "model.n_layers=4",
        "parallel.virtual_stages=2",
        "parallel.pipeline_schedule=interleaved",
        "train.grad_accum=4",
        "model.remat=none",
        "model.seq_len=512",
        *LONG,
    ),  # fmt: skip
    (
        "mesh.pipeline=4",
        "model.n_layers=4",
        "model.seq_len=128",
        "train.micro_batch_size=4",
        "train.grad_accum=8",
        "model.remat=full",
        "parallel.pipeline_schedule=afab",
    ),  # fmt: skip
    ("train.grad_accum=4", "model.remat=none", "model.seq_len=1024", *LONG),
    ("model.attention=blocked", "model.remat=none", "model.seq_len=4096", *LONG),
    ("model.attention=blocked", "model.remat=selective", "model.seq_len=4096", *LONG),
    ("model.attention=blocked", "model.remat=selective", "model.seq_len=1536", *LONG),
    (
        "mesh.fsdp=8",
        "parallel.zero=3",
        "model.attention=blocked",
        "model.remat=none",
        "model.seq_len=2048",
        *LONG,
    ),  # fmt: skip
    (
        "mesh.tensor=2",
        "model.attention=blocked",
        "model.remat=selective",
        "model.seq_len=2048",
        *LONG,
    ),  # fmt: skip
    ("model.attention=tiled", "model.remat=none", "model.seq_len=512", "train.micro_batch_size=4"),
    ("model.attention=tiled", "model.remat=full", "model.seq_len=512", "train.micro_batch_size=2"),
    ("model.attention=tiled", "model.remat=none", "train.micro_batch_size=8"),
    ("mesh.data=8", "model.attention=tiled", "model.remat=selective", "model.seq_len=256"),
    (
        "mesh.fsdp=4",
        "parallel.zero=1",
        "parallel.collectives=gspmd",
        "model.attention=tiled",
        "model.remat=none",
        "model.seq_len=256",
    ),  # fmt: skip
]

# Parameter-heavy shapes (issue 27): few tokens a device beside d_model 1024 and a 8192
# vocabulary, the regime of large models at small micro-batches, where the weights'
# copies, gradients and running sums set the peak. Every ZeRO stage, with and without
# accumulation, without and with TP + SP, on 8 devices.
PARAM_HEAVY = (
    "model.d_model=1024", "model.vocab_size=8192", "model.d_ff=2816", "model.n_heads=8",
    "model.n_kv_heads=4", "model.seq_len=64", "model.remat=none", *LONG,
)  # fmt: skip
PARAM_SHAPES: list[tuple[str, ...]] = [
    (*layout, f"parallel.zero={zero}", f"train.grad_accum={m}", *PARAM_HEAVY)
    for layout in (
        ("mesh.fsdp=8",),
        ("mesh.fsdp=4", "mesh.tensor=2", "parallel.sequence_parallel=true"),
    )
    for zero in (0, 1, 2, 3)
    for m in (1, 4)
]  # fmt: skip
VALIDATION_SHAPES += PARAM_SHAPES


def _harness():
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import harness

    return harness


def compile_all(shapes, threads: int = 2, cache: str | None = None):
    """[(overrides, config, compiled memory)] for each shape, compiled on the simulated CPU
    devices (XLA compiles outside the GIL: two at a time). `cache`: a JSON file of
    compiled figures by shape, read and written (refitting without recompiling)."""
    import json

    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    from ultrajax.tools import analyze

    harness = _harness()

    known = json.load(open(cache)) if cache and os.path.exists(cache) else {}

    def one(overrides):
        cfg, devices = harness.make(*overrides)
        key = " ".join(overrides)
        if key not in known:
            compiled = analyze.compile_step(cfg, devices, harness.FAST)
            known[key] = analyze.compiled_memory(compiled)
        return overrides, cfg, known[key]

    with ThreadPoolExecutor(threads) as pool:
        results = list(pool.map(one, shapes))
    if cache:
        with open(cache, "w") as f:
            json.dump(known, f)
    return results


def mlp_moment(cfg) -> float:
    """The MLP's moment of activations.layer_work (the fit of KERNEL_WORK replaces it)."""
    pol, _common, mlp = activations.work_features(cfg)
    return sum(activations.WORK[pol][k] * v for k, v in mlp.items())


def fit(results) -> None:
    """Fit WORK, CP_WORK, PIPE_WORK and PIPE_ATTN_S in place (memory's module tables)."""
    import numpy as np
    from scipy.optimize import lsq_linear

    from ultrajax.cost import memory

    kernels = [r for r in results if r[1].model.attention in ("tiled", "blocked")]
    plain = [r for r in results if r[1].mesh.sequence == 1 and r[1].mesh.pipeline == 1]
    plain = [r for r in plain if r not in kernels]
    ring = [r for r in results if r[1].mesh.sequence > 1]
    piped = [r for r in results if r[1].mesh.pipeline > 1]

    rows: dict[str, list] = {}
    names: list[str] = []
    for _overrides, cfg, compiled in plain:
        est = memory.estimate(cfg)
        if est.peak_phase != memory.Phase.LAYER_BACKWARD:
            continue
        pol, common, mlp = activations.work_features(cfg)
        known = est.phases[memory.Phase.LAYER_BACKWARD] - est.parts.work
        target = compiled["temp"] - known - activations.weight_work(cfg)
        rows.setdefault(pol, []).append(([*common.values(), *mlp.values()], target))
        names = [*common, *mlp]
    for pol, data in rows.items():
        a = np.array([f for f, _ in data])
        b = np.array([t for _, t in data])
        # copies are non-negative; Z (ZeRO-3's gathered layer) may also correct the
        # exact terms downwards where XLA reuses a buffer they count
        lower = [-np.inf if k == "Z" else 0.0 for k in names]
        coef = lsq_linear(a, b, bounds=(lower, np.inf)).x
        activations.WORK[pol] = {k: round(float(v), 1) for k, v in zip(names, coef, strict=True)}

    if ring:  # the ring's own working set: what the layer's does not explain, relative
        for k in activations.CP_WORK:
            activations.CP_WORK[k] = 0.0
        a, b = [], []
        for _overrides, cfg, compiled in ring:
            feats = activations.ring_features(cfg)
            w = 1.0 / compiled["peak"]
            a.append([w * v for v in feats.values()])
            b.append(w * (compiled["temp"] - memory.estimate(cfg).temp))
        coef = lsq_linear(np.array(a), np.array(b), bounds=(0.0, np.inf)).x
        for k, v in zip(activations.CP_WORK, coef, strict=True):
            activations.CP_WORK[k] = round(float(v), 2)

    if kernels:  # what the layer's working set does not explain, relative
        for k in activations.KERNEL_WORK:
            activations.KERNEL_WORK[k] = 0.0
        for name, keys in (("tiled", ("T",)), ("blocked", ("P", "M"))):
            a, b = [], []
            for _overrides, cfg, compiled in kernels:
                if cfg.model.attention != name:
                    continue
                w = 1.0 / compiled["peak"]
                feats = activations.kernel_features(cfg)
                a.append([w * feats[k] for k in keys])
                target = compiled["temp"] - memory.estimate(cfg).temp
                if name == "blocked":  # its moment replaces the MLP's, where it is larger
                    target += mlp_moment(cfg)
                b.append(w * target)
            coef = lsq_linear(np.array(a), np.array(b), bounds=(0.0, np.inf)).x
            for k, v in zip(keys, coef, strict=True):
                activations.KERNEL_WORK[k] = round(float(v), 2)

    if piped:  # smallest worst |log(predicted / compiled)|, on a grid of values
        best = None
        for attn in np.arange(2.0, 4.01, 0.25):
            activations.PIPE_ATTN_S = float(attn)
            worst = {}
            for share in np.arange(0.5, 1.21, 0.05):
                for pol in activations.PIPE_WORK:
                    activations.PIPE_WORK[pol] = float(share)
                for _o, cfg, compiled in piped:
                    pol = activations.work_features(cfg)[0]
                    err = abs(math.log(memory.estimate(cfg).peak / compiled["peak"]))
                    key = (pol, round(float(share), 2))
                    worst[key] = max(worst.get(key, 0.0), err)
            shares = {}
            for pol in {activations.work_features(cfg)[0] for _o, cfg, _c in piped}:
                shares[pol] = min((e, s) for (p, s), e in worst.items() if p == pol)
            total = max(e for e, _ in shares.values())
            if best is None or total < best[0]:
                best = (total, float(attn), {p: s for p, (_, s) in shares.items()})
        _, activations.PIPE_ATTN_S, shares = best
        activations.PIPE_WORK.update(shares)

    print("WORK = {")
    for pol, coef in activations.WORK.items():
        print(f'    "{pol}": {coef},'.replace("'", '"'))
    print("}")
    print(f"CP_WORK = {activations.CP_WORK}".replace("'", '"'))
    print(f"KERNEL_WORK = {activations.KERNEL_WORK}".replace("'", '"'))
    print(f"PIPE_WORK = {activations.PIPE_WORK}".replace("'", '"'))
    print(f"PIPE_ATTN_S = {activations.PIPE_ATTN_S}")


def table(results) -> tuple[list[str], float]:
    """The markdown table (shape, predicted, compiled, ratio) and the worst ratio."""
    from ultrajax.cost import memory

    lines = [
        "| shape (over BASE) | peak phase | predicted | compiled | ratio |",
        "|---|---|---:|---:|---:|",
    ]
    worst = 1.0
    for overrides, cfg, compiled in results:
        est = memory.estimate(cfg)
        ratio = est.peak / compiled["peak"]
        worst = max(worst, ratio, key=lambda r: abs(math.log(r)))
        shape = " ".join(o.split(".", 1)[1] for o in overrides)
        lines.append(
            f"| `{shape}` | {est.peak_phase} | {est.peak / 2**20:.2f} MiB"
            f" | {compiled['peak'] / 2**20:.2f} MiB | {ratio:.3f} |"
        )
    return lines, worst


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--validate", action="store_true", help="the validation table instead")
    ap.add_argument("--cache", help="JSON file of compiled figures to reuse and extend")
    args = ap.parse_args(argv)
    sys.path.insert(0, ROOT)
    import jax

    start = time.time()
    if args.validate:
        results = compile_all(VALIDATION_SHAPES, cache=args.cache)
        lines, worst = table(results)
        print(
            f"Validation, {time.strftime('%Y-%m-%d')}: {len(results)} shapes, XLA:CPU fp32 "
            f"(jax {jax.__version__}, {os.cpu_count()}-core {platform.machine()} CPU, 8 "
            f"simulated devices), compiled in {time.time() - start:.0f} s; worst "
            f"predicted / compiled {worst:.3f}\n"
        )
        print("\n".join(lines))
        return 0 if 0.9 <= worst <= 1.1 else 1
    results = compile_all(FIT_SHAPES, cache=args.cache)
    fit(results)
    lines, worst = table(results)
    print("\n".join(lines))
    print(f"worst ratio with the fitted values: {worst:.3f} over {len(results)} fitting shapes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
