"""The 6-axis device mesh and the one table that maps logical axis names to it.

The model only ever says "this dimension is `heads`" or "`batch`"; which mesh
axes carry that dimension is decided here, from the parallel config. Turning on
a technique (ZeRO-3, TP, SP) therefore changes a row of this table, never the
model code.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from ultrajax.config.schema import Config, ConfigError
from ultrajax.parallel.axes import AXES, DATA_AXES, EXPERT, FSDP, PIPELINE, SEQUENCE, TENSOR
from ultrajax.parallel.zero import Zero

# Logical names used by the model. Parameters and activations share the names;
# the table gives each a parameter column and an activation column, because the
# same `embed` dimension is sharded over fsdp in ZeRO-3 weights but must stay
# whole in activations (whose batch is already split over fsdp).
LOGICAL_NAMES = (
    "batch",
    "length",  # sequence inside attention / MLP (TP regions)
    "norm_length",  # sequence in the residual stream and norms (SP shards it)
    "embed",
    "heads",
    "kv_heads",
    "head_dim",
    "mlp",
    "vocab",
    "layers",
    "experts",  # an MoE layer's experts (their weights)
    "scores",  # the router's output: a score per expert, for every token
    "moe_mlp",  # an expert's hidden size
    "shared_mlp",  # the shared experts' hidden size
)


def make_mesh(cfg: Config, devices=None) -> jax.sharding.Mesh:
    """Build the mesh in AXES order with Auto axes (constraints are hints, not asserts).

    With any `mesh.dcn.*` factor > 1 the mesh is hybrid: those factors of data, fsdp
    and pipeline span hosts (the slow DCN links), everything else stays inside one."""
    sizes = tuple(getattr(cfg.mesh, a) for a in AXES)
    devices = jax.devices() if devices is None else devices
    held = collections.Counter(d.process_index for d in devices)
    if len(set(held.values())) > 1:  # the checkpoint writer's reshape failed on it later
        by = ", ".join(f"process {p}: {n}" for p, n in sorted(held.items()))
        raise ConfigError(
            f"the processes hold different numbers of devices ({by}): give every process the "
            "same (--cpu-devices N, or the same GPUs per host)"
        )
    types = (AxisType.Auto,) * len(AXES)
    dcn = dcn_shape(cfg)
    if all(f == 1 for f in dcn):
        return jax.make_mesh(sizes, AXES, axis_types=types, devices=devices)
    return jax.sharding.Mesh(hybrid_devices(cfg, devices), AXES, axis_types=types)


def dcn_shape(cfg: Config) -> tuple[int, ...]:
    """The factor of each mesh axis that spans hosts (sequence and tensor never do)."""
    return tuple(getattr(cfg.mesh.dcn, a, 1) for a in AXES)


def hybrid_devices(cfg: Config, devices):
    """Devices as an array of the mesh's shape: per host (process, or TPU slice) an ICI
    mesh of sizes / dcn, and the hosts arranged in the dcn shape around them."""

    sizes, dcn = tuple(getattr(cfg.mesh, a) for a in AXES), dcn_shape(cfg)
    ici = tuple(s // f for s, f in zip(sizes, dcn, strict=True))
    slices = {getattr(d, "slice_index", None) for d in devices}
    by_process = len(slices) <= 1 or None in slices  # GPU / CPU hosts: a process each
    key = "process_index" if by_process else "slice_index"
    hosts: dict = {}
    for d in devices:
        hosts.setdefault(getattr(d, key), []).append(d)
    factors = " x ".join(f"{a}={f}" for a, f in zip(AXES, dcn, strict=True) if f > 1)
    n_dcn = math.prod(dcn)
    if n_dcn != len(hosts):
        raise ConfigError(
            f"mesh.dcn ({factors}) spans {n_dcn} hosts, but the run has {len(hosts)} "
            f"{'process' if by_process else 'slice'}(es); make the mesh.dcn factors multiply "
            f"to {len(hosts)}"
        )
    per_host = {len(v) for v in hosts.values()}
    if per_host != {math.prod(ici)}:
        inner = " x ".join(f"{a}={f}" for a, f in zip(AXES, ici, strict=True) if f > 1) or "1"
        raise ConfigError(
            f"inside each host the mesh is {inner} ({math.prod(ici)} devices: the mesh sizes "
            f"divided by mesh.dcn), but hosts have {sorted(per_host)} devices"
        )
    return mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, process_is_granule=by_process)


def describe_hosts(mesh) -> str:
    """Which axes cross host boundaries, read off the mesh itself: for each axis, the
    number of processes met walking along it."""
    procs = np.vectorize(lambda d: d.process_index)(mesh.devices)
    n_proc = len(np.unique(procs))
    span = {}
    for i, a in enumerate(mesh.axis_names):
        moved = np.moveaxis(procs, i, -1).reshape(-1, procs.shape[i])
        span[a] = max(len(np.unique(row)) for row in moved)
    across = [f"{a}={span[a]}" for a in mesh.axis_names if span[a] > 1]
    inside = [
        f"{a}={mesh.shape[a] // span[a]}" for a in mesh.axis_names if mesh.shape[a] // span[a] > 1
    ]
    per = mesh.size // n_proc
    return (
        f"hosts: {n_proc} process(es) x {per} device{'s' * (per != 1)}; across hosts (DCN): "
        f"{' x '.join(across) or 'none'}; inside a host: {' x '.join(inside) or 'none'}"
    )


@dataclass(frozen=True)
class Rules:
    """Logical name -> mesh axes, for parameters (as stored and as computed) and activations."""

    stored: dict  # optimizer state and master weights (ZeRO >= 1 shards them over fsdp)
    compute: dict  # the compute-dtype weights the forward pass reads (ZeRO-3 keeps fsdp)
    activation: dict

    def spec(self, names, kind: str = "activation") -> PartitionSpec:
        table = getattr(self, kind)
        return PartitionSpec(*(table.get(n) if n is not None else None for n in names))

    def inside(self, manual) -> Rules:
        """Rules for code inside a shard_map manual over `manual` (the data axes, and
        `sequence` under context parallelism): activations name only the other axes."""
        activation = {
            k: v if v is None else only_axes(PartitionSpec(v), manual_free(manual))[0]
            for k, v in self.activation.items()
        }
        return Rules(stored=self.stored, compute=self.compute, activation=activation)

    def table(self) -> list[tuple[str, str, str, str]]:
        fmt = lambda v: "-" if v is None else (v if isinstance(v, str) else "x".join(v))  # noqa: E731
        return [
            (n, fmt(self.stored.get(n)), fmt(self.compute.get(n)), fmt(self.activation.get(n)))
            for n in LOGICAL_NAMES
        ]


def rules(cfg: Config) -> Rules:
    """The rules table for this run's parallel config (printed at start; docs/parallelism.md)."""
    zero, sp = Zero(cfg.parallel.zero), cfg.parallel.sequence_parallel
    weights = {
        "vocab": TENSOR,
        "heads": TENSOR,
        "kv_heads": TENSOR,
        "mlp": TENSOR,
        "moe_mlp": TENSOR,
        "shared_mlp": TENSOR,
        "experts": EXPERT,  # expert parallelism: each rank holds its share of the experts
        "scores": None,
        "embed": None,
        "head_dim": None,
        "layers": PIPELINE if cfg.mesh.pipeline > 1 else None,  # a stage: a slice of them
    }
    stored = dict(weights, embed=FSDP if zero.shards_state else None)
    if vocab_over_pipeline(cfg):
        stored["vocab"] = (TENSOR, PIPELINE)
    compute = dict(weights, embed=FSDP if zero.shards_params else None)
    activation = {
        "batch": DATA_AXES,
        "length": SEQUENCE,
        "norm_length": (SEQUENCE, TENSOR) if sp else SEQUENCE,
        "embed": None,
        "heads": TENSOR,
        "kv_heads": TENSOR,
        "head_dim": None,
        "mlp": TENSOR,
        "vocab": TENSOR,
    }
    return Rules(stored=stored, compute=compute, activation=activation)


