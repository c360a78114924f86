"""Decoding with a KV cache: the same layers, written into and read from a cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ultrajax.config.schema import ModelConfig
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

    def layer(x, inputs):
        p, ck, cv = inputs
        return block(cast(p, dtype), x, positions, None, cfg=cfg, cache=(ck, cv, start))

    x, (k, v) = jax.lax.scan(layer, x, (params["layers"], cache["k"], cache["v"]))
    return head(cfg, params, x), {"k": k, "v": v}
