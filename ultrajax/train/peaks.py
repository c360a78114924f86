"""The peak FLOP/s that MFU divides by: the accelerator table's, or this CPU's
matmul rate, measured once and cached."""

from __future__ import annotations

import json
import math
import os
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from ultrajax.config.schema import Config, ModelConfig
from ultrajax.cost import flops, hardware


def device_peak(device, model: ModelConfig) -> tuple[float | None, str]:
    """(peak FLOP/s of one device for this model, where the figure comes from) for a
    known GPU: its dtype's, blended with the FP8 peak under model.fp8 (flops.model_peak)."""
    kind = getattr(device, "device_kind", "")
    acc = hardware.lookup(kind)
    if acc is None:
        return None, f"unknown device {kind!r}"
    source = f"{acc.name} data sheet, {model.dtype} dense"
    if model.fp8 != "none":
        share = flops.fp8_flops_per_token(model) / flops.flops_per_token(model)
        source += f", float8 for the FP8 matmuls' {share:.0%} of the FLOPs"
    return flops.model_peak(model, acc.flops), source


def measure_matmul_rate(n: int = 1024, repeats: int = 5, dtype=jnp.float32) -> float:
    """FLOP/s of one n x n matmul on the default device (the CPU peak we measure)."""
    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2.0 * n**3 / best


def cpu_peak_cache() -> Path:
    """Where the measured CPU peak is kept: $XDG_CACHE_HOME/ultrajax, else ~/.cache/ultrajax."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "ultrajax" / "cpu_peak.json"


def cpu_key() -> str:
    """The machine a CPU peak belongs to: CPU model and the cores this process may use."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{model} | {cores} cores | fp32 1024x1024 matmul"


def cached_cpu_peak(tries: int = 3) -> tuple[float, str]:
    """The CPU's matmul rate, measured once per machine (the best of `tries` measurements)
    and cached: a shared machine's rate varies run to run, and MFU must be comparable."""
    path, key = cpu_peak_cache(), cpu_key()
    what = "fp32 1024x1024 matmul on this CPU"
    cached = f"{what}, measured once and cached in {path} (delete it to re-measure)"
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        table = {}
    table = table if isinstance(table, dict) else {}
    try:
        rate = float(table[key]["flops"])
        if rate > 0 and math.isfinite(rate):
            return rate, cached
    except (KeyError, TypeError, ValueError):
        pass
    rate = max(measure_matmul_rate() for _ in range(tries))
    table[key] = {"flops": rate, "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(table, indent=2) + "\n")
        os.replace(tmp, path)  # atomic: runs starting together never read half a file
    except OSError as e:
        tmp.unlink(missing_ok=True)
        return rate, f"{what}, best of {tries}, not cached ({e})"
    return rate, cached


def host_peak(cfg: Config) -> tuple[float, str]:
    """Peak FLOP/s for all devices of this run, and the label saying where it came from."""
    devices = jax.devices()
    peak, source = device_peak(devices[0], cfg.model)
    if peak is not None:
        return peak * len(devices), source
    if devices[0].platform == "cpu":
        # simulated CPU devices share the host's cores: the host's rate is the peak
        return cached_cpu_peak()
    return float("nan"), source


def peak_memory_bytes() -> int | None:
    """Largest device peak reported by the backend (GPU/TPU), None where unreported."""
    peaks = []
    for d in jax.local_devices():
        try:
            stats = d.memory_stats()
        except Exception:  # CPU backends may raise or return None
            stats = None
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(stats["peak_bytes_in_use"])
    return max(peaks) if peaks else None
