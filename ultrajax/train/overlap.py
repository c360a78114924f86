"""XLA flags that overlap gradient communication with compute and bucket it (GPU).

The playbook's DDP lessons, in XLA's words: the latency-hiding scheduler starts a
layer's gradient reduction as soon as the backward pass has produced it, so it
runs while earlier layers are still differentiating (overlap); the combine
thresholds merge small collectives into buckets up to that many bytes, so many
small NCCL calls become a few large ones (bucketing). The layer gradients are
reduced inside the backward layer loop (ultrajax/model/ops.py); with
`parallel.pipeline_collectives` XLA's collective pipeliner moves a loop
iteration's all-gather (ZeRO-3 weights) or reduction one iteration earlier or
later, so it overlaps the neighbouring layer's compute instead of only its own.
Flags are read when the backend starts, so they are set before anything touches a
device.
"""

from __future__ import annotations

import os

from ultrajax.config.schema import ParallelConfig

MIB = 2**20


PIPELINED = (  # collectives XLA may start one loop iteration early (the layer scans)
    "--xla_gpu_enable_pipelined_all_gather",
    "--xla_gpu_enable_pipelined_reduce_scatter",
    "--xla_gpu_enable_pipelined_all_reduce",
    "--xla_gpu_enable_while_loop_double_buffering",
)


def xla_flags(cfg: ParallelConfig) -> list[str]:
    flags = [f"--xla_gpu_enable_latency_hiding_scheduler={str(cfg.overlap).lower()}"]
    flags += [f"{flag}={str(cfg.pipeline_collectives).lower()}" for flag in PIPELINED]
    for kind, mib in (
        ("all_reduce", cfg.all_reduce_bucket_mib),
        ("all_gather", cfg.all_gather_bucket_mib),
        ("reduce_scatter", cfg.reduce_scatter_bucket_mib),
    ):
        flags.append(f"--xla_gpu_{kind}_combine_threshold_bytes={mib * MIB}")
    return flags


def apply(cfg: ParallelConfig, environ=os.environ) -> str:
    """Add our flags to XLA_FLAGS; a flag the user already set there wins."""
    current = environ.get("XLA_FLAGS", "")
    have = {f.split("=", 1)[0] for f in current.split()}
    extra = [f for f in xla_flags(cfg) if f.split("=", 1)[0] not in have]
    environ["XLA_FLAGS"] = " ".join([current, *extra]).strip()
    return environ["XLA_FLAGS"]
