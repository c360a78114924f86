"""The 5-axis device mesh and the one table that maps logical axis names to it.

The model only ever says "this dimension is `heads`" or "`batch`"; which mesh
axes carry that dimension is decided here, from the parallel config. Turning on
a technique (ZeRO-3, TP, SP) therefore changes a row of this table, never the
model code.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from ultrajax.config import Config

AXES = ("data", "fsdp", "pipeline", "sequence", "tensor")  # slowest to fastest links

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
)


def make_mesh(cfg: Config, devices=None) -> jax.sharding.Mesh:
    """Build the mesh in AXES order with Auto axes (constraints are hints, not asserts)."""
    sizes = tuple(getattr(cfg.mesh, a) for a in AXES)
    devices = jax.devices() if devices is None else devices
    return jax.make_mesh(sizes, AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=devices)


@dataclass(frozen=True)
class Rules:
    """Logical name -> mesh axes, for parameters (as stored and as computed) and activations."""

    stored: dict  # optimizer state and master weights (ZeRO >= 1 shards them over fsdp)
    compute: dict  # the compute-dtype weights the forward pass reads (ZeRO-3 keeps fsdp)
    activation: dict

    def spec(self, names, kind: str = "activation") -> PartitionSpec:
        table = getattr(self, kind)
        return PartitionSpec(*(table.get(n) if n is not None else None for n in names))

    def constrain(self, x, *names):
        """Sharding hint for an activation; a no-op outside a mesh context."""
        if jax.sharding.get_abstract_mesh().empty:
            return x
        return jax.lax.with_sharding_constraint(x, self.spec(names))

    def inside_batch_shard_map(self) -> Rules:
        """Rules for code running per data-parallel shard (batch axes are manual there)."""
        activation = dict(self.activation, batch=None)
        return Rules(stored=self.stored, compute=self.compute, activation=activation)

    def table(self) -> list[tuple[str, str, str, str]]:
        fmt = lambda v: "-" if v is None else (v if isinstance(v, str) else "x".join(v))  # noqa: E731
        return [
            (n, fmt(self.stored.get(n)), fmt(self.compute.get(n)), fmt(self.activation.get(n)))
            for n in LOGICAL_NAMES
        ]


def rules(cfg: Config) -> Rules:
    """The rules table for this run's parallel config (GUIDE section 3)."""
    zero, sp = cfg.parallel.zero, cfg.parallel.sequence_parallel
    weights = {
        "vocab": "tensor",
        "heads": "tensor",
        "kv_heads": "tensor",
        "mlp": "tensor",
        "embed": None,
        "head_dim": None,
        "layers": None,
    }
    stored = dict(weights, embed="fsdp" if zero >= 1 else None)
    compute = dict(weights, embed="fsdp" if zero >= 3 else None)
    activation = {
        "batch": ("data", "fsdp"),
        "length": "sequence",
        "norm_length": ("sequence", "tensor") if sp else "sequence",
        "embed": None,
        "heads": "tensor",
        "kv_heads": "tensor",
        "head_dim": None,
        "mlp": "tensor",
        "vocab": "tensor",
    }
    return Rules(stored=stored, compute=compute, activation=activation)


def only_axes(spec: PartitionSpec, axes) -> PartitionSpec:
    """The part of a spec over the given mesh axes (shard_map's in/out specs name only
    its manual axes; the others stay with the partitioner)."""

    def keep(entry):
        if entry is None:
            return None
        entry = (entry,) if isinstance(entry, str) else tuple(entry)
        kept = tuple(a for a in entry if a in axes)
        return None if not kept else kept[0] if len(kept) == 1 else kept

    return PartitionSpec(*(keep(e) for e in spec))


def tree_shardings(mesh, logical_tree, rules_: Rules, kind: str):
    """NamedShardings for a tree of logical-name tuples."""
    return jax.tree.map(
        lambda names: NamedSharding(mesh, rules_.spec(names, kind)),
        logical_tree,
        is_leaf=lambda x: isinstance(x, tuple),
    )


def batch_sharding(mesh) -> NamedSharding:
    """Batches arrive as (grad_accum, batch, length): split the batch over data x fsdp."""
    return NamedSharding(mesh, PartitionSpec(None, ("data", "fsdp"), None))


def describe(mesh, rules_: Rules) -> str:
    sizes = " x ".join(f"{a}={mesh.shape[a]}" for a in AXES)
    lines = [f"mesh: {sizes} ({mesh.size} devices, {jax.default_backend()})"]
    lines.append(f"  {'logical':<12} {'stored':<14} {'compute':<14} {'activation'}")
    for row in rules_.table():
        lines.append(f"  {row[0]:<12} {row[1]:<14} {row[2]:<14} {row[3]}")
    return "\n".join(lines)
