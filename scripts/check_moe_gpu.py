"""The MoE layer on a GPU, where jax's `ragged_dot` runs as XLA's dense rewrite (every row
times every expert, as jax's own lowering does on a CPU: docs/moe.md), beside
model/grouped.py's blocks; what the memory model's MoE working set is fitted on.

    python scripts/check_moe_gpu.py            # the GPU's shapes
    python scripts/check_moe_gpu.py --small    # tiny shapes: runs anywhere, a smoke test

1. Numerics: the layer (dropless, top-2 of 8, z-loss; ragged_dot and the blocks) against
   every expert computed densely: outputs and the gradients of every weight and of the
   input, in fp32 (the GPU multiplies in TF32) and bf16; errors relative to the
   reference's largest magnitude. Exits 1 if any is above its bound or not finite.
2. The layer's forward and backward time per implementation, with the FLOPs the model
   counts for it.
3. The compiled train step's memory (arguments, temporaries, peak) per implementation,
   micro-batch and remat policy, beside the memory model's saved activations.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from ultrajax.config import parse, validate
from ultrajax.cost import activations
from ultrajax.model import llama, moe
from ultrajax.model.boundaries import ONE_DEVICE
from ultrajax.tools import analyze

BOUND = {"float32": 1e-2, "bfloat16": 4e-2}  # TF32 keeps 10 mantissa bits, bf16 8


def config(small: bool, *overrides: str):
    size = (
        ["model.d_model=64", "model.moe_d_ff=96", "model.seq_len=128", "model.n_heads=4"]
        if small
        else ["model.d_model=1024", "model.moe_d_ff=2816", "model.seq_len=2048", "model.n_heads=8"]
    )
    over = [
        *size,
        "model.n_layers=4",
        "model.n_kv_heads=4",
        "model.vocab_size=8192",
        "model.moe_experts=8",
        "model.moe_top_k=2",
        "model.moe_z_coef=0.001",
        "train.micro_batch_size=1",
        *overrides,
    ]
    cfg = parse.load(None, over)
    validate.resolve_mesh(cfg, 1)
    return cfg


def dense_reference(m, p, x):
    """Every expert on every token in one einsum each, then the chosen ones gated."""
    logits = x.astype(jnp.float32) @ p["router"].astype(jnp.float32)
    scores = jax.nn.softmax(logits) if m.moe_router == "softmax" else jax.nn.sigmoid(logits)
    _, idx = jax.lax.top_k(scores + p["router_bias"], m.moe_top_k)
    gates = jnp.take_along_axis(scores, idx, -1)
    gates = gates / gates.sum(-1, keepdims=True) if m.moe_norm_topk else gates
    gate = jnp.einsum("td,edf->etf", x, p["moe_gate"])
    up = jnp.einsum("td,edf->etf", x, p["moe_up"])
    every = jnp.einsum("etf,efd->etd", jax.nn.silu(gate) * up, p["moe_down"])
    chosen = every[idx, jnp.arange(x.shape[0])[:, None]]
    return jnp.einsum("tkd,tk->td", chosen.astype(jnp.float32), gates).astype(x.dtype)


def layer_weights(m, key, dtype):
    out = {}
    for i, p in enumerate(q for q in llama.params_of(m) if q.part in (llama.ROUTER, llama.EXPERTS)):
        shape = p.shape(m)[1:]
        scale = 1.0 / np.sqrt(shape[-2] if len(shape) > 1 else 1)
        w = jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32) * scale
        out[p.key] = w.astype(jnp.float32 if p.part == llama.ROUTER else dtype)
    return out


def numerics(small: bool) -> list[str]:
    failures = []
    tokens = 256 if small else 4096
    for dtype, impl in itertools.product(("float32", "bfloat16"), ("ragged", "blocked")):
        m = config(small, f"model.dtype={dtype}", f"model.moe_grouped={impl}").model
        dt = jnp.dtype(dtype)
        p = layer_weights(m, jax.random.key(1), dt)
        h = jax.random.normal(jax.random.key(2), (1, tokens, m.d_model), jnp.float32).astype(dt)
        r = jax.random.normal(jax.random.key(3), h.shape, jnp.float32)

        def ours(p, h, m=m, r=r):
            return jnp.sum(moe.moe_mlp(p, h, cfg=m, ep=ONE_DEVICE)[0].astype(jnp.float32) * r)

        def ref(p, h, m=m, r=r):
            return jnp.sum(dense_reference(m, p, h[0]).astype(jnp.float32) * r[0])

        got = jax.jit(jax.value_and_grad(ours, (0, 1)))(p, h)
        want = jax.jit(jax.value_and_grad(ref, (0, 1)))(p, h)
        pairs = [("loss", got[0], want[0])]
        for (path, a), b in zip(
            jax.tree_util.tree_leaves_with_path(got[1]), jax.tree.leaves(want[1]), strict=True
        ):
            pairs.append((jax.tree_util.keystr(path), a, b))
        for name, a, b in pairs:
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            err = float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))
            ok = np.isfinite(a).all() and err <= BOUND[dtype]
            print(f"{dtype:9s} {impl:8s} {name:28s} relative error {err:.2e} "
                  f"{'ok' if ok else 'FAIL'}")  # fmt: skip
            if not ok:
                failures.append(f"{dtype} {impl} {name}")
    return failures


def timing(small: bool) -> None:
    """The layer's forward and backward per grouped-matmul implementation: jax's
    ragged_dot (XLA's dense rewrite on a GPU) and model/grouped.py's blocks."""
    tokens = 256 if small else 8192
    for impl in ("ragged", "blocked"):
        m = config(small, "model.dtype=bfloat16", f"model.moe_grouped={impl}").model
        p = layer_weights(m, jax.random.key(4), jnp.bfloat16)
        h = jax.random.normal(jax.random.key(5), (1, tokens, m.d_model), jnp.bfloat16)

        def loss(p, h, m=m):
            return jnp.sum(moe.moe_mlp(p, h, cfg=m, ep=ONE_DEVICE)[0])

        step = jax.jit(jax.grad(loss))
        jax.block_until_ready(step(p, h))
        t = time.perf_counter()
        for _ in range(10):
            out = step(p, h)
        jax.block_until_ready(out)
        ms = (time.perf_counter() - t) / 10 * 1e3
        flops = 3 * 2 * tokens * m.moe_top_k * 3 * m.d_model * m.expert_ff  # fwd + bwd, counted
        print(f"layer fwd+bwd, {impl}, {tokens} tokens, bf16: {ms:.2f} ms, "
              f"{flops / ms / 1e9:.1f} TFLOP/s of the counted FLOPs")  # fmt: skip


def memory(small: bool) -> None:
    """Per grouped-matmul implementation, micro-batch (2048 and 4096 tokens) and remat
    policy: compiled memory, with one JSON line each for fitting the memory model's MoE
    working set (tests/data/moe_h200_memory.json holds the ragged lines)."""
    print(f"{'grouped':8s} {'remat':10s} {'rows':>4s} {'arguments':>10s} {'temp':>10s} "
          f"{'peak':>10s} {'saved (model)':>14s}")  # fmt: skip
    runs = [("ragged", r, p) for r in (1, 2) for p in ("none", "selective", "full")]
    runs += [("blocked", r, p) for r in (1, 2) for p in ("none", "full")]
    for impl, rows, remat in runs:
        over = ("model.dtype=bfloat16", f"model.remat={remat}", f"train.micro_batch_size={rows}")
        over += (f"model.moe_grouped={impl}",)
        cfg = config(small, *over)
        compiled = analyze.compiled_memory(analyze.compile_step(cfg, jax.devices()[:1]))
        saved = cfg.model.n_layers * sum(activations.saved_per_layer(cfg).values())
        keys = ("argument", "temp", "peak")
        mib = [compiled[k] / 2**20 for k in keys] + [saved / 2**20]
        print(f"{impl:8s} {remat:10s} {rows:4d} " + " ".join(f"{v:9.1f}M" for v in mib[:3])
              + f" {mib[3]:13.1f}M")  # fmt: skip
        record = {k: int(compiled[k]) for k in keys} | {"saved": int(saved)}
        print("json " + json.dumps({"overrides": list(over), **record}))


def main() -> int:
    args = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    args.add_argument("--small", action="store_true", help="tiny shapes (any backend)")
    small = args.parse_args().small
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}")
    failures = numerics(small)
    timing(small)
    memory(small)
    if failures:
        print("FAILED: " + ", ".join(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
