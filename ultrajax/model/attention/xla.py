"""Plain einsum attention and its mask: the reference every other backend equals."""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -1e30  # finite, so a fully masked row (padding) gives zeros, not NaN


def mask(segment_ids: jax.Array | None, length: int, kv_length=None, q_offset=0) -> jax.Array:
    """Boolean (batch|1, 1, q, k) mask: causal, and within one segment.

    Query i sits at index i + q_offset of the keys (decoding against a KV cache:
    the cache slots after the current position are masked as future tokens)."""
    kv_length = length if kv_length is None else kv_length
    causal = (jnp.arange(length)[:, None] + q_offset) >= jnp.arange(kv_length)[None, :]
    if segment_ids is None:
        return causal[None, None]
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return (causal[None] & same)[:, None]


def xla_attention(q, k, v, segment_ids=None, q_offset=0):
    """Plain einsum attention: scores and softmax in fp32, grouped-query by reshaping."""
    b, t, h, d = q.shape
    kv = k.shape[2]
    q = q.reshape(b, t, kv, h // kv, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)
    scores = scores * (d**-0.5)
    m = mask(segment_ids, t, k.shape[1], q_offset)[:, :, None]  # (b, 1, 1, t, s)
    scores = jnp.where(m, scores, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(m, probs, 0.0).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(b, t, h, d)
