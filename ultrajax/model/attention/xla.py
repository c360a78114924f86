"""The one plain-jnp attention: the `xla` backend, the ring's pairs of chunks
(parallel/context.py), and the reference every other backend and kernel is tested
against (tests/test_attention.py, tests/test_kernels.py).

Scores in fp32, grouped-query attention by reshaping, a finite NEG_INF for masked
scores (a query that sees nothing gives zeros, not NaN), and the log-sum-exp beside the
output (ring attention merges blocks with it; the kernels return it too).
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


def visible(q_segment_ids, kv_segment_ids, length, kv_length, causal=True, q_offset=0):
    """(batch|1, 1, 1, q, k) bool: which keys each query sees. `causal` may be a traced
    flag (the ring decides per pair of chunks); query i sits at key index i + q_offset;
    with segment ids, only keys of its own document."""
    ok = (jnp.arange(length)[:, None] + q_offset) >= jnp.arange(kv_length)[None, :]
    if causal is not True:  # a traced flag, or False
        ok = ok | jnp.logical_not(causal)
    if q_segment_ids is None:
        return ok[None, None, None]
    same = q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]
    return (same & ok)[:, None, None]


def scores(q, k, seen):
    """(queries grouped per KV head (b, t, kv, g, d), fp32 scores (b, kv, g, t, s) scaled
    by head_dim^-0.5 and NEG_INF where not `seen`)."""
    b, t, h, d = q.shape
    kv = k.shape[2]
    qg = q.reshape(b, t, kv, h // kv, d)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * d**-0.5
    return qg, jnp.where(seen, s, NEG_INF)


def reference(q, k, v, q_segment_ids=None, kv_segment_ids=None, *, causal=True, q_offset=0):
    """(out (b, t, h, d) fp32, lse (b, h, t) fp32, NEG_INF where a query sees nothing).

    q: (b, t, h, d); k, v: (b, s, kv, d); segment ids (b, t) and (b, s), equal ids see
    each other (packed documents). The log-sum-exp is computed beside the softmax; where
    nobody reads it (the xla backend) XLA drops it."""
    b, t, h, d = q.shape
    seen = visible(q_segment_ids, kv_segment_ids, t, k.shape[1], causal, q_offset)
    _, s = scores(q, k, seen)
    probs = jnp.where(seen, jax.nn.softmax(s, axis=-1), 0.0).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
    lse = jnp.where(seen.any(-1), jax.nn.logsumexp(s, axis=-1), NEG_INF)
    return out.reshape(b, t, h, d), lse.reshape(b, h, t)


def xla_attention(q, k, v, segment_ids=None, q_offset=0):
    """The `xla` backend: `reference`'s output in v's dtype (s² fp32 scores stored)."""
    out, _ = reference(q, k, v, segment_ids, segment_ids, q_offset=q_offset)
    return out.astype(v.dtype)
