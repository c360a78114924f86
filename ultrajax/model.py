"""A Llama-style decoder in Flax NNX, written in logical axis names only.

Token embedding -> L x [RMSNorm -> GQA attention with rotary positions ->
residual -> RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm -> LM head.

The L blocks are stored stacked along a leading `layers` axis and applied with
`lax.scan`, so compile time does not grow with depth and a pipeline stage is a
slice of the stack. `block` is a pure function of one layer's parameters and
the residual stream; `Transformer` only owns the parameters (with their logical
axis names) and calls `forward`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from ultrajax.attention import attend
from ultrajax.config import ModelConfig
from ultrajax.parallel.context import LOCAL, Context
from ultrajax.parallel.tensor import SINGLE, TensorParallel
from ultrajax.weights import dense, scale

NORMS = ("attn_norm", "mlp_norm", "final_norm")  # excluded from weight decay


def rms_norm(x, weight, eps):
    """RMSNorm in fp32 (the mean of squares is where bf16 loses digits)."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return scale(y, weight).astype(x.dtype)


def rope(
    x,
    positions,
    theta,
    *,
    scaling: str = "none",
    factor: float = 1.0,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_max_len: int = 8192,
):
    """Rotary embedding, half-split layout (Hugging Face Llama's `rotate_half`).

    x: (batch, length, heads, head_dim); positions: (batch, length).
    `scaling` rescales the inverse frequencies (in fp32) as transformers' rope types do,
    so long-context checkpoints compute what they were trained to: linear divides them
    all by `factor`; llama3 divides those with wavelengths above
    original_max_len / low_freq_factor, keeps those below original_max_len /
    high_freq_factor and interpolates between (`_compute_llama3_parameters`).
    """
    half = x.shape[-1] // 2
    freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    if scaling == "linear":
        freq = freq / factor
    elif scaling == "llama3":
        wavelen = 2 * math.pi / freq
        scaled = jnp.where(wavelen > original_max_len / low_freq_factor, freq / factor, freq)
        smooth = (original_max_len / wavelen - low_freq_factor) / (
            high_freq_factor - low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= original_max_len / high_freq_factor) & (
            wavelen <= original_max_len / low_freq_factor
        )
        freq = jnp.where(medium, smoothed, scaled)
    elif scaling != "none":
        raise ValueError(f"rope scaling {scaling!r} is not one of none, linear, llama3")
    angle = positions.astype(jnp.float32)[..., None] * freq  # (b, t, half)
    cos, sin = jnp.cos(angle)[:, :, None], jnp.sin(angle)[:, :, None]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def block(
    p,
    x,
    positions,
    segment_ids,
    *,
    cfg: ModelConfig,
    tp: TensorParallel = SINGLE,
    cp: Context = LOCAL,
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


def remat_policy(remat):
    """model.remat -> (wrap?, jax.checkpoint policy). See the README's memory section."""
    cp = jax.checkpoint_policies
    if remat == "none":
        return None
    if remat == "full":
        return cp.nothing_saveable  # keep only the block input
    if remat == "selective":
        # Korthikanti et al.: keep matmul outputs, recompute softmax and elementwise work.
        return cp.save_only_these_names("query", "key", "value", "attn_out", "mlp_in", "mlp_out")
    if remat == "offload":
        return cp.save_and_offload_only_these_names(
            names_which_can_be_saved=[],
            names_which_can_be_offloaded=["query", "key", "value", "attn_out", "mlp_in", "mlp_out"],
            offload_src="device",
            offload_dst="pinned_host",
        )
    return cp.save_only_these_names(*remat)  # a list of names to keep


def _all_but_gathered_weights(prim, *_, **params) -> bool:
    """remat policy for ZeRO-3 without recomputation: keep every activation, but never
    a gathered weight (it is all-gathered again in the backward pass instead)."""
    if prim.name == "all_gather":  # ZeRO-3 gathers weights over fsdp: never keep those
        names = params.get("axis_name", ())
        return "fsdp" not in (names if isinstance(names, tuple) else (names,))
    return not (prim.name == "name" and params.get("name") == "weights")


def cast(p, dtype):
    """One layer's weights in the compute dtype (the default `prepare`)."""
    return jax.tree.map(lambda w: w.astype(dtype), p)


def embed(cfg: ModelConfig, params, tokens, *, tp: TensorParallel = SINGLE):
    """Token ids (batch, length) -> the residual stream (batch, length, embed)."""
    return tp.embed(params["embed"], tokens, jnp.dtype(cfg.dtype))


def layers(
    cfg: ModelConfig,
    stack,
    x,
    positions,
    segment_ids=None,
    *,
    tp: TensorParallel = SINGLE,
    cp: Context = LOCAL,
    prepare=None,
    gathers: bool = False,
):
    """Apply every layer of `stack` (any slice of the stacked layers: a pipeline stage
    is one) to the residual stream, with one `lax.scan`.

    `prepare(p) -> p`, if given, turns one layer's slice of `stack` (any pytree with a
    leading layer axis) into the weights `block` reads, inside the scan: the step uses
    it to gather ZeRO-3 shards there and to attach gradient sinks (ultrajax.weights).
    `gathers`: prepare all-gathers weights (tagged `checkpoint_name(w, "weights")`),
    which are then recomputed in the backward pass rather than kept, so gathered
    weights live one layer at a time."""
    dtype = jnp.dtype(cfg.dtype)
    prepare = prepare or (lambda p: cast(p, dtype))

    def layer(p, x):
        p = prepare(p)
        return block(p, x, positions, segment_ids, cfg=cfg, tp=tp, cp=cp)

    policy = remat_policy(cfg.remat)
    if policy is None and gathers:
        policy = _all_but_gathered_weights
    if policy is not None:
        layer = jax.checkpoint(layer, policy=policy, prevent_cse=False)
    n = jax.tree.leaves(stack)[0].shape[0]
    unroll = max(1, min(cfg.scan_unroll, n))  # model.scan_unroll layers per loop iteration
    x, _ = jax.lax.scan(lambda x, p: (layer(p, x), None), x, stack, unroll=unroll)
    return x


def final_norm(cfg: ModelConfig, params, x, *, tp: TensorParallel = SINGLE):
    """The final RMSNorm, entering the LM head's TP region (the whole sequence)."""
    return tp.enter(rms_norm(x, params["final_norm"], cfg.norm_eps))


def logits(cfg: ModelConfig, params, x, *, tp: TensorParallel = SINGLE):
    """LM head on normalised activations (any slice of the sequence): fp32 logits; under
    tensor parallelism this rank's slice of the vocabulary (the loss never gathers them)."""
    if cfg.tie_embeddings:
        out = dense(x, params["embed"], "btd,vd->btv", jnp.float32)
    else:
        out = dense(x, params["lm_head"], "btd,dv->btv", jnp.float32)
    return tp.constrain(out, ("batch", "length", "vocab"))


def head(cfg: ModelConfig, params, x, *, tp: TensorParallel = SINGLE):
    """Final norm and LM head: fp32 logits (batch, length, vocab)."""
    return logits(cfg, params, final_norm(cfg, params, x, tp=tp), tp=tp)


def forward(
    cfg: ModelConfig,
    params,
    tokens,
    positions=None,
    segment_ids=None,
    *,
    tp: TensorParallel = SINGLE,
    prepare=None,
    gathers: bool = False,
):
    """Logits in fp32, (batch, length, vocab): `head(layers(embed(tokens)))`.

    `params` is a pure dict of arrays (any dtype) or of `weights.Weight`s."""
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    x = embed(cfg, params, tokens, tp=tp)
    x = layers(
        cfg, params["layers"], x, positions, segment_ids, tp=tp, prepare=prepare, gathers=gathers
    )
    return head(cfg, params, x, tp=tp)


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

    def __call__(self, tokens, positions=None, segment_ids=None):
        return forward(self.cfg, self.params(), tokens, positions, segment_ids)


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


# ------------------------------------------------------------------ decoding with a KV cache


def init_cache(cfg: ModelConfig, batch: int, length: int, dtype=None) -> dict:
    """Room for the keys and values of `length` positions, every layer:
    (layers, batch, length, kv_heads, head_dim) each, in the compute dtype."""
    shape = (cfg.n_layers, batch, length, cfg.n_kv_heads, cfg.hd)
    dtype = jnp.dtype(dtype or cfg.dtype)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def forward_with_cache(cfg: ModelConfig, params, tokens, cache: dict, start):
    """fp32 logits of `tokens` (batch, t) placed at positions start..start+t-1, and the
    cache with their keys and values written (prefill: the prompt at start=0; then one
    token at a time). Equals `forward` on the whole sequence so far."""
    dtype = jnp.dtype(cfg.dtype)
    b, t = tokens.shape
    positions = start + jnp.broadcast_to(jnp.arange(t), (b, t))
    x = embed(cfg, params, tokens)

    def layer(x, inputs):
        p, ck, cv = inputs
        return block(cast(p, dtype), x, positions, None, cfg=cfg, cache=(ck, cv, start))

    x, (k, v) = jax.lax.scan(layer, x, (params["layers"], cache["k"], cache["v"]))
    return head(cfg, params, x), {"k": k, "v": v}
