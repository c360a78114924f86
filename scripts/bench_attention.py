"""Time the Pallas flash attention (ultrajax.kernels) beside cuDNN's on the GPU; print a table.

    python scripts/bench_attention.py                       # seq 2048, 4096, 8192
    python scripts/bench_attention.py --seqs 2048 --heads 32 --kv-heads 8 --head-dim 64
    python scripts/bench_attention.py --seqs 4096 --sweep    # tile sizes, warps, stages
    python scripts/bench_attention.py --seqs 4096 --sweep bwd --fused  # the one-kernel backward

Each row: 16,384 tokens (batch = 16384 / seq), bf16, causal; with `--packed` four
documents per row (segment ids; cuDNN then gets the equivalent dense mask). Forward +
backward of sum(out * random) through `jax.grad`, median of timed calls after warm-up.
The largest error of the kernel's output and gradients against cuDNN's is printed beside
(bf16: expect ~1e-2). Each length gets a row per backward (`--backward`: split, the dQ
and dK/dV kernels; fused, one kernel with dQ by atomic adds; `--heads-first` adds the
split one on the grid's order before, batch and head fastest). `--sweep` times each of
SWEEP (or the `q,k,q_bwd,k_bwd,warps,stages` choices given) at every sequence length:
what to set as `model.attention_blocks` and BlockSizes' defaults. A benchmark, not a
test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from timing import median_ms

# (q, k, q_bwd, k_bwd, warps, stages): the defaults first, then each one changed alone,
# then the Triton tutorial's flash-attention choices (larger tiles, deeper pipelines)
SWEEP = (
    (128, 128, 64, 64, 4, 2),
    (128, 64, 64, 64, 4, 2),
    (64, 64, 64, 64, 4, 2),
    (128, 128, 64, 64, 8, 2),
    (128, 128, 64, 64, 4, 3),
    (128, 64, 64, 64, 4, 4),
    (128, 128, 32, 128, 4, 2),
    (128, 128, 128, 128, 8, 2),
    (128, 64, 64, 64, 8, 3),
)
# `--sweep fwd`: (q, k, warps, stages) of the forward kernel, timed alone;
# `--sweep bwd`: (q_bwd, k_bwd, warps, stages) of the backward kernels (with `--fused`, of
# the one kernel), timed as forward + backward with the default forward (the forward's
# time is printed beside)
FWD_SWEEP = tuple(
    (q, k, w, st) for q, k in ((128, 128), (128, 64), (64, 64), (64, 128))
    for w in (4, 8) for st in (2, 3)
)  # fmt: skip
BWD_SWEEP = tuple(
    (q, k, w, st) for q, k in ((64, 64), (64, 128), (128, 64), (128, 128), (32, 64))
    for w in (4, 8) for st in (2, 3)
)  # fmt: skip


def inputs(seq: int, args):
    """(batch, heads, kv heads, q, k, v, dout): args.tokens tokens of random bf16 at `seq`."""
    import jax.numpy as jnp
    import numpy as np

    b = max(1, args.tokens // seq)
    h, kv, d = args.heads, args.kv_heads, args.head_dim
    rng = np.random.default_rng(seq)
    q, k, v, do = (
        jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
        for shape in ((b, seq, h, d), (b, seq, kv, d), (b, seq, kv, d), (b, seq, h, d))
    )
    return b, h, kv, q, k, v, do


def row(seq: int, args, blocks, cudnn_runs: dict) -> str:
    """One table row: both implementations' fwd+bwd time and their largest differences.
    cuDNN's (time, gradients, output) at each length is kept in `cudnn_runs` for the next
    row."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from ultrajax.kernels.flash_attention import flash_attention

    b, h, kv, q, k, v, do = inputs(seq, args)
    seg = None
    if args.packed:
        seg = jnp.asarray(np.repeat(np.arange(seq) * 4 // seq + 1, 1)[None].repeat(b, 0))

    def pallas(q, k, v, seg=seg):
        return flash_attention(q, k, v, seg, seg, blocks=blocks)[0]

    def cudnn(q, k, v, seg=seg):
        if seg is None:
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        causal = jnp.tril(jnp.ones((seq, seq), bool))
        mask = (seg[:, None, :, None] == seg[:, None, None, :]) & causal
        return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="cudnn")

    def fwd_bwd(fn):
        loss = lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * do)  # noqa: E731
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))

    def timed(fn):
        f = fwd_bwd(fn)
        out = jax.block_until_ready(f(q, k, v))
        ms = median_ms(lambda f=f: jax.block_until_ready(f(q, k, v)), args.iters)
        return ms, out, jax.jit(fn)(q, k, v)

    if seq not in cudnn_runs:
        cudnn_runs[seq] = timed(cudnn)
    (tp, gp, op), (tc, gc, oc) = timed(pallas), cudnn_runs[seq]
    out_diff = float(jnp.abs(op.astype(jnp.float32) - oc.astype(jnp.float32)).max())
    grad_diff = max(
        float(jnp.abs(a.astype(jnp.float32) - c.astype(jnp.float32)).max())
        for a, c in zip(gp[1], gc[1], strict=True)
    )
    masks = "causal + 4 docs" if args.packed else "causal"
    return (
        f"| {seq} | {b} | {h}/{kv} | {masks} | {tp:.2f} | {tc:.2f} | {tp / tc:.2f} | "
        f"{out_diff:.3g} | {grad_diff:.3g} |"
    )


