"""A Llama-style decoder in Flax NNX, written in logical axis names only.

Token embedding -> L x [RMSNorm -> GQA attention with rotary positions ->
residual -> RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm -> LM head.

The L blocks are stored stacked along a leading `layers` axis and applied with
`lax.scan`, so compile time does not grow with depth and a pipeline stage is a
slice of the stack. `block` is a pure function of one layer's parameters and
the residual stream. `PARAMS` is the family's parameter table: each leaf's logical
axis names (its shape), its part of the model, its initialisation and its Hugging Face
name, read by the cost models, the optimizer, the checkpoint and the converter;
`Transformer` builds the parameters from it and model/stack.py applies them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from ultrajax.config.schema import ModelConfig
from ultrajax.model import fp8, remat
from ultrajax.model.attention.backends import attend
from ultrajax.model.boundaries import (
    LOCAL,
    ONE_DEVICE,
    SINGLE,
    AttentionBoundary,
    ExpertBoundary,
    TensorBoundary,
)
from ultrajax.model.moe import moe_mlp
from ultrajax.model.nn import rms_norm, rope
from ultrajax.model.ops import dense, dense_joined

QKV = (("wq", "btd,dnh->btnh"), ("wk", "btd,dkh->btkh"), ("wv", "btd,dkh->btkh"))


def block(
    p,
    x,
    positions,
    segment_ids,
    *,
    cfg: ModelConfig,
    tp: TensorBoundary = SINGLE,
    cp: AttentionBoundary = LOCAL,
    ep: ExpertBoundary = ONE_DEVICE,
    cache=None,
):
    """One decoder layer: x (batch, length, embed) -> same. `p` holds one layer's weights.
    (`block_stats` also returns an MoE layer's statistics.)

    `tp` is the layout: under explicit tensor parallelism `p` holds this rank's heads
    and d_ff slice and `enter`/`exit` are the only places where ranks talk
    (parallel/tensor.py); under the partitioner they are sharding constraints
    (parallel/partitioned.py). `tp.constrain` names an activation's logical axes.
    With `cache=(k_cache, v_cache, start)` (generation) the chunk's keys and values
    are written into the cache at `start` and its queries attend to everything cached
    so far; the layer then returns (x, (k_cache, v_cache)).
    `cp` is context parallelism: the sequence is split over devices and attention alone
    sees other devices' tokens (parallel/context.py). `ep`: an MoE layer's reach over
    the data-parallel ranks (model/moe.py).
    """
    out, _ = block_stats(p, x, positions, segment_ids, cfg=cfg, tp=tp, cp=cp, ep=ep, cache=cache)
    return out


def block_stats(p, x, positions, segment_ids, *, cfg, tp=SINGLE, cp=LOCAL, ep=ONE_DEVICE,
                cache=None):  # fmt: skip
    """`block`'s output and the layer's MoE statistics (model/moe.py STATS; {}: dense)."""
    heads = ("batch", "length", "heads", "head_dim")
    kv_heads = ("batch", "length", "kv_heads", "head_dim")
    f8 = fp8_recipes(cfg)  # each weight's matmul through FP8 operands, or "none"
    h = tp.enter(rms_norm(x, p["attn_norm"], cfg.norm_eps))
    if tp.join_inputs:  # one matmul, each kv head's group of queries beside its k and v
        d, kv, hd = p["wk"].shape
        g = p["wq"].shape[1] // kv
        groups = [(d, kv, g, hd), (d, kv, 1, hd), (d, kv, 1, hd)]
        q, k, v = dense_joined(h, [p[n] for n, _ in QKV], groups, 2, [f8[n] for n, _ in QKV])
    else:
        q, k, v = (dense(h, p[n], e, fp8_recipe=f8[n]) for n, e in QKV)
    if cfg.qk_norm:  # over each head's own dimensions, before the rotation
        q = rms_norm(q, p["q_norm"], cfg.norm_eps)
        k = rms_norm(k, p["k_norm"], cfg.norm_eps)
    q = checkpoint_name(tp.constrain(q, heads), remat.QUERY)
    k = checkpoint_name(tp.constrain(k, kv_heads), remat.KEY)
    v = checkpoint_name(tp.constrain(v, kv_heads), remat.VALUE)
    scaling = dict(
        scaling=cfg.rope_scaling,
        factor=cfg.rope_factor,
        low_freq_factor=cfg.rope_low_freq_factor,
        high_freq_factor=cfg.rope_high_freq_factor,
        original_max_len=cfg.rope_original_max_len,
    )
    q = rope(q, positions, cfg.rope_theta, **scaling)
    k = rope(k, positions, cfg.rope_theta, **scaling)
    if cache is None:
        o = tp.constrain(cp.attend(q, k, v, segment_ids, cfg.attention), heads)
        kept = cp.output_residual(cfg.attention, segment_ids, k.shape[1])
        if remat.names_attention_output(cfg.remat, kept):
            o = checkpoint_name(o, remat.ATTN_OUT)
    else:
        k_cache, v_cache, start = cache
        k = jax.lax.dynamic_update_slice_in_dim(k_cache, k.astype(k_cache.dtype), start, 1)
        v = jax.lax.dynamic_update_slice_in_dim(v_cache, v.astype(v_cache.dtype), start, 1)
        o = tp.constrain(attend(q, k, v, implementation="xla", q_offset=start), heads)
    x = x + tp.exit(dense(o, p["wo"], "btnh,nhd->btd", fp8_recipe=f8["wo"]))  # row-parallel
    x = checkpoint_name(x, remat.RESIDUAL)

    h = tp.enter(rms_norm(x, p["mlp_norm"], cfg.norm_eps))
    if "router" in p:  # an MoE layer (with model.moe_every > 1, every moe_every-th)
        out, stats = moe_mlp(p, h, cfg=cfg, ep=ep)
        x = x + tp.exit(checkpoint_name(out, remat.MLP_OUT))
        return (x if cache is None else (x, (k, v))), stats
    hidden = ("batch", "length", "mlp")
    if tp.join_inputs:
        d, f = p["w_up"].shape
        pair, recipes = [p["w_gate"], p["w_up"]], [f8["w_gate"], f8["w_up"]]
        gate, up = dense_joined(h, pair, [(d, 1, f)] * 2, 1, recipes)
    else:
        gate = dense(h, p["w_gate"], "btd,df->btf", fp8_recipe=f8["w_gate"])
        up = dense(h, p["w_up"], "btd,df->btf", fp8_recipe=f8["w_up"])
    gate = checkpoint_name(tp.constrain(gate, hidden), remat.MLP_IN)
    up = checkpoint_name(tp.constrain(up, hidden), remat.MLP_IN)
    out = dense(jax.nn.silu(gate) * up, p["w_down"], "btf,fd->btd", fp8_recipe=f8["w_down"])
    x = x + tp.exit(checkpoint_name(out, remat.MLP_OUT))
    return (x if cache is None else (x, (k, v))), {}


# --------------------------------------------------------------------------- the parameters

# what part of the model a parameter belongs to: the memory and communication models
# group by it, the optimizer decays all but the norms, the planner counts the head apart
ATTENTION, MLP, NORM, EMBEDDING, HEAD, ROUTER, EXPERTS = PARTS = (
    "attention", "mlp", "norm", "embedding", "head", "router", "experts"
)  # fmt: skip
# which configs (and layers) have a parameter: every one, dense ones (the MLP; the dense
# layers of an MoE model with moe_every > 1), MoE ones (the router and experts), MoE ones
# with shared experts
ALWAYS, DENSE, MOE, SHARED, QK = "always", "dense", "moe", "shared", "qk"
# the config keys the parameter shapes read (head_dim through `hd`): a checkpoint whose
# keys differ cannot be restored into this config
SHAPE_KEYS = (
    "vocab_size",
    "d_model",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "d_ff",
    "tie_embeddings",
    "moe_experts",
    "moe_d_ff",
    "moe_shared_experts",
    "moe_every",
    "qk_norm",
)
EMBED_STD = 0.02  # GPT-2's embedding initialisation


def moe_layers(cfg: ModelConfig) -> int:
    """How many layers are MoE layers: every moe_every-th (0 for a dense model)."""
    return cfg.n_layers // cfg.moe_every if cfg.moe else 0


def axis_sizes(cfg: ModelConfig) -> dict[str, int]:
    """The size of each logical axis a parameter has: its shape is its names' sizes."""
    return {
        "vocab": cfg.vocab_size,
        "embed": cfg.d_model,
        "layers": cfg.n_layers,
        "heads": cfg.n_heads,
        "kv_heads": cfg.n_kv_heads,
        "head_dim": cfg.hd,
        "mlp": cfg.d_ff,
        "experts": cfg.moe_experts,
        "scores": cfg.moe_experts,
        "moe_mlp": cfg.expert_ff,
        "shared_mlp": cfg.moe_shared_experts * cfg.expert_ff,
    }


@dataclass(frozen=True)
class Param:
    """One parameter of the family and everything the rest of the package reads about it:
    the model builds it, the cost models size and shard it, the optimizer and the
    converter find it by these fields rather than by its name."""

    key: str  # params[key], or params["layers"][key] for a layer's (stacked) weight
    names: tuple[str, ...]  # logical axis names, one per dimension: the shape's sizes
    part: str  # one of PARTS
    hf: str  # its Hugging Face Llama tensor name, `{i}` the layer
    fan_in: tuple[str, ...] = ()  # the axes its matmul contracts; none: a lookup or a scale
    residual: bool = False  # its output joins the residual stream: scaled at init
    when: str = ALWAYS  # which configs have it: ALWAYS, DENSE, MOE, SHARED
    zero: bool = False  # starts at zero (a bias)

    @property
    def layered(self) -> bool:
        """Stacked along the leading `layers` axis, one slice per decoder layer."""
        return self.names[0] == "layers"

    @property
    def norm(self) -> bool:
        return self.part == NORM

    def present(self, cfg: ModelConfig) -> bool:
        """Whether this config has it: a tied LM head is the embedding, not a leaf; a dense
        model has the MLP, an MoE model the router, experts and shared experts it asks for."""
        if self.part == HEAD and cfg.tie_embeddings:
            return False
        return {
            ALWAYS: True,
            DENSE: not cfg.moe or cfg.moe_every > 1,
            MOE: cfg.moe,
            SHARED: cfg.moe and cfg.moe_shared_experts > 0,
            QK: cfg.qk_norm,
        }[self.when]

    def rows(self, cfg: ModelConfig) -> int:
        """Its layers' count along the leading `layers` axis: every layer's attention and
        norms, the dense layers' MLP, the MoE layers' router and experts (model.moe_every
        interleaves them: model/units.py)."""
        n, moe = cfg.n_layers, moe_layers(cfg)
        return {DENSE: n - moe, MOE: moe, SHARED: moe}.get(self.when, n)

    def row(self, cfg: ModelConfig, layer: int) -> int | None:
        """Which row of its stack holds layer `layer`'s copy, or None (that layer has none)."""
        every = cfg.moe_every if cfg.moe else 1
        sparse = (layer + 1) % every == 0  # Qwen-MoE's decoder_sparse_step
        if self.when == DENSE:
            if not cfg.moe:
                return layer
            return None if sparse else layer - (layer + 1) // every
        if self.when in (MOE, SHARED):
            return layer // every if sparse else None
        return layer

    def shape(self, cfg: ModelConfig) -> tuple[int, ...]:
        sizes = dict(axis_sizes(cfg), layers=self.rows(cfg))
        return tuple(sizes[n] for n in self.names)

    def size(self, cfg: ModelConfig) -> int:
        return math.prod(self.shape(cfg))

    def init(self, cfg: ModelConfig):
        """Norm scales start at one; a matmul weight at 1/sqrt(fan-in), residual branches'
        also divided by sqrt(2L) (GPT-2); the embedding at EMBED_STD."""
        if self.zero:
            return jax.nn.initializers.zeros
        if self.norm:
            return jax.nn.initializers.ones
        if not self.fan_in:
            return jax.nn.initializers.normal(stddev=EMBED_STD)
        sizes = axis_sizes(cfg)
        std = math.prod(sizes[n] for n in self.fan_in) ** -0.5
        if self.residual:
            std = std * (2 * cfg.n_layers) ** -0.5
        return jax.nn.initializers.normal(stddev=std)


_LAYER = "model.layers.{i}."
_MOE = _LAYER + "block_sparse_moe."
# in the order the parameters are initialised (each draws the next key)
PARAMS = (
    Param("embed", ("vocab", "embed"), EMBEDDING, "model.embed_tokens.weight"),
    Param("attn_norm", ("layers", "embed"), NORM, _LAYER + "input_layernorm.weight"),
    Param("wq", ("layers", "embed", "heads", "head_dim"), ATTENTION,
          _LAYER + "self_attn.q_proj.weight", fan_in=("embed",)),
    Param("wk", ("layers", "embed", "kv_heads", "head_dim"), ATTENTION,
          _LAYER + "self_attn.k_proj.weight", fan_in=("embed",)),
    Param("wv", ("layers", "embed", "kv_heads", "head_dim"), ATTENTION,
          _LAYER + "self_attn.v_proj.weight", fan_in=("embed",)),
    Param("q_norm", ("layers", "head_dim"), NORM, _LAYER + "self_attn.q_norm.weight", when=QK),
    Param("k_norm", ("layers", "head_dim"), NORM, _LAYER + "self_attn.k_norm.weight", when=QK),
    Param("wo", ("layers", "heads", "head_dim", "embed"), ATTENTION,
          _LAYER + "self_attn.o_proj.weight", fan_in=("heads", "head_dim"), residual=True),
    Param("mlp_norm", ("layers", "embed"), NORM, _LAYER + "post_attention_layernorm.weight"),
    Param("w_gate", ("layers", "embed", "mlp"), MLP, _LAYER + "mlp.gate_proj.weight",
          fan_in=("embed",), when=DENSE),
    Param("w_up", ("layers", "embed", "mlp"), MLP, _LAYER + "mlp.up_proj.weight",
          fan_in=("embed",), when=DENSE),
    Param("w_down", ("layers", "mlp", "embed"), MLP, _LAYER + "mlp.down_proj.weight",
          fan_in=("mlp",), residual=True, when=DENSE),
    # mixture of experts (model/moe.py): Mixtral's names, `{e}` the expert
    Param("router", ("layers", "embed", "scores"), ROUTER, _MOE + "gate.weight",
          fan_in=("embed",), when=MOE),
    Param("router_bias", ("layers", "scores"), ROUTER, _MOE + "gate.e_score_correction_bias",
          when=MOE, zero=True),
    Param("moe_gate", ("layers", "experts", "embed", "moe_mlp"), EXPERTS,
          _MOE + "experts.{e}.w1.weight", fan_in=("embed",), when=MOE),
    Param("moe_up", ("layers", "experts", "embed", "moe_mlp"), EXPERTS,
          _MOE + "experts.{e}.w3.weight", fan_in=("embed",), when=MOE),
    Param("moe_down", ("layers", "experts", "moe_mlp", "embed"), EXPERTS,
          _MOE + "experts.{e}.w2.weight", fan_in=("moe_mlp",), residual=True, when=MOE),
    Param("shared_gate", ("layers", "embed", "shared_mlp"), MLP,
          _LAYER + "mlp.shared_expert.gate_proj.weight", fan_in=("embed",), when=SHARED),
    Param("shared_up", ("layers", "embed", "shared_mlp"), MLP,
          _LAYER + "mlp.shared_expert.up_proj.weight", fan_in=("embed",), when=SHARED),
    Param("shared_down", ("layers", "shared_mlp", "embed"), MLP,
          _LAYER + "mlp.shared_expert.down_proj.weight", fan_in=("shared_mlp",),
          residual=True, when=SHARED),
    Param("final_norm", ("embed",), NORM, "model.norm.weight"),
    Param("lm_head", ("embed", "vocab"), HEAD, "lm_head.weight", fan_in=("embed",)),
)  # fmt: skip
NORMS = tuple(p.key for p in PARAMS if p.norm)
NO_DECAY = NORMS + tuple(p.key for p in PARAMS if p.zero)  # the norm scales and biases


def params_of(cfg: ModelConfig) -> tuple[Param, ...]:
    """The parameters this config has, in PARAMS order."""
    return tuple(p for p in PARAMS if p.present(cfg))


def _tree(cfg: ModelConfig, leaf) -> dict:
    """{key: leaf(p)} with the layers' under "layers": the parameters' tree, any leaves."""
    tree = {"layers": {}}
    for p in params_of(cfg):
        (tree["layers"] if p.layered else tree)[p.key] = leaf(p)
    return tree


class Transformer(nnx.Module):
    """Owns the parameters, each annotated with logical axis names (`out_sharding`)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        pdt = jnp.dtype(cfg.param_dtype)

        def param(p: Param):
            value = p.init(cfg)(rngs.params(), p.shape(cfg), pdt)
            return nnx.Param(value, out_sharding=p.names, eager_sharding=False)

        tree = _tree(cfg, param)
        self.layers = nnx.Dict(tree.pop("layers"))
        for key, value in tree.items():
            setattr(self, key, value)

    def params(self) -> dict:
        return nnx.to_pure_dict(nnx.state(self, nnx.Param))


def init_params(cfg: ModelConfig, key) -> dict:
    """Fresh parameters as a pure dict; call inside `jit` to build them sharded."""
    return Transformer(cfg, rngs=nnx.Rngs(params=key)).params()


def logical_axes(cfg: ModelConfig) -> dict:
    """The logical names of every parameter, as a pure dict of tuples (nothing allocated)."""
    return _tree(cfg, lambda p: p.names)


def param_count(cfg: ModelConfig) -> int:
    """Closed form, derived in the README ("Parameter count"); tested against the model.

    N = V·h·(1 if tied else 2) + L·(2h + h·hd·(2a + 2a_kv)) + L_d·3·h·d_ff + L_e·M + h
    (+ 2·L·hd with qk_norm): L_e = L / moe_every MoE layers, L_d = L - L_e dense ones,
    each MoE layer's MLP with E experts of hidden size f and S shared ones
    M = (h + 1)·E + 3·E·h·f + 3·h·S·f (router and its bias, experts, shared experts).
    """
    h, hd, a, akv = cfg.d_model, cfg.hd, cfg.n_heads, cfg.n_kv_heads
    per_layer = 2 * h + h * hd * (2 * a + 2 * akv)
    per_layer += 2 * hd if cfg.qk_norm else 0
    heads = 1 if cfg.tie_embeddings else 2
    moe = moe_layers(cfg)
    mlp = (cfg.n_layers - moe) * 3 * h * cfg.d_ff + moe * _moe_params(cfg, cfg.moe_experts)
    return cfg.vocab_size * h * heads + cfg.n_layers * per_layer + mlp + h


def _moe_params(cfg: ModelConfig, experts: float) -> float:
    """One MoE layer's MLP parameters, counting `experts` of the routed experts."""
    h = cfg.d_model
    f, e, s = cfg.expert_ff, cfg.moe_experts, cfg.moe_shared_experts
    return (h + 1) * e + 3 * experts * h * f + 3 * h * s * f


def active_param_count(cfg: ModelConfig) -> int:
    """Parameters one token goes through: `param_count` with each MoE layer's routed
    experts counted moe_top_k times instead of moe_experts times (dense: param_count)."""
    if not cfg.moe:
        return param_count(cfg)
    drop = _moe_params(cfg, cfg.moe_experts) - _moe_params(cfg, cfg.moe_top_k)
    return int(param_count(cfg) - moe_layers(cfg) * drop)


def fp8_weights(cfg: ModelConfig) -> tuple[str, ...]:
    """The weights whose matmuls take FP8 operands (model.fp8, model.fp8_layers), in
    fp8.WEIGHTS order; () with model.fp8=none."""
    if cfg.fp8 == "none":
        return ()
    chosen = fp8.WEIGHTS if cfg.fp8_layers is None else cfg.fp8_layers
    return tuple(k for k in fp8.WEIGHTS if k in chosen)


def fp8_recipes(cfg: ModelConfig) -> dict[str, str]:
    """{weight: the recipe its matmul takes} over fp8.WEIGHTS ("none": model.dtype)."""
    chosen = fp8_weights(cfg)
    return {k: cfg.fp8 if k in chosen else "none" for k in fp8.WEIGHTS}


def fp8_param_count(cfg: ModelConfig) -> int:
    """Parameters whose matmuls run through FP8 operands (0 with model.fp8=none)."""
    chosen = fp8_weights(cfg)
    return sum(p.size(cfg) for p in PARAMS if p.key in chosen and p.present(cfg))


def fp8_history(cfg: ModelConfig) -> dict:
    """model.fp8=delayed: each FP8 weight's empty amax history, stacked like the weight
    ({} otherwise): the train state's "fp8"."""
    if cfg.fp8 != "delayed":
        return {}
    rows = {p.key: p.rows(cfg) for p in params_of(cfg)}
    return {k: fp8.history(rows[k], cfg.fp8_history) for k in fp8_weights(cfg) if k in rows}


def matmul_param_count(cfg: ModelConfig) -> float:
    """Parameters that take part in a matmul per token: those with a fan-in, i.e. all but
    the embedding lookup and the norm scales (the LM head counts even when tied); of an
    MoE layer's routed experts, the moe_top_k a token goes to."""
    share = {EXPERTS: cfg.moe_top_k / cfg.moe_experts} if cfg.moe else {}
    used = [p for p in PARAMS if p.fan_in and (p.when == ALWAYS or p.present(cfg))]
    return sum(p.size(cfg) * share.get(p.part, 1) for p in used)
