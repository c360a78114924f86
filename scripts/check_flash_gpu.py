"""The flash attention compiled on a GPU against the one plain-jnp attention in fp32.

    python scripts/check_flash_gpu.py

The CPU tests run the kernel in Pallas's interpreter; this runs what the Triton lowering
makes of it: causal and packed documents (ids rising along the row, so whole blocks are
skipped, and padding), GQA, head_dim 64 and 128, the default tiles and small ones, fp32
inputs (Triton multiplies them in TF32) and bf16. Errors are relative to the reference's
largest magnitude; exits 1 if any is above the dtype's bound or not finite.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

from ultrajax.kernels.flash_attention import BlockSizes, flash_attention
from ultrajax.model.attention import xla

# bound on |kernel - reference| / max |reference|: TF32 keeps 10 mantissa bits, bf16 8
BOUND = {jnp.float32: 1e-2, jnp.bfloat16: 4e-2}
CASES = (  # batch, length, heads, kv heads, head_dim, dtype, documents, tiles
    (2, 200, 8, 2, 64, jnp.float32, 3, BlockSizes(64, 64, 64, 64)),
    (2, 512, 8, 2, 64, jnp.bfloat16, 3, BlockSizes(64, 64, 64, 64)),
    (1, 1000, 8, 2, 64, jnp.bfloat16, 5, BlockSizes()),
    (1, 1000, 4, 1, 128, jnp.bfloat16, 5, BlockSizes()),
    (2, 384, 4, 4, 128, jnp.float32, 1, None),  # fp32: the kernel's own fp32 tiles
)


def segments(b: int, t: int, docs: int) -> jnp.ndarray:
    """Rising document ids of uneven lengths, the last 5 tokens padding (id 0)."""
    rng = np.random.default_rng(t)
    cuts = np.sort(rng.choice(np.arange(1, t - 5), docs - 1, replace=False))
    seg = np.ones((b, t), np.int32)
    for c in cuts:
        seg[:, c:] += 1
    seg[:, -5:] = 0
    return jnp.asarray(seg)


def check(b, t, h, kv, d, dt, docs, tiles) -> bool:
    rng = np.random.default_rng(d + t)
    q, k, v = (jnp.asarray(rng.standard_normal((b, t, n, d)), dt) for n in (h, kv, kv))
    seg = segments(b, t, docs)
    do = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32)

    def kernel(q, k, v):
        return flash_attention(q, k, v, seg, seg, blocks=tiles)

    def reference(q, k, v):
        o, lse = xla.reference(*(x.astype(jnp.float32) for x in (q, k, v)), seg, seg)
        return o, lse.transpose(0, 2, 1)

    def grads(fn):
        loss = lambda *a: jnp.sum(fn(*a)[0].astype(jnp.float32) * do)  # noqa: E731
        return jax.grad(loss, (0, 1, 2))

    got = (*jax.jit(kernel)(q, k, v), *jax.jit(grads(kernel))(q, k, v))
    want = (*reference(q, k, v), *grads(reference)(q, k, v))
    real = (seg > 0)[:, :, None]  # padding queries' lse is -inf in both
    errs = []
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want, strict=True):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        if name == "lse":
            g, w = np.where(real, g, 0), np.where(real, w, 0)
        errs.append((name, float(np.abs(g - w).max()) / max(float(np.abs(w).max()), 1e-30)))
    ok = all(np.isfinite(e) and e < BOUND[dt] for _, e in errs)
    shown = " ".join(f"{n} {e:.2e}" for n, e in errs)
    shape = f"b{b} t{t} h{h}/{kv} d{d} docs {docs}"
    tiles = tiles or BlockSizes.of(None, d, jnp.dtype(dt).itemsize)
    tile = f"tiles {tiles.q}x{tiles.k}/{tiles.q_bwd}x{tiles.k_bwd}"
    print(f"{'ok  ' if ok else 'FAIL'} {dt.__name__} {shape} {tile}: {shown}", flush=True)
    return ok


def main() -> int:
    print(jax.devices()[0].device_kind, "jax", jax.__version__)
    if jax.default_backend() != "gpu":
        print("check_flash_gpu needs a GPU (the Triton lowering)", file=sys.stderr)
        return 2
    results = [check(*case) for case in CASES]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
