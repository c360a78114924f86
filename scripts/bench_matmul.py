"""The step's matmuls alone: XLA's rate beside torch's on the same contraction.

    python scripts/bench_matmul.py                        # the cpu256 shape's linear layers
    python scripts/bench_matmul.py --tokens 4096 --d-model 256 --d-ff 688

For one linear layer x (tokens, d_model) @ W (d_model, d_ff): the forward product, the
input gradient dy @ W^T and the weight gradient x^T @ dy, which contracts over the
tokens, each timed alone (jit on one side, eager torch on the other, fp32, the median of
`--iters` calls). Where XLA:CPU's rate trails torch's here, the gap cannot be closed
by the model's code: it is the matmul library's (benchmarks/RESULTS.md). A benchmark:
nothing is asserted.
"""

from __future__ import annotations

import argparse
import sys

from timing import median_ms

# name, einsum, operand shapes from (n tokens, d, f)
PRODUCTS = (
    ("forward x @ W", "nd,df->nf", lambda n, d, f: ((n, d), (d, f))),
    ("input gradient dy @ W^T", "nf,df->nd", lambda n, d, f: ((n, f), (d, f))),
    ("weight gradient x^T @ dy", "nd,nf->df", lambda n, d, f: ((n, d), (n, f))),
)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--d-ff", type=int, default=688)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np

    try:
        import torch
    except ImportError:
        torch = None
    n, d, f = args.tokens, args.d_model, args.d_ff
    flops = 2.0 * n * d * f
    rng = np.random.default_rng(0)
    print(f"fp32, {n} tokens, d_model {d}, d_ff {f}; GFLOP/s (higher is better)")
    print("\n| product | XLA | torch | XLA / torch |\n|---|---|---|---|")
    for name, eq, shapes in PRODUCTS:
        a, b = (rng.standard_normal(s).astype(np.float32) for s in shapes(n, d, f))
        fn = jax.jit(lambda x, y, eq=eq: jnp.einsum(eq, x, y))
        ja, jb = jnp.asarray(a), jnp.asarray(b)
        ms = median_ms(lambda f=fn, x=ja, y=jb: f(x, y).block_until_ready(), args.iters)
        xla = flops / ms / 1e6
        if torch is None:
            print(f"| {name} | {xla:.0f} | - | - |")
            continue
        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        ref = flops / median_ms(lambda ta=ta, tb=tb, eq=eq: torch.einsum(eq, ta, tb), args.iters)
        ref /= 1e6
        print(f"| {name} | {xla:.0f} | {ref:.0f} | {xla / ref:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
