"""Time the Triton fused residual add + RMSNorm (ultrajax.kernels.rms_norm) beside XLA's
fusion of the same jnp code on the GPU; print a table.

    python scripts/bench_norm.py                       # 16,384 tokens, d 2048 and 4096
    python scripts/bench_norm.py --dims 2048 --tokens 32768

Forward + backward of a loss that uses both outputs (the normalised y and the new
residual stream h), bf16 activations, fp32 scale, median of timed calls after warm-up.
"min GB/s" divides the bytes the fused op must move (x, r read and h, y written in the
forward; dy, dh, h read and dx written in the backward: 16 bytes per bf16 element) by
the time: near the card's HBM bandwidth means nothing is left to fuse. The largest
difference between the two is printed beside (bf16: expect ~1e-2). A benchmark, not a
test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import sys

from timing import median_ms


def row(d: int, args) -> str:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from ultrajax.kernels.rms_norm import reference, rms_norm

    rng = np.random.default_rng(d)
    x, r, dy, dh = (
        jnp.asarray(rng.standard_normal((args.tokens, d)), jnp.bfloat16) for _ in range(4)
    )
    w = jnp.asarray(1 + 0.1 * rng.standard_normal(d), jnp.float32)

    def fwd_bwd(fn):
        def loss(x, r, w):
            y, h = fn(x, w, r)
            return jnp.sum((y * dy).astype(jnp.float32)) + jnp.sum((h * dh).astype(jnp.float32))

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))

    results = {}
    for name, fn in (("triton", rms_norm), ("xla", reference)):
        f = fwd_bwd(fn)
        out = jax.block_until_ready(f(x, r, w))
        ms = median_ms(lambda f=f: jax.block_until_ready(f(x, r, w)), args.iters)
        results[name] = (ms, out)
    (tt, gt), (tx, gx) = results["triton"], results["xla"]
    diff = max(
        float(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max())
        for a, b in zip(gt[1], gx[1], strict=True)
    )
    gb = 16 * args.tokens * d / 1e9
    return (
        f"| {args.tokens} | {d} | {tt:.3f} | {tx:.3f} | {tt / tx:.2f} | "
        f"{gb / tt * 1e3:.0f} | {gb / tx * 1e3:.0f} | {diff:.3g} |"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dims", default="2048,4096")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args(argv)

    import jax

    if jax.default_backend() != "gpu":
        print("bench_norm needs a GPU (jax-triton compiles for CUDA)", file=sys.stderr)
        return 2
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    print(
        "| tokens | d | triton fwd+bwd ms | xla fwd+bwd ms | triton/xla | triton min GB/s | "
        "xla min GB/s | max |grad diff| |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for d in (int(s) for s in args.dims.split(",")):
        print(row(d, args), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
