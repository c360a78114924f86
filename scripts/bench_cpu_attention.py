"""Attention on a CPU: each plain-XLA backend's forward + backward beside torch's SDPA.

    python scripts/bench_cpu_attention.py                 # the cpu256 shape of bench_step.py
    python scripts/bench_cpu_attention.py --batch 8 --seq 512 --heads 4 --kv-heads 2

One layer's attention of the step: fp32, causal, four packed documents a row (segment
ids; torch's SDPA gets causal only, the cheaper case, since its CPU flash kernel takes no
document mask). The time is that of jax.grad of sum(out * random) w.r.t. q, k and v, the
median of `--iters` calls after two warm-up calls; the largest difference of each
backend's output and gradients from `xla`'s is printed beside. A benchmark: nothing is
asserted.
"""

from __future__ import annotations

import argparse
import sys

from timing import median_ms


def jax_rows(args) -> list[tuple[str, float, float]]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from ultrajax.model.attention import backends as attention

    b, t, h, kv, d = args.batch, args.seq, args.heads, args.kv_heads, args.head_dim
    rng = np.random.default_rng(0)
    q, do = (jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((b, t, kv, d)), jnp.float32) for _ in range(2))
    seg = jnp.asarray(np.repeat(np.arange(4) + 1, -(-t // 4))[:t][None].repeat(b, 0))
    rows, ref = [], None
    for name in ("xla", "blocked", "tiled"):
        fn = attention.BACKENDS[name].fn

        def run(q, k, v, fn=fn):
            out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, seg), q, k, v)
            return (out, *vjp(do))

        g = jax.jit(run)
        got = g(q, k, v)
        ref = ref or got
        err = max(float(jnp.abs(a - r).max()) for a, r in zip(got, ref, strict=True))
        rows.append(
            (name, median_ms(lambda g=g: jax.block_until_ready(g(q, k, v)), args.iters), err)
        )
    return rows


def torch_row(args) -> tuple[str, float, float] | None:
    try:
        import torch
    except ImportError:
        return None
    b, t, h, kv, d = args.batch, args.seq, args.heads, args.kv_heads, args.head_dim
    q = torch.randn(b, h, t, d, requires_grad=True)
    k, v = (torch.randn(b, kv, t, d, requires_grad=True) for _ in range(2))
    do = torch.randn(b, h, t, d)

    def step():
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True
        )
        torch.autograd.grad(out, (q, k, v), do)

    name = f"torch {torch.__version__} SDPA, causal only ({torch.get_num_threads()} threads)"
    return name, median_ms(step, args.iters), float("nan")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args(argv)
    if args.heads % args.kv_heads:
        p.error("--heads must be a multiple of --kv-heads")
    rows = jax_rows(args)
    ref = torch_row(args)
    print(f"attention fwd + bwd, fp32: batch {args.batch}, seq {args.seq}, heads "
          f"{args.heads} / kv {args.kv_heads}, head_dim {args.head_dim}")  # fmt: skip
    print("\n| backend | ms | vs xla | largest difference from xla |\n|---|---|---|---|")
    base = rows[0][1]
    for name, ms, err in rows + ([ref] if ref else []):
        diff = "-" if err != err else f"{err:.1e}"
        print(f"| {name} | {ms:.1f} | {base / ms:.2f}x | {diff} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