def vocab_over_pipeline(cfg: Config) -> bool:
    """Whether the stored embedding and LM head (masters, Adam state) are split over
    `pipeline` along `vocab` as well as over `tensor`: tensor major, so a tensor rank's
    pipeline shards gathered give its compute block. Only the first and last stage use
    those tables, so no stage keeps them whole; the compute copy is gathered once a step
    (parallel/layout.py) and the gradients reduce-scattered back (pipeline/executor.py).
    A vocabulary that tensor x pipeline does not divide stays replicated over `pipeline`."""
    p = cfg.mesh.pipeline
    return p > 1 and cfg.model.vocab_size % (cfg.mesh.tensor * p) == 0


def manual_free(manual) -> tuple[str, ...]:
    """The mesh axes left to the partitioner inside a shard_map manual over `manual`."""
    return tuple(a for a in AXES if a not in manual)


def entry_axes(entry) -> tuple[str, ...]:
    """The mesh axes one entry of a PartitionSpec names (None, one axis, or several)."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def only_axes(spec: PartitionSpec, axes) -> PartitionSpec:
    """The part of a spec over the given mesh axes (shard_map's in/out specs name only
    its manual axes; the others stay with the partitioner)."""

    def keep(entry):
        kept = tuple(a for a in entry_axes(entry) if a in axes)
        return None if not kept else kept[0] if len(kept) == 1 else kept

    return PartitionSpec(*(keep(e) for e in spec))


def tree_shardings(mesh, logical_tree, rules_: Rules, kind: str):
    """NamedShardings for a tree of logical-name tuples."""
    return jax.tree.map(
        lambda names: NamedSharding(mesh, rules_.spec(names, kind)),
        logical_tree,
        is_leaf=lambda x: isinstance(x, tuple),
    )


def describe(mesh, rules_: Rules) -> str:
    sizes = " x ".join(f"{a}={mesh.shape[a]}" for a in AXES)
    n = mesh.size
    lines = [f"mesh: {sizes} ({n} device{'s' * (n != 1)}, {jax.default_backend()})"]
    lines.append(f"  {'logical':<12} {'stored':<14} {'compute':<14} {'activation'}")
    for row in rules_.table():
        lines.append(f"  {row[0]:<12} {row[1]:<14} {row[2]:<14} {row[3]}")
    return "\n".join(lines)
