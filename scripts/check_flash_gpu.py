"""The flash attention compiled on a GPU against the one plain-jnp attention in fp32.

    python scripts/check_flash_gpu.py
    python scripts/check_flash_gpu.py --interpret   # off a GPU: this script's own check

The CPU tests run the kernel in Pallas's interpreter; this runs what the Triton lowering
makes of it: causal and packed documents (ids rising along the row, so whole blocks are
skipped, and padding), GQA, head_dim 64 and 128, the model's tiles and small ones, fp32
inputs (Triton multiplies them in TF32) and bf16; each with both backwards (two kernels,
and the one that adds dQ atomically). Errors are relative to the reference's
largest magnitude; exits 1 if any is above the dtype's bound or not finite.
"""

from __future__ import annotations

import argparse
import functools
import sys
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np

from ultrajax.kernels.flash_attention import BlockSizes, flash_attention
from ultrajax.model.attention import xla

# bound on |kernel - reference| / max |reference|: TF32 keeps 10 mantissa bits, bf16 8
BOUND = {jnp.float32: 1e-2, jnp.bfloat16: 4e-2}
CASES = (  # batch, length, heads, kv heads, head_dim, dtype, documents, tiles; what the
    # model runs first (a short time limit keeps those)
    (1, 1000, 8, 2, 64, jnp.bfloat16, 5, None),  # None: the model's tiles (TILES)
    (1, 1000, 4, 1, 128, jnp.bfloat16, 5, None),
    (2, 384, 4, 4, 128, jnp.float32, 1, None),  # fp32: the kernel's own fp32 tiles
    (2, 200, 8, 2, 64, jnp.float32, 3, BlockSizes(64, 64, 64, 64)),
    (2, 512, 8, 2, 64, jnp.bfloat16, 3, BlockSizes(64, 64, 64, 64)),
)
SMALL = (1, 100, 4, 2, 16, jnp.float32, 3, BlockSizes(16, 16, 16, 16))  # --interpret


def segments(b: int, t: int, docs: int) -> jnp.ndarray:
    """Rising document ids of uneven lengths, the last 5 tokens padding (id 0)."""
    rng = np.random.default_rng(t)
    cuts = np.sort(rng.choice(np.arange(1, t - 5), docs - 1, replace=False))
    seg = np.ones((b, t), np.int32)
    for c in cuts:
        seg[:, c:] += 1
    seg[:, -5:] = 0
    return jnp.asarray(seg)


def check(b, t, h, kv, d, dt, docs, tiles, interpret=False) -> bool:
    """One case, with each backward (split: two kernels; fused: one, dQ by atomic adds):
    the kernel's out, lse and gradients of both in one compile, the reference's in one."""
    rng = np.random.default_rng(d + t)
    q, k, v = (jnp.asarray(rng.standard_normal((b, t, n, d)), dt) for n in (h, kv, kv))
    seg = segments(b, t, docs)
    do = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32)
    tiles = tiles or BlockSizes.of(None, d, jnp.dtype(dt).itemsize)

    def with_grads(fn, q, k, v):  # (out, lse, dq, dk, dv): the gradients of sum(out * do)
        def loss(q, k, v):
            o, lse = fn(q, k, v)
            return jnp.sum(o.astype(jnp.float32) * do), (o, lse)

        (_, (o, lse)), grads = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(q, k, v)
        return (o, lse, *grads)

    def kernels(q, k, v):
        return [
            with_grads(functools.partial(flash_attention, q_segment_ids=seg, kv_segment_ids=seg,
                                         blocks=replace(tiles, fused_bwd=f), interpret=interpret),
                       q, k, v)
            for f in (False, True)
        ]  # fmt: skip

    def reference(q, k, v):
        o, lse = xla.reference(*(x.astype(jnp.float32) for x in (q, k, v)), seg, seg)
        return o, lse.transpose(0, 2, 1)

    got = jax.jit(kernels)(q, k, v)
    want = jax.jit(functools.partial(with_grads, reference))(q, k, v)
    real = (seg > 0)[:, :, None]  # padding queries' lse is -inf in both
    ok = True
    shape = f"b{b} t{t} h{h}/{kv} d{d} docs {docs}"
    tile = f"tiles {tiles.q}x{tiles.k}/{tiles.q_bwd}x{tiles.k_bwd}"
    for backward, outs in zip(("split", "fused"), got, strict=True):
        errs = []
        for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), outs, want, strict=True):
            g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
            if name == "lse":
                g, w = np.where(real, g, 0), np.where(real, w, 0)
            errs.append((name, float(np.abs(g - w).max()) / max(float(np.abs(w).max()), 1e-30)))
        good = all(np.isfinite(e) and e < BOUND[dt] for _, e in errs)
        ok &= good
        shown = " ".join(f"{n} {e:.2e}" for n, e in errs)
        print(f"{'ok  ' if good else 'FAIL'} {dt.__name__} {shape} {tile} {backward}: {shown}",
              flush=True)  # fmt: skip
    return ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--interpret", action="store_true",
                   help="off a GPU: one small case, the kernel in Pallas's interpreter (a "
                        "check of this script, not of the Triton lowering)")  # fmt: skip
    args = p.parse_args(argv)
    print(jax.devices()[0].device_kind, "jax", jax.__version__)
    if args.interpret:
        return 0 if check(*SMALL, interpret=True) else 1
    if jax.default_backend() != "gpu":
        print("check_flash_gpu needs a GPU (the Triton lowering); --interpret runs it here",
              file=sys.stderr)  # fmt: skip
        return 2
    results = [check(*case) for case in CASES]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