def sweep(seq: int, args, kind: str) -> None:
    """Print one row per choice of `kind` ("fwd" or "bwd"): the kernel's time beside
    cuDNN's for the same work (forward alone, or forward + backward), at one length."""
    import jax
    import jax.numpy as jnp

    from ultrajax.kernels.flash_attention import BlockSizes, flash_attention

    d = args.head_dim
    _, _, _, q, k, v, do = inputs(seq, args)

    def timed(fn, kind=kind):
        if kind == "fwd":
            f = jax.jit(fn)
        else:
            loss = lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * do)  # noqa: E731
            f = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        jax.block_until_ready(f(q, k, v))
        return median_ms(lambda: jax.block_until_ready(f(q, k, v)), args.iters)

    def cudnn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")

    base = timed(cudnn)
    # the default forward alone: the backward's own time is the rest
    fwd_default = timed(lambda q, k, v: flash_attention(q, k, v)[0], "fwd") if kind == "bwd" else 0
    for c in FWD_SWEEP if kind == "fwd" else BWD_SWEEP:
        if kind == "fwd":
            blocks = BlockSizes(q=c[0], k=c[1], warps=c[2], stages=c[3])
        else:
            blocks = BlockSizes(q_bwd=c[0], k_bwd=c[1], warps_bwd=c[2], stages_bwd=c[3],
                                fused_bwd=args.fused)  # fmt: skip
        name = ",".join(map(str, c)) + (" fused" if kind == "bwd" and args.fused else "")
        try:
            ms = timed(lambda q, k, v, blocks=blocks: flash_attention(q, k, v, blocks=blocks)[0])
        except Exception as e:  # a choice the GPU cannot hold (shared memory): say so
            print(f"| {kind} | {d} | {seq} | {name} | failed: {type(e).__name__} "
                  f"{str(e)[:100]} |", flush=True)  # fmt: skip
            continue
        extra = f"{ms - fwd_default:.2f}" if kind == "bwd" else "-"
        print(f"| {kind} | {d} | {seq} | {name} | {ms:.2f} | {extra} | {base:.2f} | "
              f"{ms / base:.2f} |", flush=True)  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqs", default="2048,4096,8192")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--packed", action="store_true", help="4 documents per row")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--block-q", type=int, help="forward tile (default: the model's, TILES)")
    p.add_argument("--block-k", type=int)
    p.add_argument(
        "--backward",
        choices=("split", "fused", "both"),
        default="both",
        help="the kernel's backward: two kernels, one (dQ by atomic adds), or both",
    )
    p.add_argument("--fused", action="store_true", help="--sweep bwd: the one-kernel backward")
    p.add_argument("--heads-first", action="store_true",
                   help="also the split backward with the grid's order before (batch and head "
                        "fastest, BlockSizes.blocks_first=False), a row per length")  # fmt: skip
    p.add_argument(
        "--sweep",
        nargs="?",
        const="",
        default=None,
        help="time SWEEP, or 'q,k,q_bwd,k_bwd,warps,stages;...' (then --block-* are unused), "
        "or 'fwd' / 'bwd': the forward's or the backward's tiles, warps and stages alone",
    )
    args = p.parse_args(argv)

    import jax

    from ultrajax.kernels.flash_attention import BlockSizes

    if jax.default_backend() != "gpu":
        print("bench_attention needs a GPU (cuDNN and the Triton lowering)", file=sys.stderr)
        return 2
    if args.sweep in ("fwd", "bwd"):
        print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
        print(f"heads {args.heads}/{args.kv_heads}, {args.tokens} tokens per call, causal, bf16")
        print("| sweep | head_dim | seq | q,k,warps,stages | pallas ms | backward ms | "
              "cudnn ms | pallas/cudnn |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|")
        for seq in (int(s) for s in args.seqs.split(",")):
            sweep(seq, args, args.sweep)
        return 0
    if args.sweep is None:
        tiles = BlockSizes.of(None, args.head_dim)  # what the model runs for this head_dim
        q, k = args.block_q or tiles.q, args.block_k or tiles.k
        fused = {"split": (False,), "fused": (True,), "both": (False, True)}[args.backward]
        choices = [BlockSizes(q=q, k=k, q_bwd=tiles.q_bwd, k_bwd=tiles.k_bwd, fused_bwd=f)
                   for f in fused]  # fmt: skip
        if args.heads_first:
            choices.append(replace(choices[0], fused_bwd=False, blocks_first=False))
    else:
        given = [tuple(int(x) for x in c.split(",")) for c in args.sweep.split(";") if c]
        choices = [BlockSizes(*c) for c in (given or SWEEP)]
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    print(
        "| q,k,q_bwd,k_bwd,warps,stages | seq | batch | heads/kv | masks | pallas fwd+bwd ms | "
        "cudnn fwd+bwd ms | pallas/cudnn | max |out diff| | max |grad diff| |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    cudnn_runs = {}
    for seq in (int(s) for s in args.seqs.split(",")):
        for b in choices:
            name = f"{b.q},{b.k},{b.q_bwd},{b.k_bwd},{b.warps},{b.stages}"
            name += " fused" if b.fused_bwd else " split"
            name += "" if b.blocks_first else " heads-first"
            try:
                print(f"| {name} {row(seq, args, b, cudnn_runs)}", flush=True)
            except Exception as e:  # a choice the GPU cannot hold (shared memory): say so
                print(f"| {name} | {seq} | failed: {type(e).__name__}: {str(e)[:120]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
