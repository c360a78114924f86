"""The whole network as pure functions of the parameter dict: embedding, the layer
stack applied with one `lax.scan` or a Python loop (any slice of it: a pipeline stage
is one), final norm and LM head."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from ultrajax.config.schema import ModelConfig
from ultrajax.model import prefetch, units
from ultrajax.model.boundaries import (
    LOCAL,
    ONE_DEVICE,
    SINGLE,
    AttentionBoundary,
    ExpertBoundary,
    TensorBoundary,
)
from ultrajax.model.llama import block_stats
from ultrajax.model.nn import rms_norm
from ultrajax.model.ops import dense
from ultrajax.model.prefetch import Prefetch
from ultrajax.model.remat import all_but_gathered_weights, layers_per_iteration, remat_policy

LOGITS = ("batch", "length", "vocab")  # the LM head's output, by logical axis


@dataclass(frozen=True)
class Held:
    """A `prepare` (a layer's slice of the stack -> the weights `block` reads) whose
    `key` part of the stack is never differentiated and lives through the whole step
    anyway: the compute copy of the weights that gradient accumulation holds across
    its micro-batches (parallel/grads.py). The layer loop then slices it inside each
    layer's checkpoint, so the backward slices it again rather than keep every layer's
    slice from the forward pass, a second copy of the layers' weights (`_loop`)."""

    fn: Callable
    key: str

    def __call__(self, p):
        return self.fn(p)


def cast(p, dtype):
    """One layer's weights in the compute dtype (the default `prepare`)."""
    return jax.tree.map(lambda w: w.astype(dtype), p)


def embed(cfg: ModelConfig, params, tokens, *, tp: TensorBoundary = SINGLE):
    """Token ids (batch, length) -> the residual stream (batch, length, embed)."""
    return tp.embed(params["embed"], tokens, jnp.dtype(cfg.dtype))


def layers(
    cfg: ModelConfig,
    stack,
    x,
    positions,
    segment_ids=None,
    *,
    tp: TensorBoundary = SINGLE,
    cp: AttentionBoundary = LOCAL,
    ep: ExpertBoundary = ONE_DEVICE,
    prepare=None,
    gathered_over: str | None = None,
):
    """Apply every layer of `stack` (any slice of the stacked layers: a pipeline stage
    is one) to the residual stream, with one `lax.scan` (model.scan_layers=false: a
    Python loop, `_loop`): (the stream, each MoE layer's statistics stacked along a
    leading layer axis, {} for a dense model). Interleaved dense and MoE layers are
    scanned a unit at a time (model/units.py).

    `prepare(p) -> p`, if given, turns one layer's slice of `stack` (any pytree with a
    leading layer axis) into the weights `block` reads, inside the scan: the step uses
    it to gather ZeRO-3 shards there and to attach gradient sinks (model/ops.py).
    `gathered_over`: the mesh axis over which prepare all-gathers weights (ZeRO-3; tagged
    `checkpoint_name(w, GATHERED)`); they are then gathered again in the backward pass
    rather than kept, so gathered weights live one layer at a time."""
    dtype = jnp.dtype(cfg.dtype)
    prepare = prepare or (lambda p: cast(p, dtype))

    def apply(p, x, aux):
        return block_stats(p, x, *aux, cfg=cfg, tp=tp, cp=cp, ep=ep)

    policy = remat_policy(cfg.remat)
    if policy is None and gathered_over is not None:
        policy = all_but_gathered_weights(gathered_over)
    if units.size(cfg) > 1:  # dense and MoE layers interleaved: scan units of them
        return units.scan(cfg, apply, prepare, x, stack, (positions, segment_ids), policy)
    if isinstance(prepare, Prefetch):  # ZeRO-3 (parallel/zero.py `prefetches`)
        return prefetch.layers(apply, prepare, x, stack, (positions, segment_ids), policy)

    def layer(p, x):
        return apply(prepare(p), x, (positions, segment_ids))

    n = jax.tree.leaves(stack)[0].shape[0]
    if not cfg.scan_layers:
        held = prepare.key if isinstance(prepare, Held) else None
        return _loop(layer, policy, x, stack, n, held)
    if policy is not None:
        layer = jax.checkpoint(layer, policy=policy, prevent_cse=False)
    unroll = layers_per_iteration(cfg.scan_unroll, n, recomputes=policy is not None)
    return jax.lax.scan(lambda x, p: layer(p, x), x, stack, unroll=unroll)


def _loop(layer, policy, x, stack, n: int, held: str | None = None):
    """model.scan_layers=false: the layers as a Python loop over the stack's slices at
    constant indices, each checkpointed on its own (prevent_cse: outside a scan XLA would
    otherwise merge a layer's recomputation with its forward and keep what the policy
    drops).

    A scan copies each layer's saved activations into buffers stacked over the layers
    (zeroed first), and its backward zeroes and fills a stacked gradient; here they stay
    the buffers their ops wrote, each freed once its layer's backward has run. Compiled
    for an H200 (scripts/gpu_compile.py), the 1B step under selective recomputation moves
    150.5 GiB a step in its memory-bound kernels instead of 209.5, at a 31.3 GiB peak
    instead of 34.1; compile time grows with depth. XLA:CPU runs every layer's
    recomputation early instead, so on a CPU this holds what no recomputation holds.

    `held`: the stack's key (`Held`) sliced inside the checkpoint, when there is one.
    Compiled for 8 H100s, configs/llama-1b.yaml's step then holds 17.77 GiB, not 19.26.
    Without gradient accumulation the weights' compute copy is not held, and slicing
    inside raised the 1B step's peak under full recomputation (one H200: 20.34 -> 21.66
    GiB); without recomputation there is no checkpoint to slice in."""
    held = held if policy is not None else None

    def at(tree, i):
        # a dynamic slice (at a constant): its transpose adds into a Ref, a slice's cannot
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, False), tree)

    outs = []
    for i in range(n):

        def sliced(p, whole, x, i=i):
            return layer(p if whole is None else dict(p, **at(whole, i)), x)

        if policy is not None:
            sliced = jax.checkpoint(sliced, policy=policy, prevent_cse=True)
        if held is None:
            x, out = sliced(at(stack, i), None, x)
        else:
            rest = {k: v for k, v in stack.items() if k != held}
            x, out = sliced(at(rest, i), {held: stack[held]}, x)
        outs.append(out)
    return x, jax.tree.map(lambda *a: jnp.stack(a), *outs)


