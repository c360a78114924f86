"""FLOPs per token, MFU and HFU, device peaks, and the metrics.jsonl writer.

MFU counts the FLOPs the model needs (6N + 12·L·h·s per token: forward 2N,
backward 4N, attention scores and values 4·L·h·s forward); HFU counts what the
hardware actually ran, adding the forward work that activation recomputation
repeats. Both are against the dense bf16 peak of the device.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from ultrajax.config import Config, ModelConfig
from ultrajax.model import matmul_param_count

# Dense (no sparsity) peak FLOP/s per device, from the vendors' data sheets; the first
# name found in the device kind wins, so more specific names come first.
PEAKS = {
    "H200": {"bfloat16": 989e12, "float16": 989e12, "float32": 494.5e12},  # fp32 as TF32
    "H100 PCIe": {"bfloat16": 756e12, "float16": 756e12, "float32": 378e12},  # before "H100"
    "H100": {"bfloat16": 989e12, "float16": 989e12, "float32": 494.5e12},  # SXM
    "A100": {"bfloat16": 312e12, "float16": 312e12, "float32": 156e12},
}


def human(n: float, digits: int = 4) -> str:
    """1234567 -> '1.235M': counts and rates in tables and logs."""
    for unit in ("", "K", "M", "B", "T"):
        if abs(n) < 1000:
            return f"{n:.{digits}g}{unit}"
        n /= 1000
    return f"{n:.{digits}g}P"


def attention_flops_per_token(m: ModelConfig) -> float:
    """Forward QK^T and PV: 2 matmuls x 2 FLOPs x s x (heads x head_dim), per layer."""
    return 4.0 * m.n_layers * m.n_heads * m.hd * m.seq_len


def flops_per_token(m: ModelConfig) -> float:
    """Model FLOPs per trained token: 6N + 12·L·h·s (h = heads x head_dim)."""
    return 6.0 * matmul_param_count(m) + 3.0 * attention_flops_per_token(m)


def recompute_flops_per_token(m: ModelConfig) -> float:
    """Forward FLOPs that the remat policy runs a second time in the backward pass.

    What the backward pass recomputes is what it needs and was not saved (checked
    against the compiled HLO's dots in tests/test_remat.py):
    - the attention scores QK^T: never saved by any policy (half the attention FLOPs);
    - the output projection wo: its output feeds the residual stream that the MLP's
      norm needs, and no policy names that residual, so any remat recomputes it;
    - q, k, v, PV (attn_out) and the MLP's gate and up (mlp_in): unless kept by name;
    - never w_down: its output only enters a residual sum, whose backward needs nothing.
    full keeps no names, selective and offload keep (or offload) all of them.
    """
    if m.remat == "none":
        return 0.0
    h, hd, a, akv, f = m.d_model, m.hd, m.n_heads, m.n_kv_heads, m.d_ff
    attention = attention_flops_per_token(m)
    kept = (
        {
            "full": set(),
            "selective": {"query", "key", "value", "attn_out", "mlp_in", "mlp_out"},
            "offload": {"query", "key", "value", "attn_out", "mlp_in", "mlp_out"},
        }.get(m.remat)
        if isinstance(m.remat, str)
        else set(m.remat)
    )
    per_layer = {
        "query": 2 * h * a * hd,
        "key": 2 * h * akv * hd,
        "value": 2 * h * akv * hd,
        "mlp_in": 4 * h * f,
    }
    redo = sum(v for k, v in per_layer.items() if k not in kept) * m.n_layers
    redo += 2 * a * hd * h * m.n_layers  # wo
    redo += attention / 2 if "attn_out" not in kept else 0.0  # PV
    return redo + attention / 2  # QK^T


def hardware_flops_per_token(m: ModelConfig) -> float:
    return flops_per_token(m) + recompute_flops_per_token(m)


def device_peak(device, dtype: str) -> tuple[float | None, str]:
    """(peak FLOP/s of one device, where the figure comes from) for a known GPU."""
    kind = getattr(device, "device_kind", "")
    for name, peaks in PEAKS.items():
        if name in kind:
            return peaks.get(dtype, peaks["bfloat16"]), f"{name} data sheet, {dtype} dense"
    return None, f"unknown device {kind!r}"


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


def host_peak(cfg: Config) -> tuple[float, str]:
    """Peak FLOP/s for all devices of this run, and the label saying where it came from."""
    devices = jax.devices()
    peak, source = device_peak(devices[0], cfg.model.dtype)
    if peak is not None:
        return peak * len(devices), source
    if devices[0].platform == "cpu":
        # simulated CPU devices share the host's cores: the host's rate is the peak
        rate = measure_matmul_rate()
        return rate, "measured: fp32 1024x1024 matmul on this CPU"
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


class MetricsWriter:
    """Appends one JSON object per logged step to run_dir/metrics.jsonl."""

    def __init__(self, run_dir: str | Path, fresh: bool):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "w" if fresh else "a", buffering=1)

    def write(self, record: dict) -> None:
        self._f.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._f.close()
