"""The one attention dispatch point: every implementation sees the same inputs.

q: (batch, length, heads, head_dim); k, v: (batch, length, kv_heads, head_dim);
segment_ids: (batch, length) ints, 0 = padding, equal ids may attend to each
other (packed documents). Attention is causal in the index along `length`.
Later back-ends (Pallas, Triton, ring attention for context parallelism) plug
in here without touching the model.
"""

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


def cudnn_attention(q, k, v, segment_ids=None):
    """cuDNN flash attention through jax.nn (GPU only; BTNH layout, GQA native)."""
    m = None if segment_ids is None else mask(segment_ids, q.shape[1])
    return jax.nn.dot_product_attention(
        q, k, v, mask=m, is_causal=segment_ids is None, implementation="cudnn"
    )


IMPLEMENTATIONS = {"xla": xla_attention, "cudnn": cudnn_attention}


def attend(q, k, v, segment_ids=None, *, implementation: str = "xla", q_offset=0):
    """Dispatch to the configured implementation (config: model.attention).

    `q_offset` places the queries after earlier keys (KV-cache decoding; xla only)."""
    try:
        fn = IMPLEMENTATIONS[implementation]
    except KeyError:
        raise ValueError(
            f"model.attention: unknown implementation {implementation!r}; "
            f"use one of {', '.join(IMPLEMENTATIONS)}"
        ) from None
    if implementation == "xla":
        return fn(q, k, v, segment_ids, q_offset)
    return fn(q, k, v, segment_ids)
