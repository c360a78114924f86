"""XLA flags that overlap gradient communication with compute and bucket it (GPU).

The playbook's DDP lessons, in XLA's words: the latency-hiding scheduler starts a
layer's gradient reduction as soon as the backward pass has produced it, so it
runs while earlier layers are still differentiating (overlap); the combine
thresholds merge small collectives into buckets up to that many bytes, so many
small NCCL calls become a few large ones (bucketing). Flags are read when the
backend starts, so they are set before anything touches a device.
"""

from __future__ import annotations

import os

from ultrajax.config import ParallelConfig

MIB = 2**20


def xla_flags(cfg: ParallelConfig) -> list[str]:
    flags = [f"--xla_gpu_enable_latency_hiding_scheduler={str(cfg.overlap).lower()}"]
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
