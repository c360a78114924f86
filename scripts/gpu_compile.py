"""Compile the GPU's train step on this host, no GPU needed, and print what it holds and
moves: XLA's memory_analysis beside the memory model, and the kernels' bytes and matmul
FLOPs (ultrajax/tools/roofline.py).

    python scripts/gpu_compile.py                                  # 1B step, H200
    python scripts/gpu_compile.py --gpu h100 model.remat=full      # overrides as bench_step's
    python scripts/gpu_compile.py --hlo /tmp/step.hlo --top 30
    python scripts/gpu_compile.py --config configs/llama-8b.yaml --gpu h100 --devices 8

XLA compiles for the card described in a target config (deviceless AOT compilation,
jax.experimental.topologies); the step is bench_step.py's (its --size, micro-batch 8 by
default, random tokens' shapes), traced as on a GPU (analyze.traced_as_gpu: cuDNN or the
Triton kernels, as model.attention asks). Nothing runs, so nothing here is a timing: the
bound column is bytes / the card's HBM bandwidth and FLOPs / its dense peak, what no
kernel beats. Without a card XLA autotunes nothing: its matmuls are Triton's defaults
where a GPU may pick cuBLAS, and their fusions may differ from a GPU's; the memory-bound
kernels and the buffers are the GPU compiler's own.

Needs jax's CUDA plugin beside the jax in use, in a separate environment (about 5 GB;
never a dependency of the project):

    python -m venv --system-site-packages /tmp/gpu-aot
    v=$(python -c 'import jax; print(jax.__version__)')
    /tmp/gpu-aot/bin/pip install "jax-cuda12-plugin[with-cuda]==$v"
    /tmp/gpu-aot/bin/python scripts/gpu_compile.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

# Hopper's SM count and limits (H100 SXM and H200 alike); bandwidth and memory per card
TARGET = """gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132
  fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: {bandwidth} l2_cache_size: 52428800
  clock_rate_ghz: 1.98 device_memory_size: {memory} shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: 9 minor: 0 }}
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 10 }}
runtime_version {{ major: 12 minor: 9 }}
device_description_str: "NVIDIA {name}"
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gpu", choices=("h100", "h200"), default="h200")
    p.add_argument("--size", default="1b", help="a bench_step.py size (default 1b)")
    p.add_argument("--config", help="a config file instead (its own batch and layout)")
    p.add_argument("--devices", type=int, default=1, help="GPUs of one host (mesh: overrides)")
    p.add_argument("--memory", type=float, metavar="GIB",
                   help="device memory XLA may plan for (default the card's): its scheduler "
                        "spends room it is given on overlapping collectives")  # fmt: skip
    p.add_argument("--hlo", help="write the compiled module's text here")
    p.add_argument("--top", type=int, default=15, help="memory-bound kernels listed")
    p.add_argument("--record", metavar="JSON",
                   help="append this step's compiled memory to this file "
                        "(tests/data/*_compiled.json: the memory model's GPU checks)")  # fmt: skip
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. model.remat=full")
    args = p.parse_args(argv)
    # a CPU host: no CUDA driver to check, and jax's default backend stays the CPU
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    import bench_step

    from ultrajax import cli
    from ultrajax.config.schema import ConfigError
    from ultrajax.cost import hardware, memory
    from ultrajax.train import overlap

    if args.size not in bench_step.SIZES:
        p.error(f"unknown size {args.size!r}; choose from {', '.join(bench_step.SIZES)}")
    try:
        cfg = step_config(args.size, args.config, args.overrides)
        overlap.apply(cfg.parallel)  # the GPU flags the train command sets, before jax starts
    except ConfigError as e:
        cli.fail(str(e))

    import jax
    from jax.experimental import topologies

    from ultrajax.config.validate import resolve_mesh
    from ultrajax.parallel.layout import unsupported
    from ultrajax.tools import analyze, roofline

    card = hardware.by_name(args.gpu)
    memory_bytes = int(args.memory * 2**30) if args.memory else card.memory
    target = TARGET.format(bandwidth=int(card.hbm_bw), memory=memory_bytes, name=args.gpu.upper())
    try:
        topology = topologies.get_topology_desc(
            platform="cuda", target_config=target, topology=f"1x1x{args.devices}"
        )
    except Exception as e:  # noqa: BLE001  the plugin missing, or jax's API moved
        cli.fail(f"no CUDA topology ({type(e).__name__}: {e}); this needs jax's CUDA plugin "
                 "installed beside jax: see this script's docstring")  # fmt: skip
    try:
        resolve_mesh(cfg, args.devices)
    except ConfigError as e:
        cli.fail(str(e))
    if unsupported(cfg, "gpu"):  # what the train command refuses on a GPU
        cli.fail(unsupported(cfg, "gpu"))
    t0 = time.perf_counter()
    with analyze.traced_as_gpu(cudnn=True):
        compiled = analyze.lower_step(cfg, topology.devices).compile()
    text = compiled.as_text()
    if args.hlo:
        Path(args.hlo).write_text(text)
    mem = analyze.compiled_memory(compiled)
    predicted = memory.estimate(cfg, "gpu").peak
    gib = 2**30
    name = args.config or args.size
    print(f"{name} step for one {args.gpu.upper()} of {args.devices} (deviceless, "
          f"jax {jax.__version__}), compiled in {time.perf_counter() - t0:.0f} s: "
          f"{cfg.model.remat} recomputation, attention {cfg.model.attention}, "
          f"micro-batch {cfg.train.micro_batch_size} x {cfg.model.seq_len}, "
          f"grad_accum {cfg.train.grad_accum}")  # fmt: skip
    print(f"memory: peak {mem['peak'] / gib:.2f} GiB (arguments {mem['argument'] / gib:.2f},"
          f" temporaries {mem['temp'] / gib:.2f}); the memory model: {predicted / gib:.2f}"
          f" GiB\n")  # fmt: skip
    rate = card.flops(cfg.model.dtype)
    print(f"bound: {card.hbm_bw / 1e12:.2f} TB/s, {rate / 1e12:.0f} TFLOP/s ({card.name}'s "
          "data sheet)\n")  # fmt: skip
    print(roofline.summary(roofline.kernels(text), card.hbm_bw, rate, args.top))
    if args.record:
        keys = ("gpu", "size", "config", "devices", "memory", "overrides")
        step = {k: getattr(args, k) for k in keys}
        step.update(argument=mem["argument"], peak=mem["peak"], jax=jax.__version__,
                    date=time.strftime("%Y-%m-%d"))  # fmt: skip
        path = Path(args.record)
        data = json.loads(path.read_text()) if path.exists() else {"steps": []}
        data["steps"].append(step)
        path.write_text(json.dumps(data, indent=1) + "\n")
    return 0


def step_config(size: str, config: str | None, overrides: list[str]):
    """The step's config: a bench_step.py size (micro-batch 8, no cross-document mask,
    then `overrides`) or a config file with `overrides`, mesh unresolved."""
    import bench_step

    from ultrajax.config.parse import load

    if config:
        return load(config, list(overrides))
    given = ["train.micro_batch_size=8", "data.cross_doc_mask=false", *overrides]
    return load(None, bench_step.size_overrides(size, "gpu", given))


if __name__ == "__main__":
    sys.exit(main())
