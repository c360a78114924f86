"""FLOPs per token, MFU and HFU, device peaks, and the metrics writer (metrics.jsonl,
TensorBoard scalars, and Weights & Biases when WANDB_PROJECT is set).

MFU counts the FLOPs the model needs (6N + 12·L·h·s per token: forward 2N,
backward 4N, attention scores and values 4·L·h·s forward); HFU counts what the
hardware actually ran, adding the forward work that activation recomputation
repeats. Both are against the dense bf16 peak of the device.
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from ultrajax import hardware
from ultrajax.config import Config, ConfigError, ModelConfig
from ultrajax.model import matmul_param_count


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
    acc = hardware.lookup(kind)
    if acc is None:
        return None, f"unknown device {kind!r}"
    return acc.flops(dtype), f"{acc.name} data sheet, {dtype} dense"


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
    peak, source = device_peak(devices[0], cfg.model.dtype)
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


def scalars(record: dict) -> dict[str, float]:
    """The numeric fields of a record as scalar names: eval_* under eval/, the rest under
    train/, a nested dict (memory) one level down. The step is the x axis and the wall
    clock `time` the event's own time: as a float32 scalar it would be off by minutes."""
    out = {}
    for key, value in record.items():
        if key in ("step", "time"):
            continue
        items = value.items() if isinstance(value, dict) else [(None, value)]
        for sub, v in items:
            if isinstance(v, bool) or not isinstance(v, int | float):
                continue
            if key.startswith("eval_"):
                name = f"eval/{key[5:]}"
            else:
                name = f"train/{key}"
            out[name if sub is None else f"{name}/{sub}"] = float(v)
    return out


def _wandb_run(run_dir: Path):
    """A wandb run when WANDB_PROJECT is set and wandb is installed (never required)."""
    project = os.environ.get("WANDB_PROJECT")
    if not project:
        return None
    try:
        import wandb
    except ImportError:
        print(
            "warning: WANDB_PROJECT is set but wandb is not installed; not logging to W&B",
            file=sys.stderr,
        )
        return None
    return wandb.init(project=project, name=run_dir.absolute().name, dir=str(run_dir))


class MetricsWriter:
    """One JSON object per logged step in run_dir/metrics.jsonl, the same numbers as
    TensorBoard scalars in run_dir/tensorboard/, and in W&B when WANDB_PROJECT is set.

    Only process 0 writes (train.py makes the writer there only; the check here keeps
    other hosts from sharing a run directory's event files). A resumed run appends: its
    event file starts with a purge at its first step, so TensorBoard drops what the
    crashed run logged past that point instead of drawing it twice.
    """

    def __init__(self, run_dir: str | Path, fresh: bool):
        run_dir = Path(run_dir)
        self.path = run_dir / "metrics.jsonl"
        self.tb_dir = run_dir / "tensorboard"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "w" if fresh else "a", buffering=1)
        self._fresh = fresh
        self._lead = jax.process_index() == 0
        self._tb = None  # made at the first record, whose step is the purge step
        if self._lead:
            try:  # a base dependency; checked here so a stale install fails before step 1
                from tensorboardX import SummaryWriter
            except ImportError:
                raise ConfigError(
                    "TensorBoard logging needs tensorboardX: pip install -e ."
                ) from None
            self._summary_writer = SummaryWriter
        self._wandb = _wandb_run(run_dir) if self._lead else None
        if fresh and self._lead:  # a fresh run starts a fresh plot, as metrics.jsonl does
            for old in self.tb_dir.glob("events.out.tfevents.*"):
                old.unlink()

    def write(self, record: dict) -> None:
        self._f.write(json.dumps(record) + "\n")
        if not self._lead:
            return
        step, values = int(record["step"]), scalars(record)
        if self._tb is None:
            purge = None if self._fresh else step
            self._tb = self._summary_writer(
                str(self.tb_dir),
                purge_step=purge,
                flush_secs=1,  # its writer thread: a killed run loses about a second
                filename_suffix=f".{os.getpid()}.{time.time_ns()}",  # restarts in one second
            )
        for name, value in values.items():
            self._tb.add_scalar(name, value, step, walltime=record.get("time"))
        if self._wandb is not None:
            self._wandb.log(values, step=step)

    def close(self) -> None:
        self._f.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
