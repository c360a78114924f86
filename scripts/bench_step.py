"""Time the train step for a few model sizes on the device present; print a table.

    python scripts/bench_step.py                      # CPU: tiny, small; GPU: 125m, 350m, 1b
    python scripts/bench_step.py --sizes 125m,1b --steps 20
    python scripts/bench_step.py --cpu-devices 4 parallel.zero=1   # overrides apply to every size
    python scripts/bench_step.py --compare-torch      # and transformers + torch, same shape

The step is built exactly as `python -m ultrajax.train` builds it
(`ultrajax.train.setup.build_run`: mesh, rules, sharded state created inside jit, the
donated, jitted step), then compiled once ahead of time and fed random token
batches that are already on the device, so the figures leave out the data
pipeline. MFU and HFU use `ultrajax.cost.flops`: FLOPs per token 6N + 12·L·h·s
(PaLM's convention: the whole attention score square) against the data-sheet peak of a
known GPU, or on a CPU a measured matmul rate (labelled as measured). The last column,
MFU causal, halves the attention term (6N + 6·L·h·s), as trainers that count the causal
mask report it; it is last so that readers of the older columns by index
(scripts/bench_gpu.sh) keep working. This is a benchmark, not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import sys
import time

from ultrajax.cost import activations, flops
from ultrajax.train import peaks

# Each size: model shape, sequence length and micro-batch. `cpu` sizes keep a run of the
# defaults under a minute on 2 cores; `gpu` sizes are Llama-style shapes at ~125M, ~350M, ~1B.
SIZES = {
    "tiny": dict(  # configs/tiny.yaml's shape
        vocab_size=384, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=384,
        seq_len=256, micro_batch_size=8,
    ),
    "small": dict(
        vocab_size=384, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=768,
        seq_len=256, micro_batch_size=8,
    ),
    "cpu256": dict(  # the shape of the CPU speed issue (17): torch side by side there
        vocab_size=384, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, d_ff=688,
        seq_len=256, micro_batch_size=16, tie_embeddings=False, scan_unroll=4,
    ),
    "125m": dict(
        vocab_size=32768, d_model=768, n_layers=12, n_heads=12, n_kv_heads=4, d_ff=2048,
        seq_len=2048, micro_batch_size=8,
    ),
    "350m": dict(
        vocab_size=32768, d_model=1024, n_layers=24, n_heads=16, n_kv_heads=8, d_ff=2816,
        seq_len=2048, micro_batch_size=4,
    ),
    "1b": dict(  # Llama 3.2 1B's shape (tied embeddings), shorter sequence; the layers as
        # configs/llama-1b.yaml runs them (a Python loop: scan_layers=False)
        vocab_size=128256, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, d_ff=8192,
        seq_len=2048, micro_batch_size=2, tie_embeddings=True, remat="selective",
        scan_layers=False,
    ),
    "8b-layers": dict(  # Llama 3 8B's layer and vocabulary, 8 of its 32 layers (issue 30)
        vocab_size=128256, d_model=4096, n_layers=8, n_heads=32, n_kv_heads=8, d_ff=14336,
        seq_len=2048, micro_batch_size=2, tie_embeddings=False, remat="selective",
    ),
}  # fmt: skip
DEFAULTS = {"cpu": ("tiny", "small"), "gpu": ("125m", "350m", "1b")}


def size_overrides(name: str, platform: str, user: list[str]) -> list[str]:
    spec = dict(SIZES[name])
    train = {"micro_batch_size": spec.pop("micro_batch_size")}
    # XLA's CPU backend emulates bf16 matmuls (slower than fp32): benchmark CPUs in fp32
    dtype = "float32" if platform == "cpu" else "bfloat16"
    out = [f"model.{k}={v}" for k, v in spec.items()]
    out += [f"model.dtype={dtype}", "model.param_dtype=float32"]
    out += [f"train.{k}={v}" for k, v in train.items()]
    out += ["train.grad_accum=1", "train.steps=1000", "optim.warmup_steps=10"]
    if not any(o.startswith("mesh.") for o in user):
        out.append("mesh.data=-1")  # pure data parallelism over whatever devices exist
    return out + list(user)


def random_batch(cfg, batch_sh, rng, documents: int = 1):
    """A Batch of random tokens, `documents` a row (uneven lengths), on the devices."""
    from ultrajax.parallel.context import token_order
    from ultrajax.train import batch

    m = cfg.model
    packed = batch.random_packed(cfg.global_batch, m.seq_len, m.vocab_size, rng, documents)
    b = batch.make(packed, cfg.data.cross_doc_mask, cfg.train.grad_accum, token_order(cfg))
    return batch.place(b, batch_sh)


def bench(name: str, cfg, steps: int, warmup: int, documents: int = 1) -> dict:
    import jax
    import numpy as np

    from ultrajax.model.llama import param_count
    from ultrajax.train.setup import build_run

    mesh, _, _, state, step_fn, _, batch_sh = build_run(cfg)
    rng = np.random.default_rng(cfg.train.seed)
    with jax.set_mesh(mesh):
        batches = [random_batch(cfg, batch_sh, rng, documents) for _ in range(2)]
        t0 = time.perf_counter()
        pos = np.float32(0)  # the schedule's position, as the train loop passes it
        compiled = step_fn.lower(state, batches[0], pos).compile()
        compile_s = time.perf_counter() - t0
        for i in range(warmup):
            state, out = compiled(state, batches[i % 2], pos)
        jax.block_until_ready(state)
        # a CPU's peak is measured: measure it next to the timed steps, under the same load
        peak, _ = peaks.host_peak(cfg)
        t0 = time.perf_counter()
        for i in range(steps):
            state, out = compiled(state, batches[i % 2], np.float32(warmup + i))
        jax.block_until_ready((state, out))
        step_s = (time.perf_counter() - t0) / steps
    tokens_per_s = cfg.tokens_per_step / step_s
    saved = activations.keeps_residuals(cfg)  # selective runs no attention forward again
    hardware = flops.hardware_flops_per_token(cfg.model, attention_saved=saved)
    return {
        "model": name,
        "params": param_count(cfg.model),
        "tokens_per_step": cfg.tokens_per_step,
        "step_ms": step_s * 1e3,
        "tokens_per_s": tokens_per_s,
        "mfu": tokens_per_s * flops.flops_per_token(cfg.model) / peak,
        "mfu_causal": tokens_per_s * flops.flops_per_token(cfg.model, causal=True) / peak,
        "hfu": tokens_per_s * hardware / peak,
        "peak": peak,
        "compile_s": compile_s,
        "memory": peaks.peak_memory_bytes(),  # GPU: the process's peak so far
        "layout": f"{cfg.train.micro_batch_size}x{cfg.model.seq_len}, dp={cfg.dp},"
        + (f" cp={cfg.mesh.sequence}," if cfg.mesh.sequence > 1 else "")
        + (f" tp={cfg.mesh.tensor}," if cfg.mesh.tensor > 1 else "")
        + f" {cfg.model.dtype}, remat={cfg.model.remat}"
        + ("" if cfg.model.scan_layers else ", layer loop")
        + (f", {documents} docs a row" if documents > 1 else ""),
    }


def _gib(nbytes) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**30:.1f} GiB"


def table(rows: list[dict]) -> str:
    from ultrajax.cost.units import human

    head = "| model | params | batch (mbs x seq, layout) | tokens/step | step ms | tokens/s | peak FLOP/s | MFU | HFU | compile s | peak memory | MFU causal |"  # noqa: E501
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        lines.append(
            f"| {r['model']} | {human(r['params'], 3)} | {r['layout']} | {r['tokens_per_step']:,} |"
            f" {r['step_ms']:.1f} | {r['tokens_per_s']:,.0f} | {human(r['peak'], 3)} |"
            f" {r['mfu']:.1%} | {r['hfu']:.1%} |"
            f" {r['compile_s']:.1f} |"
            f" {_gib(r['memory'])} | {r['mfu_causal']:.1%} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", help=f"comma-separated, from {', '.join(SIZES)} (default by device)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per size (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps after compiling")
    p.add_argument("--cpu-devices", type=int, default=None, metavar="N", help="simulate N CPUs")
    p.add_argument("--docs", type=int, default=1, metavar="N",
                   help="documents a row, of uneven lengths (default 1; the attention sees "
                        "them apart with data.cross_doc_mask=true)")  # fmt: skip
    p.add_argument(
        "--compare-torch",
        action="store_true",
        help="also time transformers' Llama + torch AdamW at each size (scripts/torch_step.py)",
    )
    p.add_argument("overrides", nargs="*", help="config overrides for every size, e.g. a=b")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.docs < 1:
        p.error("--steps and --docs must be >= 1 and --warmup >= 0")

    from ultrajax import cli
    from ultrajax.config.parse import load
    from ultrajax.config.schema import ConfigError
    from ultrajax.train import overlap

    try:  # the GPU overlap flags of parallel.*, as the train command sets them: before the backend
        overlap.apply(load(None, [o for o in args.overrides if o.startswith("parallel.")]).parallel)
    except ConfigError as e:
        cli.fail(str(e))
    cli.setup_devices(args.cpu_devices)  # before anything asks JAX for devices
    import jax

    platform = jax.default_backend()
    names = args.sizes.split(",") if args.sizes else DEFAULTS.get(platform, DEFAULTS["gpu"])
    unknown = [n for n in names if n not in SIZES]
    if unknown:
        p.error(f"unknown size {unknown[0]!r}; choose from {', '.join(SIZES)}")
    try:
        cfgs = [(n, load(None, size_overrides(n, platform, args.overrides))) for n in names]
    except ConfigError as e:
        cli.fail(str(e))

    device = jax.devices()[0]
    kind = getattr(device, "device_kind", platform)
    print(f"device: {jax.device_count()} x {kind} ({platform}), jax {jax.__version__}")
    if platform == "cpu":
        source = "measured: fp32 1024x1024 matmul on this CPU, just before each size's steps"
    else:
        source = peaks.device_peak(device, cfgs[0][1].model)[1] + " x devices"
    print(f"peak: {source}")
    print(f"timing: {args.warmup} warm-up + {args.steps} timed steps per size, random tokens, "
          f"{args.docs} document{'s' if args.docs > 1 else ''} a row")  # fmt: skip
    rows = []
    for name, cfg in cfgs:
        try:
            rows.append(bench(name, cfg, args.steps, args.warmup, args.docs))
        except ConfigError as e:
            cli.fail(f"size {name}: {e}")
        print(f"  {name}: {rows[-1]['step_ms']:.1f} ms/step", file=sys.stderr, flush=True)
    print(table(rows))
    if args.compare_torch:
        import torch_step

        print("\n| model | ultrajax tokens/s | torch tokens/s (eager) | ultrajax / torch |")
        print("|---|---|---|---|")
        for (name, cfg), row in zip(cfgs, rows, strict=True):
            ref = torch_step.tokens_per_s(cfg, args.steps, args.warmup)
            print(
                f"| {name} | {row['tokens_per_s']:,.0f} | {ref['tokens_per_s']:,.0f} "
                f"({ref['threads']} threads, torch {ref['torch']}) |"
                f" {row['tokens_per_s'] / ref['tokens_per_s']:.2f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