def final_norm(cfg: ModelConfig, params, x, *, tp: TensorBoundary = SINGLE):
    """The final RMSNorm, entering the LM head's TP region (the whole sequence)."""
    return tp.enter(rms_norm(x, params["final_norm"], cfg.norm_eps))


def logits(cfg: ModelConfig, params, x, *, tp: TensorBoundary = SINGLE):
    """LM head on normalised activations (any slice of the sequence): fp32 logits; under
    tensor parallelism this rank's slice of the vocabulary (the loss never gathers them)."""
    w, eq = head_weight(cfg, params)
    return tp.constrain(dense(x, w, eq, jnp.float32), LOGITS)


def head_weight(cfg: ModelConfig, params):
    """The LM head's weight and its einsum: the embedding's table when tied."""
    if cfg.tie_embeddings:
        return params["embed"], "btd,vd->btv"
    return params["lm_head"], "btd,dv->btv"


def head_params(cfg: ModelConfig) -> tuple[str, str]:
    """The parameters `final_norm` and `logits` read: the final norm and the LM head (the
    embedding, when tied). The pipeline's last stage holds their gradients."""
    return ("final_norm", "embed" if cfg.tie_embeddings else "lm_head")


def head(cfg: ModelConfig, params, x, *, tp: TensorBoundary = SINGLE):
    """Final norm and LM head: fp32 logits (batch, length, vocab)."""
    return logits(cfg, params, final_norm(cfg, params, x, tp=tp), tp=tp)


def forward(
    cfg: ModelConfig,
    params,
    tokens,
    positions=None,
    segment_ids=None,
    *,
    tp: TensorBoundary = SINGLE,
    prepare=None,
    gathered_over: str | None = None,
):
    """Logits in fp32, (batch, length, vocab): `head(layers(embed(tokens)))`.

    `params` is a pure dict of arrays (any dtype) or of `weights.Weight`s."""
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    x = embed(cfg, params, tokens, tp=tp)
    x, _ = layers(
        cfg,
        params["layers"],
        x,
        positions,
        segment_ids,
        tp=tp,
        prepare=prepare,
        gathered_over=gathered_over,
    )
    return head(cfg, params, x, tp=tp)
