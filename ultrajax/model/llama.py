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
from ultrajax.model import remat
from ultrajax.model.attention.backends import attend
from ultrajax.model.boundaries import LOCAL, SINGLE, AttentionBoundary, TensorBoundary
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
    cache=None,
):
    """One decoder layer: x (batch, length, embed) -> same. `p` holds one layer's weights.

    `tp` is the layout: under explicit tensor parallelism `p` holds this rank's heads
    and d_ff slice and `enter`/`exit` are the only places where ranks talk
    (parallel/tensor.py); under the partitioner they are sharding constraints
    (parallel/partitioned.py). `tp.constrain` names an activation's logical axes.
    With `cache=(k_cache, v_cache, start)` (generation) the chunk's keys and values
    are written into the cache at `start` and its queries attend to everything cached
    so far; the layer then returns (x, (k_cache, v_cache)).
    `cp` is context parallelism: the sequence is split over devices and attention alone
    sees other devices' tokens (parallel/context.py).
    """
    heads = ("batch", "length", "heads", "head_dim")
    kv_heads = ("batch", "length", "kv_heads", "head_dim")
    h = tp.enter(rms_norm(x, p["attn_norm"], cfg.norm_eps))
    if tp.join_inputs:  # one matmul, each kv head's group of queries beside its k and v
        d, kv, hd = p["wk"].shape
        g = p["wq"].shape[1] // kv
        groups = [(d, kv, g, hd), (d, kv, 1, hd), (d, kv, 1, hd)]
        q, k, v = dense_joined(h, [p["wq"], p["wk"], p["wv"]], groups, 2)
    else:
        q, k, v = (dense(h, p[n], e) for n, e in QKV)
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
        o = cp.attend(q, k, v, segment_ids, cfg.attention)
    else:
        k_cache, v_cache, start = cache
        k = jax.lax.dynamic_update_slice_in_dim(k_cache, k.astype(k_cache.dtype), start, 1)
        v = jax.lax.dynamic_update_slice_in_dim(v_cache, v.astype(v_cache.dtype), start, 1)
        o = attend(q, k, v, implementation="xla", q_offset=start)
    o = checkpoint_name(tp.constrain(o, heads), remat.ATTN_OUT)
    x = x + tp.exit(dense(o, p["wo"], "btnh,nhd->btd"))  # row-parallel: partial sums

    h = tp.enter(rms_norm(x, p["mlp_norm"], cfg.norm_eps))
    hidden = ("batch", "length", "mlp")
    if tp.join_inputs:
        d, f = p["w_up"].shape
        gate, up = dense_joined(h, [p["w_gate"], p["w_up"]], [(d, 1, f)] * 2, 1)
    else:
        gate, up = dense(h, p["w_gate"], "btd,df->btf"), dense(h, p["w_up"], "btd,df->btf")
    gate = checkpoint_name(tp.constrain(gate, hidden), remat.MLP_IN)
    up = checkpoint_name(tp.constrain(up, hidden), remat.MLP_IN)
    out = dense(jax.nn.silu(gate) * up, p["w_down"], "btf,fd->btd")
    x = x + tp.exit(checkpoint_name(out, remat.MLP_OUT))
    return x if cache is None else (x, (k, v))


# --------------------------------------------------------------------------- the parameters

# what part of the model a parameter belongs to: the memory and communication models
# group by it, the optimizer decays all but the norms, the planner counts the head apart
ATTENTION, MLP, NORM, EMBEDDING, HEAD = PARTS = ("attention", "mlp", "norm", "embedding", "head")
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
)
EMBED_STD = 0.02  # GPT-2's embedding initialisation


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

    @property
    def layered(self) -> bool:
        """Stacked along the leading `layers` axis, one slice per decoder layer."""
        return self.names[0] == "layers"

    @property
    def norm(self) -> bool:
        return self.part == NORM

    def present(self, cfg: ModelConfig) -> bool:
        """Whether this config has it: a tied LM head is the embedding, not a leaf."""
        return not (self.part == HEAD and cfg.tie_embeddings)

    def shape(self, cfg: ModelConfig) -> tuple[int, ...]:
        sizes = axis_sizes(cfg)
        return tuple(sizes[n] for n in self.names)

    def size(self, cfg: ModelConfig) -> int:
        return math.prod(self.shape(cfg))

    def init(self, cfg: ModelConfig):
        """Norm scales start at one; a matmul weight at 1/sqrt(fan-in), residual branches'
        also divided by sqrt(2L) (GPT-2); the embedding at EMBED_STD."""
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
    Param("wo", ("layers", "heads", "head_dim", "embed"), ATTENTION,
          _LAYER + "self_attn.o_proj.weight", fan_in=("heads", "head_dim"), residual=True),
    Param("mlp_norm", ("layers", "embed"), NORM, _LAYER + "post_attention_layernorm.weight"),
    Param("w_gate", ("layers", "embed", "mlp"), MLP, _LAYER + "mlp.gate_proj.weight",
          fan_in=("embed",)),
    Param("w_up", ("layers", "embed", "mlp"), MLP, _LAYER + "mlp.up_proj.weight",
          fan_in=("embed",)),
    Param("w_down", ("layers", "mlp", "embed"), MLP, _LAYER + "mlp.down_proj.weight",
          fan_in=("mlp",), residual=True),
    Param("final_norm", ("embed",), NORM, "model.norm.weight"),
    Param("lm_head", ("embed", "vocab"), HEAD, "lm_head.weight", fan_in=("embed",)),
)  # fmt: skip
NORMS = tuple(p.key for p in PARAMS if p.norm)  # excluded from weight decay


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

    N = V·h·(1 if tied else 2) + L·(2h + h·hd·(2a + 2a_kv) + 3·h·d_ff) + h
    """
    h, hd, a, akv = cfg.d_model, cfg.hd, cfg.n_heads, cfg.n_kv_heads
    per_layer = 2 * h + h * hd * (2 * a + 2 * akv) + 3 * h * cfg.d_ff
    heads = 1 if cfg.tie_embeddings else 2
    return cfg.vocab_size * h * heads + cfg.n_layers * per_layer + h


def matmul_param_count(cfg: ModelConfig) -> int:
    """Parameters that take part in a matmul per token: those with a fan-in, i.e. all but
    the embedding lookup and the norm scales (the LM head counts even when tied)."""
    return sum(p.size(cfg) for p in PARAMS if p.fan_in)
