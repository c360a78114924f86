"""How many elements each parameter and activation holds per device, from the
config and the rules table alone (nothing traced but shapes)."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

from ultrajax.config.schema import Config
from ultrajax.cost.units import dtype_bytes
from ultrajax.model import llama
from ultrajax.parallel import mesh as mesh_lib
from ultrajax.parallel.axes import FSDP

# --------------------------------------------------------------------------- sharding


def _ways(cfg: Config, entry, ignore=()) -> int:
    """How many ways a rules-table entry splits a dimension on this mesh."""
    sizes = cfg.mesh.sizes() if hasattr(cfg.mesh, "sizes") else vars(cfg.mesh)
    return math.prod(sizes[a] for a in mesh_lib.entry_axes(entry) if a not in ignore)


def _rules(cfg: Config):
    return mesh_lib.rules(cfg)


def shard_elements(cfg: Config, shape, names, kind: str, ignore=()) -> int:
    """Elements of one device's shard of a parameter under the rules' `kind` column."""
    table = getattr(_rules(cfg), kind)
    return math.prod(
        -(-dim // _ways(cfg, table.get(n), ignore)) for dim, n in zip(shape, names, strict=True)
    )


def param_elements(cfg: Config, kind: str = "stored", ignore=(), where=None) -> int:
    """Parameters held per device under the rules' `kind` column (stored | compute).

    `ignore` leaves mesh axes out (`("fsdp",)`: the size once gathered over fsdp);
    `where(param)` selects rows of the family's table (llama.Param)."""
    m = cfg.model
    return sum(
        shard_elements(cfg, p.shape(m), p.names, kind, ignore)
        for p in llama.params_of(m)
        if where is None or where(p)
    )


def layer_kinds(cfg: Config) -> tuple[tuple[int, Config], ...]:
    """(how many, a config whose every layer is one of them) for each kind of layer: one
    kind, unless model.moe_every interleaves dense layers with MoE ones (model/units.py):
    then the dense ones as a dense model's layers, the MoE ones as an all-MoE model's.
    Per-layer costs are their weighted sum; a layer's working set, the larger kind's."""
    m = cfg.model
    if not m.moe or m.moe_every == 1:
        return ((m.n_layers, cfg),)
    dense, sparse = copy.deepcopy(cfg), copy.deepcopy(cfg)
    dense.model.moe_experts, dense.model.moe_every, sparse.model.moe_every = 0, 1, 1
    moe = m.n_layers // m.moe_every
    return ((m.n_layers - moe, dense), (moe, sparse))


def layer_weight_elements(cfg: Config, ignore=(FSDP,), by: str = "part") -> dict[str, int]:
    """One layer's compute weights per device (as used: gathered over fsdp), by part of
    the model (llama.ATTENTION, MLP, NORM; by="key": by parameter); the largest kind's
    (`layer_kinds`)."""
    kinds = layer_kinds(cfg)
    if len(kinds) > 1:
        each = [layer_weight_elements(k, ignore, by) for _, k in kinds]
        return max(each, key=lambda d: sum(d.values()))
    m = cfg.model
    out = {getattr(p, by): 0 for p in llama.PARAMS if p.layered}
    for p in llama.params_of(m):
        if p.layered:
            n = shard_elements(cfg, p.shape(m)[1:], p.names[1:], "compute", ignore)
            out[getattr(p, by)] += n
    return out


@dataclass(frozen=True)
class Dims:
    """Per-device activation sizes (elements) of one micro-batch."""

    b: int  # micro-batch rows on this device
    s: int  # sequence inside attention and MLP (the TP regions)
    s_res: int  # sequence of the residual stream and norms (s / tensor with SP)
    h: int
    a: int  # query heads on this device
    kv: int
    hd: int
    f: int  # d_ff on this device
    v: int  # vocabulary on this device
    L: int
    c: int  # bytes per element of the compute dtype

    @property
    def X(self) -> int:  # residual stream inside a TP region
        return self.b * self.s * self.h

    @property
    def X_res(self) -> int:
        return self.b * self.s_res * self.h

    @property
    def N(self) -> int:
        return self.b * self.s

    @property
    def N_res(self) -> int:
        return self.b * self.s_res

    @property
    def Q(self) -> int:
        return self.b * self.s * self.a * self.hd

    @property
    def K(self) -> int:
        return self.b * self.s * self.kv * self.hd

    @property
    def S(self) -> int:
        return self.b * self.a * self.s * self.s

    @property
    def F(self) -> int:
        return self.b * self.s * self.f

    @property
    def V(self) -> int:
        return self.b * self.s * self.v


def dims(cfg: Config) -> Dims:
    m, mesh = cfg.model, cfg.mesh
    tp = mesh.tensor
    s = m.seq_len // mesh.sequence
    return Dims(
        b=cfg.train.micro_batch_size,
        s=s,
        s_res=s // tp if cfg.parallel.sequence_parallel else s,
        h=m.d_model,
        a=m.n_heads // tp,
        kv=m.n_kv_heads // tp,
        hd=m.hd,
        f=m.d_ff // tp,
        v=m.vocab_size // tp,
        L=m.n_layers,
        c=dtype_bytes(m.dtype),
    )
