"""What the flash attention kernels take, checked before anything is padded: inputs
that do not fit each other came back as zeros (segment ids shorter than the sequence, a
value head_dim smaller than the query's), or failed deep inside with a traceback (no kv
segment ids, an empty sequence, a ring pair not cut into whole tiles)."""

from __future__ import annotations

import jax.numpy as jnp


def check(q, k, v, q_segment_ids, kv_segment_ids) -> None:
    """q (batch, length, heads, head_dim); k and v one shape (batch, kv_length, kv_heads,
    head_dim), kv_heads dividing heads; segment ids both or neither, (batch, length) and
    (batch, kv_length)."""
    b, t, h, d = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k {k.shape} and v {v.shape} must have one shape")
    if k.ndim != 4 or (k.shape[0], k.shape[3]) != (b, d):
        raise ValueError(f"q {q.shape} and k {k.shape}: batch and head_dim must agree")
    if t == 0 or k.shape[1] == 0:
        raise ValueError(f"q {q.shape}, k {k.shape}: an empty sequence has nothing to attend")
    if h % k.shape[2]:
        raise ValueError(f"heads ({h}) must be a multiple of kv_heads ({k.shape[2]})")
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("q_segment_ids and kv_segment_ids go together: give both or neither")
    if q_segment_ids is not None and (
        q_segment_ids.shape != (b, t) or kv_segment_ids.shape != (b, k.shape[1])
    ):
        raise ValueError(
            f"segment ids {q_segment_ids.shape} and {kv_segment_ids.shape} must be "
            f"{(b, t)} and {(b, k.shape[1])}, one per token"
        )


def check_pair(q, k, blocks) -> None:
    """A ring pair's lengths are whole tiles (the caller, parallel/context.py, falls back
    to plain XLA where they are not)."""
    if q.shape[1] % blocks.q or k.shape[1] % blocks.k:
        raise ValueError(
            f"a pair's lengths ({q.shape[1]}, {k.shape[1]}) must be multiples of the "
            f"tiles ({blocks.q}, {blocks.k})"
        )


def pad(q, k, v, q_segment_ids, kv_segment_ids, multiple: int):
    """q, k, v and int32 segment ids (all ones where none are given) padded along the
    sequence to a multiple of `multiple` (whole tiles); the padded rows and columns get
    segment ids below every real one, so padding matches no token whatever ids a caller
    uses (a fixed -1 matched queries whose id was -1 to the zero-filled padded keys)."""
    if q_segment_ids is None:
        q_segment_ids = jnp.ones(q.shape[:2], jnp.int32)
        kv_segment_ids = jnp.ones(k.shape[:2], jnp.int32)
    qs, ks = q_segment_ids.astype(jnp.int32), kv_segment_ids.astype(jnp.int32)
    low = jnp.minimum(qs.min(), ks.min())
    return (_pad(q, multiple), _pad(k, multiple), _pad(v, multiple),
            _pad(qs, multiple, low - 2), _pad(ks, multiple, low - 1))  # fmt: skip


def _pad(x, multiple, value=0):
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, (-x.shape[1]) % multiple)
    return jnp.pad(x, widths, constant_values=value) if widths[1][1] else x
