"""The accelerators we know, in one table: peak FLOP/s, memory, links.

MFU (train/peaks.py), the memory verdict (cost/memory.py, tools/analyze.py) and the layout planner
(tools/plan.py) all ask this table; nothing else holds a hardware figure.

Figures are the vendors' data sheets (dense, no sparsity) and nvidia-smi's memory
totals. Link bandwidths are bytes/s per GPU in one direction: NVLink's aggregate
figure halved (H100/H200 900 GB/s both ways, A100 600 GB/s), and the inter-node
fabric of the usual 8-GPU node (one 400 Gb/s NIC per H100/H200, one 200 Gb/s HDR NIC
per A100). Latencies are the per-hop start-up cost of a ring step, the order NCCL's
tests show (a few microseconds inside a node, ~10-20 across). What a collective
actually reaches is below these peaks; the planner's step-time model (cost/steptime.py)
carries that as fitted efficiencies, not this table. hbm_bw is the data sheet's
device-memory bandwidth (the optimizer update is bound by it).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

GB = 10**9
MiB = 2**20


@dataclass(frozen=True)
class Accelerator:
    name: str  # short name: the planner's --gpu
    kinds: tuple[str, ...]  # substrings of jax's device_kind that mean this device
    peak: MappingProxyType  # dtype name -> dense FLOP/s
    memory: int  # bytes of device memory
    intra_bw: float  # bytes/s per GPU, one direction, inside a node (NVLink)
    inter_bw: float  # bytes/s per GPU, one direction, between nodes
    intra_latency: float  # seconds per ring step inside a node
    inter_latency: float  # seconds per ring step between nodes
    gpus_per_node: int = 8
    hbm_bw: float = 0.0  # bytes/s of device memory (the optimizer update is bound by it)

    def flops(self, dtype: str) -> float:
        """Peak dense FLOP/s for a compute dtype (bf16's where the dtype is not listed)."""
        return self.peak.get(dtype, self.peak["bfloat16"])


def _peaks(bf16: float, fp32: float, fp8: float | None = None) -> MappingProxyType:
    table = {"bfloat16": bf16, "float16": bf16, "float32": fp32}  # fp32 as TF32
    if fp8:
        table["float8_e4m3fn"] = table["float8_e5m2"] = fp8
    return MappingProxyType(table)


# More specific kinds first: the first accelerator whose kind is found in a device's
# device_kind wins ("H100 PCIe" before "H100", the 40 GB A100 after the 80 GB one).
ACCELERATORS: tuple[Accelerator, ...] = (
    Accelerator(
        "h200", ("H200",), _peaks(989e12, 494.5e12, 1979e12), 143771 * MiB,
        450 * GB, 50 * GB, 5e-6, 15e-6, hbm_bw=4800 * GB,
    ),
    Accelerator(
        "h100-pcie", ("H100 PCIe",), _peaks(756e12, 378e12, 1513e12), 81559 * MiB,
        32 * GB, 25 * GB, 10e-6, 15e-6, hbm_bw=2000 * GB,
    ),
    Accelerator(
        "h100", ("H100",), _peaks(989e12, 494.5e12, 1979e12), 81559 * MiB,
        450 * GB, 50 * GB, 5e-6, 15e-6, hbm_bw=3350 * GB,
    ),
    Accelerator(
        "a100", ("A100-SXM4-80GB", "A100 80GB"), _peaks(312e12, 156e12), 81920 * MiB,
        300 * GB, 25 * GB, 5e-6, 15e-6, hbm_bw=2039 * GB,
    ),
    Accelerator(
        "a100-40gb", ("A100",), _peaks(312e12, 156e12), 40960 * MiB,
        300 * GB, 25 * GB, 5e-6, 15e-6, hbm_bw=1555 * GB,
    ),
)  # fmt: skip

NAMES = tuple(a.name for a in ACCELERATORS)


def by_name(name: str) -> Accelerator:
    """The accelerator called `name` (h100, h200, a100, ...); KeyError names the choices."""
    for a in ACCELERATORS:
        if a.name == name.lower():
            return a
    raise KeyError(f"unknown GPU {name!r}: choose one of {', '.join(NAMES)}")


def lookup(device_kind: str) -> Accelerator | None:
    """The accelerator a jax device_kind string names, or None (CPU, TPU, unknown GPU)."""
    for a in ACCELERATORS:
        if any(k in device_kind for k in a.kinds):
            return a
    return None


def device_memory(device) -> tuple[int | None, str]:
    """(bytes of one device's memory, where the figure comes from), None where unknown."""
    try:
        stats = device.memory_stats() or {}
    except Exception:  # CPU backends may raise
        stats = {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), f"{device.device_kind}: memory_stats bytes_limit"
    kind = getattr(device, "device_kind", "")
    acc = lookup(kind)
    if acc is not None:
        return acc.memory, f"{kind} (nvidia-smi total)"
    return None, f"{kind or device.platform}: no device memory to compare against"
