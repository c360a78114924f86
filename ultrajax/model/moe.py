"""Mixture of experts: the MLP of an MoE layer, in logical axis names.

A router (fp32) scores every expert for every token; each token goes to its `moe_top_k`
best experts, whose SwiGLU outputs are summed with the gates; shared experts, if any,
see every token. Dropless by default: the token-expert assignments are sorted by expert
and each expert multiplies its own rows (`jax.lax.ragged_dot`, a grouped GEMM), so no
token is ever dropped and no padding is computed. With `moe_capacity = c` each expert
takes at most ceil(c · tokens · k / experts) of a micro-batch's assignments (GShard's
capacity factor), the first in token order: those beyond are dropped (their share of
the output is zero; the residual carries the token) and counted. The rule reads the
whole micro-batch, so a layout drops what one device drops; the dropped rows are still
multiplied (the grouped matmul's cost is the dropless one).

Expert parallelism (`mesh.expert`): the sorted assignments travel to the ranks that
hold their experts and back (`ep.experts`, parallel/expert.py); the rest is per token.

Load balance (`moe_balance`): `aux` adds Switch/GShard's auxiliary loss
coef · E · Σ_e f_e · P_e (f_e the share of assignments expert e got, P_e its mean
router probability), `bias` adds a per-expert bias to the scores for the choice only
(DeepSeek-V3's auxiliary-loss-free balance; the step moves it against the load after
every optimizer step), `none` neither. The router z-loss (`moe_z_coef`) penalises
large logits. Both losses are computed over the micro-batch's tokens on every
data-parallel rank (`tokens.sum`) and enter the backward pass where they are computed
(`_attach`): the reported loss stays the language-model loss.

`moe_mlp` returns the layer's output and its statistics, sums over this device's
tokens that the step adds over micro-batches and ranks: each expert's load (the
assignments the router made to it), the dropped assignments, and the two losses.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from ultrajax.config.schema import ModelConfig
from ultrajax.kernels.varying import zeros
from ultrajax.model import grouped, remat
from ultrajax.model.ops import dense, ragged_dense

STATS = ("load", "dropped", "aux", "z")  # per layer; load per expert


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _attach(x, loss, weight: float):
    """x, with d(total loss)/d(loss) = weight: a loss term that joins the backward pass
    here without being returned (Megatron's MoEAuxLossAutoScaler)."""
    return x


def _attach_fwd(x, loss, weight):
    return x, jnp.zeros_like(loss) * loss  # zero, typed as the loss (varying axes)


def _attach_bwd(weight, zero, g):
    return g, zero + jnp.float32(weight)


_attach.defvjp(_attach_fwd, _attach_bwd)


def route(cfg: ModelConfig, logits, bias):
    """(chosen experts (T, k), their gates (T, k) fp32, every expert's score (T, E)).

    softmax: probabilities over all experts (Mixtral); sigmoid: independent affinities
    (DeepSeek-V3). `bias` shifts the choice only, never the gates."""
    if cfg.moe_router == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
    else:
        scores = jax.nn.sigmoid(logits)
    choice = scores + jax.lax.stop_gradient(bias)
    _, experts = jax.lax.top_k(choice, cfg.moe_top_k)
    gates = jnp.take_along_axis(scores, experts, axis=-1)
    if cfg.moe_norm_topk:
        gates = gates / (gates.sum(-1, keepdims=True) + 1e-20)
    return experts, gates, scores


def capacity(cfg: ModelConfig, tokens: int) -> int:
    """Assignments one expert takes per micro-batch (capacity mode): `tokens` the
    micro-batch's, on every rank, so the drops do not depend on the layout."""
    return max(1, math.ceil(cfg.moe_capacity * tokens * cfg.moe_top_k / cfg.moe_experts))


def _swiglu(p, impl: str, xs, sizes):
    """The experts' SwiGLU over rows grouped by expert: group i (sizes[i] rows) through
    expert i's weights (p's experts: all of them, or this rank's share)."""
    gate = ragged_dense(xs, p["moe_gate"], sizes, impl)
    up = ragged_dense(xs, p["moe_up"], sizes, impl)
    gate = checkpoint_name(gate, remat.MLP_IN)
    up = checkpoint_name(up, remat.MLP_IN)
    return ragged_dense(jax.nn.silu(gate) * up, p["moe_down"], sizes, impl)


def experts_out(cfg: ModelConfig, p, x, experts, ep):
    """Each assignment's expert output (T, k, d), the dropped count and each expert's load.

    The assignments sorted by expert (stable: a token's order is kept within an expert),
    one grouped matmul per weight over the sorted rows (`ep.experts`: here, or on the
    ranks that hold the experts). Capacity mode keeps each expert's first C assignments
    in the micro-batch's token order (`ep.before`: those on earlier ranks come first) and
    zeroes the rest: the same drops on any layout."""
    t, k = experts.shape
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    xs = x[order // k]  # (T·k, d) in expert order
    sorted_e = flat[order]
    sizes = jnp.bincount(flat, length=cfg.moe_experts).astype(jnp.int32)
    swiglu = functools.partial(_swiglu, p, grouped.implementation(cfg.moe_grouped))
    ys = ep.experts(swiglu, xs, sorted_e, sizes)
    dropped = jnp.zeros((), jnp.float32)
    if cfg.moe_capacity:
        starts = jnp.cumsum(sizes) - sizes
        pos = jnp.arange(t * k) - starts[sorted_e] + ep.before(sizes)[sorted_e]
        keep = pos < capacity(cfg, t * ep.ranks)
        ys = ys * keep[:, None].astype(ys.dtype)
        dropped = jnp.sum(~keep).astype(jnp.float32)
    # unsort: the inverse permutation, scattered (no second sort on every layer)
    back = jnp.zeros_like(order).at[order].set(jnp.arange(t * k, dtype=order.dtype))
    return ys[back].reshape(t, k, -1), dropped, sizes


def moe_mlp(p, h, *, cfg: ModelConfig, ep):
    """h (batch, length, embed), normalised -> (the MoE MLP's output, its statistics).

    `ep` (model/boundaries.py) sums over the micro-batch's tokens on every data-parallel
    rank (the balance losses are over those) and says how many micro-batches the step
    averages them over."""
    b, s, d = h.shape
    x = h.reshape(b * s, d)
    logits = dense(x.astype(jnp.float32), p["router"], "td,de->te", jnp.float32)
    bias = p["router_bias"]
    experts, gates, scores = route(cfg, logits, getattr(bias, "value", bias))
    ys, dropped, sizes = experts_out(cfg, p, x, experts, ep)
    out = jnp.einsum("tkd,tk->td", ys.astype(jnp.float32), gates).astype(h.dtype)
    if cfg.moe_shared_experts:
        gate = dense(x, p["shared_gate"], "td,df->tf")
        up = dense(x, p["shared_up"], "td,df->tf")
        out = out + dense(jax.nn.silu(gate) * up, p["shared_down"], "tf,fd->td")
    load = sizes.astype(jnp.float32)
    n = ep.tokens(jnp.float32(b * s))  # the micro-batch's tokens on all the ranks
    # this device's share of each loss: the shares sum over the ranks to the micro-batch's
    f = jax.lax.stop_gradient(ep.tokens(load) / (n * cfg.moe_top_k))
    aux = cfg.moe_experts * jnp.sum(f * scores.sum(0)) / n
    z = jnp.sum(jax.nn.logsumexp(logits, axis=-1) ** 2) / n
    # each of the `ep.copies` ranks that hold these tokens (tensor parallelism) attaches
    # its copy of a loss: together, once
    if cfg.moe_balance == "aux" and cfg.moe_aux_coef:
        out = _attach(out, aux, cfg.moe_aux_coef / (ep.micro_batches * ep.copies))
    if cfg.moe_z_coef:
        out = _attach(out, z, cfg.moe_z_coef / (ep.micro_batches * ep.copies))
    stats = {"load": load, "dropped": dropped, "aux": aux, "z": z}
    return out.reshape(b, s, d), jax.tree.map(lambda v: ep.same(jax.lax.stop_gradient(v)), stats)


def zero_stats(cfg: ModelConfig, axes=()) -> dict:
    """Zeros shaped like a micro-batch's statistics of every MoE layer ({} for a dense model),
    typed as varying over `axes`: the running sum's start."""
    if not cfg.moe:
        return {}
    n, e = cfg.n_layers // cfg.moe_every, cfg.moe_experts
    shapes = {"load": (n, e), "dropped": (n,), "aux": (n,), "z": (n,)}
    return {k: zeros(s, jnp.float32, axes) for k, s in shapes.items()}


def update_bias(cfg: ModelConfig, bias, load):
    """DeepSeek-V3's auxiliary-loss-free balance, once per optimizer step: each layer's
    overloaded experts' bias down by moe_bias_rate, the underloaded ones' up. `load`:
    the step's assignments per expert (layers, experts), over all ranks."""
    if cfg.moe_balance != "bias" or not cfg.moe_bias_rate:
        return bias
    step = cfg.moe_bias_rate * jnp.sign(load.mean(-1, keepdims=True) - load)
    return (bias + step).astype(bias.dtype)
