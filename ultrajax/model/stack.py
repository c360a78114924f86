"""The whole network as pure functions of the parameter dict: embedding, the layer
stack applied with one `lax.scan` or a Python loop (any slice of it: a pipeline stage
is one), final norm and LM head."""

from __future__ import annotations

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
        return _loop(layer, policy, x, stack, n)
    if policy is not None:
        layer = jax.checkpoint(layer, policy=policy, prevent_cse=False)
    unroll = layers_per_iteration(cfg.scan_unroll, n, recomputes=policy is not None)
    return jax.lax.scan(lambda x, p: layer(p, x), x, stack, unroll=unroll)


def _loop(layer, policy, x, stack, n: int):
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
    recomputation early instead, so on a CPU this holds what no recomputation holds."""
    if policy is not None:
        layer = jax.checkpoint(layer, policy=policy, prevent_cse=True)
    outs = []
    for i in range(n):
        # a dynamic slice (at a constant): its transpose adds into a Ref, a slice's cannot
        p = jax.tree.map(lambda a, i=i: jax.lax.dynamic_index_in_dim(a, i, 0, False), stack)
        x, out = layer(p, x)
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
