"""Decoding with a KV cache: the same layers, written into and read from a cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ultrajax.config.schema import ModelConfig
from ultrajax.model import units
from ultrajax.model.llama import block
from ultrajax.model.stack import cast, embed, head

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

    m = units.size(cfg)  # dense and MoE layers interleaved: a unit of m layers at a time

    def layer(x, inputs):
        p, ck, cv = inputs
        ks, vs = [], []
        for j, w in enumerate(units.layers(cfg, p)):
            at = (ck, cv) if m == 1 else (ck[j], cv[j])
            x, (k, v) = block(cast(w, dtype), x, positions, None, cfg=cfg, cache=(*at, start))
            ks.append(k)
            vs.append(v)
        return x, (ks[0], vs[0]) if m == 1 else (jnp.stack(ks), jnp.stack(vs))

    stack = units.view(cfg, params["layers"])
    ck, cv = (c.reshape(-1, m, *c.shape[1:]) if m > 1 else c for c in (cache["k"], cache["v"]))
    x, (k, v) = jax.lax.scan(layer, x, (stack, ck, cv))
    if m > 1:
        k, v = (c.reshape(-1, *c.shape[2:]) for c in (k, v))
    return head(cfg, params, x), {"k": k, "v": v}
