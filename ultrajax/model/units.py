"""Dense and MoE layers interleaved (model.moe_every = m > 1): the layer stack walked in
units of m layers, the last of each an MoE layer (Qwen-MoE's decoder_sparse_step).

Each parameter is stacked over the layers that have it (`llama.Param.rows`): attention
and norms over all L layers, the dense MLP over the L - L/m dense ones, router and
experts over the L/m MoE ones. A scan needs every iteration to see the same shapes, so
the layer scan, a pipeline chunk and the KV cache step through units: `view` shows each
stacked leaf as (units, its rows per unit, ...) and `layers` cuts one unit into its m
layers' weights, applied in turn (`scan`), each under its own remat checkpoint. Stacks
stay in the model's layer order everywhere else (checkpoints, the optimizer, a pipeline
stage's slice: L/m units split like L layers). With m = 1 (every dense model, an MoE
layer everywhere) a unit is a layer and all of this is the identity.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from ultrajax.config.schema import ModelConfig
from ultrajax.model import llama, prefetch
from ultrajax.model.prefetch import Prefetch
from ultrajax.model.remat import layers_per_iteration

LAYERED = {p.key: p for p in llama.PARAMS if p.layered}
_DROP = object()


def size(cfg: ModelConfig) -> int:
    """Layers per unit: model.moe_every for an MoE model, else 1."""
    return cfg.moe_every if cfg.moe else 1


def count(cfg: ModelConfig) -> int:
    """Units in the stack (the layer scan's length)."""
    return cfg.n_layers // size(cfg)


def _walk(tree, fn):
    """`tree` (nested dicts) with each layered parameter's subtree `v` (found by its key,
    at any depth: a stack, or the step's {"w", "sink", "acc"}) replaced by fn(param, v),
    or left out where fn returns _DROP."""
    if not isinstance(tree, dict):
        return tree
    out = {}
    for k, v in tree.items():
        if k in LAYERED:
            v = fn(LAYERED[k], v)
            if v is not _DROP:
                out[k] = v
        else:
            out[k] = _walk(v, fn)
    return out


def view(cfg: ModelConfig, tree, axis: int = 0):
    """Each stacked leaf's `axis` (its layers, model order) as (units, rows per unit)."""
    if size(cfg) == 1:
        return tree
    n = count(cfg)

    def one(p, v):
        c = p.rows(cfg) // n  # any slice of whole units: a stage's, a chunk's
        return jax.tree.map(lambda a: a.reshape(*a.shape[:axis], -1, c, *a.shape[axis + 1 :]), v)

    return _walk(tree, one)


def merge(cfg: ModelConfig, tree, axis: int = 0):
    """`view`'s inverse: (units, rows per unit) at `axis` back to the layers."""
    if size(cfg) == 1:
        return tree

    def one(p, v):
        return jax.tree.map(lambda a: a.reshape(*a.shape[:axis], -1, *a.shape[axis + 2 :]), v)

    return _walk(tree, one)


def layers(cfg: ModelConfig, unit) -> list:
    """One unit's slice of the stacks (rows per unit leading) -> its m layers' weights:
    layer j reads its attention and norms, the dense layers (j < m - 1) their MLP row,
    the last its router and experts. m = 1: [unit]."""
    m = size(cfg)
    if m == 1:
        return [unit]

    def pick(j):
        def one(p, v):
            if p.when == llama.DENSE:
                return _DROP if j == m - 1 else jax.tree.map(lambda a: a[j], v)
            if p.when in (llama.MOE, llama.SHARED):
                return jax.tree.map(lambda a: a[0], v) if j == m - 1 else _DROP
            return jax.tree.map(lambda a: a[j], v)

        return one

    return [_walk(unit, pick(j)) for j in range(m)]


# the slicing primitives that cut a layer's weights out of its unit (and the reshapes
# around them): cheap to repeat, so never kept for the backward pass
SLICES = ("slice", "squeeze", "reshape", "dynamic_slice")


def checkpointed(cfg: ModelConfig, layer: Callable, policy, pick=None) -> list[Callable]:
    """[f_j(unit, x) for each layer j of a unit]: `layer(pick(unit, j), x) -> (x, stats)`
    (pick: `layers`' j-th by default), each under its own checkpoint whose input is the
    whole unit. So the backward recomputes one layer at a time (never a unit's insides),
    and the slices are taken again rather than kept: kept, the scan would stack a copy of
    every layer's weights (the unit, a scan input, is not copied). `policy`: the run's
    remat policy, None to keep everything else."""
    pick = pick or (lambda unit, j: layers(cfg, unit)[j])

    def keep(prim, *args, **params) -> bool:
        if prim.name in SLICES:
            return False
        return policy is None or policy(prim, *args, **params)

    def one(j):
        def f(unit, x):
            return layer(pick(unit, j), x)

        return jax.checkpoint(f, policy=keep, prevent_cse=False)

    return [one(j) for j in range(size(cfg))]


def run(fns: list[Callable], unit, x):
    """A unit's layers (`checkpointed`) in turn: (x, the MoE layer's statistics; {} for
    a dense model)."""
    found = {}
    for f in fns:
        x, stats = f(unit, x)
        found = stats or found
    return x, found


def scan(cfg: ModelConfig, apply: Callable, prepare: Callable, x, stack, aux, policy):
    """model/stack.py's layer scan over units: (x, each unit's MoE statistics stacked).

    `apply(weights, x, aux) -> (x, stats)` is one layer, `prepare` one layer's slice ->
    its weights (ZeRO-3 gathers it, inside the layer's checkpoint as in the layer scan),
    `policy` the remat policy. A Prefetch fetches the next unit's layers while this
    unit computes; they are bound to their sinks per layer, inside its checkpoint."""
    stack = view(cfg, stack)
    if isinstance(prepare, Prefetch):
        pre = prepare
        ahead = Prefetch(
            fetch=lambda p: [pre.fetch(w) for w in layers(cfg, p)],
            bind=lambda p, values: (p, values),
            wrt=pre.wrt,
            source=pre.source,
        )

        def pick(unit, j):
            p, values = unit
            return layers(cfg, p)[j], values[j]

        def unit(bound, x, aux):
            one = lambda pv, x: apply(pre.bind(*pv), x, aux)  # noqa: E731
            return run(checkpointed(cfg, one, policy, pick), bound, x)

        return prefetch.layers(unit, ahead, x, stack, aux, None)
    fns = checkpointed(cfg, lambda w, x: apply(prepare(w), x, aux), policy)
    unroll = layers_per_iteration(cfg.scan_unroll, count(cfg), recomputes=policy is not None)
    return jax.lax.scan(lambda x, p: run(fns, p, x), x, stack, unroll=unroll)
