"""A Llama-style decoder in Flax NNX, written in logical axis names only.

Token embedding -> L x [RMSNorm -> GQA attention with rotary positions ->
residual -> RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm -> LM head.

The L blocks are stored stacked along a leading `layers` axis and applied with
`lax.scan`, so compile time does not grow with depth and a pipeline stage is a
slice of the stack. `block` is a pure function of one layer's parameters and
the residual stream; `Transformer` only owns the parameters (with their logical
axis names); model/stack.py applies them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from ultrajax.config.schema import ModelConfig
from ultrajax.model.attention.backends import attend
from ultrajax.model.boundaries import LOCAL, SINGLE, AttentionBoundary, TensorBoundary
from ultrajax.model.nn import rms_norm, rope
from ultrajax.model.ops import dense

NORMS = ("attn_norm", "mlp_norm", "final_norm")  # excluded from weight decay


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
    q = checkpoint_name(tp.constrain(dense(h, p["wq"], "btd,dnh->btnh"), heads), "query")
    k = checkpoint_name(tp.constrain(dense(h, p["wk"], "btd,dkh->btkh"), kv_heads), "key")
    v = checkpoint_name(tp.constrain(dense(h, p["wv"], "btd,dkh->btkh"), kv_heads), "value")
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
    o = checkpoint_name(tp.constrain(o, heads), "attn_out")
    x = x + tp.exit(dense(o, p["wo"], "btnh,nhd->btd"))  # row-parallel: partial sums

    h = tp.enter(rms_norm(x, p["mlp_norm"], cfg.norm_eps))
    hidden = ("batch", "length", "mlp")
    gate = checkpoint_name(tp.constrain(dense(h, p["w_gate"], "btd,df->btf"), hidden), "mlp_in")
    up = checkpoint_name(tp.constrain(dense(h, p["w_up"], "btd,df->btf"), hidden), "mlp_in")
    out = dense(jax.nn.silu(gate) * up, p["w_down"], "btf,fd->btd")
    x = x + tp.exit(checkpoint_name(out, "mlp_out"))
    return x if cache is None else (x, (k, v))


def _normal(std):
    return jax.nn.initializers.normal(stddev=std)


class Transformer(nnx.Module):
    """Owns the parameters, each annotated with logical axis names (`out_sharding`)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        d, f, n = cfg.d_model, cfg.d_ff, cfg.n_layers
        h, kv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.hd
        pdt = jnp.dtype(cfg.param_dtype)
        out_scale = (2 * n) ** -0.5  # residual branches: GPT-2's 1/sqrt(2L)

        def param(init, shape, names):
            return nnx.Param(
                init(rngs.params(), shape, pdt), out_sharding=names, eager_sharding=False
            )

        ones = jax.nn.initializers.ones
        self.embed = param(_normal(0.02), (cfg.vocab_size, d), ("vocab", "embed"))
        self.layers = nnx.Dict(
            attn_norm=param(ones, (n, d), ("layers", "embed")),
            wq=param(_normal(d**-0.5), (n, d, h, hd), ("layers", "embed", "heads", "head_dim")),
            wk=param(_normal(d**-0.5), (n, d, kv, hd), ("layers", "embed", "kv_heads", "head_dim")),
            wv=param(_normal(d**-0.5), (n, d, kv, hd), ("layers", "embed", "kv_heads", "head_dim")),
            wo=param(
                _normal((h * hd) ** -0.5 * out_scale),
                (n, h, hd, d),
                ("layers", "heads", "head_dim", "embed"),
            ),
            mlp_norm=param(ones, (n, d), ("layers", "embed")),
            w_gate=param(_normal(d**-0.5), (n, d, f), ("layers", "embed", "mlp")),
            w_up=param(_normal(d**-0.5), (n, d, f), ("layers", "embed", "mlp")),
            w_down=param(_normal(f**-0.5 * out_scale), (n, f, d), ("layers", "mlp", "embed")),
        )
        self.final_norm = param(ones, (d,), ("embed",))
        if not cfg.tie_embeddings:
            self.lm_head = param(_normal(d**-0.5), (d, cfg.vocab_size), ("embed", "vocab"))

    def params(self) -> dict:
        return nnx.to_pure_dict(nnx.state(self, nnx.Param))


def init_params(cfg: ModelConfig, key) -> dict:
    """Fresh parameters as a pure dict; call inside `jit` to build them sharded."""
    return Transformer(cfg, rngs=nnx.Rngs(params=key)).params()


def logical_axes(cfg: ModelConfig) -> dict:
    """The logical names of every parameter, as a pure dict of tuples (nothing allocated).

    Traced with jax.eval_shape (not nnx.eval_shape, which would try to turn the
    names into shardings of whatever mesh is current).
    """
    found = {}

    def build():
        state = nnx.state(Transformer(cfg, rngs=nnx.Rngs(params=0)), nnx.Param)
        names = jax.tree.map(
            lambda v: tuple(v.get_metadata()["out_sharding"]),
            state,
            is_leaf=lambda v: isinstance(v, nnx.Variable),
        )
        found["names"] = nnx.to_pure_dict(names)

    jax.eval_shape(build)
    return found["names"]


def param_count(cfg: ModelConfig) -> int:
    """Closed form, derived in the README ("Parameter count"); tested against the model.

    N = V·h·(1 if tied else 2) + L·(2h + h·hd·(2a + 2a_kv) + 3·h·d_ff) + h
    """
    h, hd, a, akv = cfg.d_model, cfg.hd, cfg.n_heads, cfg.n_kv_heads
    per_layer = 2 * h + h * hd * (2 * a + 2 * akv) + 3 * h * cfg.d_ff
    heads = 1 if cfg.tie_embeddings else 2
    return cfg.vocab_size * h * heads + cfg.n_layers * per_layer + h


def matmul_param_count(cfg: ModelConfig) -> int:
    """Parameters that take part in a matmul per token: all but the embedding lookup
    (the LM head counts even when tied) and the norm scales."""
    h, hd, a, akv = cfg.d_model, cfg.hd, cfg.n_heads, cfg.n_kv_heads
    per_layer = h * hd * (2 * a + 2 * akv) + 3 * h * cfg.d_ff
    return cfg.n_layers * per_layer + cfg.vocab_size * h
