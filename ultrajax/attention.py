"""The one attention interface: every backend sees the same inputs and says what it can do.

q: (batch, length, heads, head_dim); k, v: (batch, kv_length, kv_heads, head_dim);
segment_ids: (batch, length) ints, 0 = padding, equal ids may attend to each other
(packed documents); attention is causal in the index along `length`; `q_offset` places
the queries after earlier keys (decoding against a KV cache).

`BACKENDS` is the one table of what each backend supports. Config validation, the
trainer, the memory model and the analyzer read it instead of comparing names;
`model.attention: auto` picks from it (`resolve`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from ultrajax.weights import vma

NEG_INF = -1e30  # finite, so a fully masked row (padding) gives zeros, not NaN


@dataclass(frozen=True)
class Backend:
    name: str
    fn: Callable  # (q, k, v, segment_ids, q_offset) -> out
    gpu_only: bool  # needs a GPU to compile
    segments: bool  # packed documents without a dense (length x length) mask
    q_offset: bool  # queries after earlier keys (KV-cache decoding)
    flash: bool  # never stores the (length x length) scores; saves the log-sum-exp instead
    note: str
    tiles: bool = False  # takes model.attention_blocks (the Pallas kernel's tile sizes)
    # a GPU kernel: off a GPU it cannot run (gpu_only) or runs interpreted, for tests only,
    # so its speed and memory there say nothing (analyze compiles xla in its place)
    gpu_kernel: bool = False


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


BLOCK = 512  # keys per block of the blocked attention (its working set: memory.KERNEL_WORK)


def _blocked_parts(q, k, v, segment_ids, block):
    """Shapes for the blocked attention: queries grouped per KV head, keys in blocks."""
    b, t, h, d = q.shape
    kv = k.shape[2]
    n = -(-t // block)
    pad = n * block - t
    seg = segment_ids if segment_ids is not None else jnp.ones((b, t), jnp.int32)
    kp = jnp.pad(k, ((0, 0), (0, pad), (0, 0), (0, 0)))
    vp = jnp.pad(v, ((0, 0), (0, pad), (0, 0), (0, 0)))
    kseg = jnp.pad(seg, ((0, 0), (0, pad)), constant_values=-1)  # padding sees nothing
    blocks = (
        kp.reshape(b, n, block, kv, d).transpose(1, 0, 2, 3, 4),
        vp.reshape(b, n, block, kv, d).transpose(1, 0, 2, 3, 4),
        kseg.reshape(b, n, block).transpose(1, 0, 2),
        jnp.arange(n * block).reshape(n, block),
    )
    return q.reshape(b, t, kv, h // kv, d), seg, blocks


def _block_scores(qg, seg, kb, ks, kpos, scale):
    """One key block's scores (b, kv, g, t, block) in fp32, masked."""
    s = jnp.einsum("btkgd,bskd->bkgts", qg, kb, preferred_element_type=jnp.float32) * scale
    visible = (jnp.arange(qg.shape[1])[:, None] >= kpos[None, :])[None] & (
        seg[:, :, None] == ks[:, None, :]
    )
    return s, visible[:, None, None]


def block_grads(qg, kb, vb, dog, p, delta, scale):
    """The flash-attention backward of one block of keys, fp32: (dq (b, t, kv, g, d), dk,
    dv) from the block's probabilities p (b, kv, g, t, s), recomputed from the final
    log-sum-exp, and delta = rowsum(dout * out) (b, kv, g, t). Blocked attention and ring
    attention's pairs (parallel/context.py) both run it."""
    f32 = jnp.float32
    dv = jnp.einsum("bkgts,btkgd->bskd", p.astype(dog.dtype), dog, preferred_element_type=f32)
    dp = jnp.einsum("btkgd,bskd->bkgts", dog, vb, preferred_element_type=f32)
    ds = p * (dp - delta[..., None]) * scale
    dq = jnp.einsum("bkgts,bskd->btkgd", ds.astype(kb.dtype), kb, preferred_element_type=f32)
    dk = jnp.einsum("bkgts,btkgd->bskd", ds.astype(qg.dtype), qg, preferred_element_type=f32)
    return dq, dk, dv


@jax.custom_vjp
def blocked_attention(q, k, v, segment_ids=None):
    """Memory-efficient attention in plain XLA: keys in blocks of BLOCK with an online
    softmax (Rabe & Staats 2021; the flash algorithm without a kernel), so the scores of
    one block exist at a time, forward and backward (which recomputes them)."""
    return _blocked_forward(q, k, v, segment_ids)[0]


def _typed(tree, *inputs):
    """Loop-carry zeros typed as varying wherever the inputs do (inside shard_map: the
    data, sequence or pipeline axes), so the carry keeps one type through the loop."""
    axes = tuple(sorted(set().union(*(vma(x) for x in inputs if x is not None))))
    if not axes:
        return tree
    return jax.tree.map(lambda z: jax.lax.pcast(z, axes, to="varying"), tree)


def _blocked_forward(q, k, v, segment_ids):
    b, t, h, d = q.shape
    qg, seg, blocks = _blocked_parts(q, k, v, segment_ids, BLOCK)
    kv, g = qg.shape[2], qg.shape[3]

    def body(carry, blk):
        acc, m, den = carry
        kb, vb, ks, kpos = blk
        s, visible = _block_scores(qg, seg, kb, ks, kpos, d**-0.5)
        s = jnp.where(visible, s, NEG_INF)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.where(visible, jnp.exp(s - m_new[..., None]), 0.0)
        corr = jnp.exp(m - m_new)
        pv = jnp.einsum("bkgts,bskd->bkgtd", p.astype(v.dtype), vb,
                        preferred_element_type=jnp.float32)  # fmt: skip
        return (acc * corr[..., None] + pv, m_new, den * corr + p.sum(-1)), None

    init = _typed(
        (
            jnp.zeros((b, kv, g, t, d), jnp.float32),
            jnp.full((b, kv, g, t), NEG_INF, jnp.float32),
            jnp.zeros((b, kv, g, t), jnp.float32),
        ),
        q, k, v, segment_ids,
    )  # fmt: skip
    (acc, m, den), _ = jax.lax.scan(body, init, blocks)
    seen = den > 0
    safe = jnp.where(seen, den, 1.0)
    out = jnp.where(seen[..., None], acc / safe[..., None], 0.0)
    lse = jnp.where(seen, m + jnp.log(safe), NEG_INF)
    out = out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, d).astype(q.dtype)
    return out, lse


def _blocked_fwd(q, k, v, segment_ids):
    out, lse = _blocked_forward(q, k, v, segment_ids)
    return out, (q, k, v, segment_ids, out, lse)


def _blocked_bwd(res, dout):
    q, k, v, segment_ids, out, lse = res
    b, t, h, d = q.shape
    qg, seg, blocks = _blocked_parts(q, k, v, segment_ids, BLOCK)
    kv, g = qg.shape[2], qg.shape[3]
    dog = dout.reshape(b, t, kv, g, d)
    delta = jnp.einsum("btkgd,btkgd->bkgt", dog.astype(jnp.float32), out.reshape(b, t, kv, g, d)
                       .astype(jnp.float32))  # fmt: skip
    scale = d**-0.5

    def body(dq, blk):
        kb, vb, ks, kpos = blk
        s, visible = _block_scores(qg, seg, kb, ks, kpos, scale)
        p = jnp.where(visible, jnp.exp(s - lse[..., None]), 0.0)
        dq_b, dk, dv = block_grads(qg, kb, vb, dog, p, delta, scale)
        return dq + dq_b, (dk, dv)

    zero = _typed(jnp.zeros(qg.shape, jnp.float32), q, k, v, segment_ids, dout)
    dq, (dk, dv) = jax.lax.scan(body, zero, blocks)
    n = dk.shape[0]
    dk = dk.transpose(1, 0, 2, 3, 4).reshape(b, n * BLOCK, kv, d)[:, : k.shape[1]]
    dv = dv.transpose(1, 0, 2, 3, 4).reshape(b, n * BLOCK, kv, d)[:, : k.shape[1]]
    dq = dq.reshape(b, t, h, d)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


blocked_attention.defvjp(_blocked_fwd, _blocked_bwd)


QUERY_TILES = 4  # query tiles of the tiled attention: 10 of 16 score blocks are computed
TILE_ROWS = 4  # batch rows per iteration of its loop: one group's scores stay in cache


def _tiled_rows(b: int) -> int:
    """Rows per loop iteration: TILE_ROWS where the batch is this device's own (one
    device, or inside shard_map), else all of them (a loop over rows the partitioner
    splits over devices would gather them)."""
    mesh = jax.sharding.get_abstract_mesh()
    shared = [n for n, size in zip(mesh.axis_names, mesh.axis_sizes, strict=True)
              if size > 1 and n not in mesh.manual_axes]  # fmt: skip
    rows = b if shared else min(TILE_ROWS, b)
    return rows if b % rows == 0 else b


def _tile_probs(qh, kh, visible, lo, hi):
    """Softmax probabilities (r, kv, g, hi - lo, hi) of queries lo:hi over keys :hi."""
    s = jnp.einsum("rkgtd,rksd->rkgts", qh[:, :, :, lo:hi], kh[:, :, :hi],
                   preferred_element_type=jnp.float32)  # fmt: skip
    s = jnp.where(visible[:, None, None, lo:hi, :hi], s, NEG_INF)
    e = jnp.exp(s - s.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _tile_bounds(t: int) -> list[tuple[int, int]]:
    n = QUERY_TILES if t % QUERY_TILES == 0 else 1
    return [(i * t // n, (i + 1) * t // n) for i in range(n)]


def _tile_forward(qh, kh, vh, visible):
    """One row group's output (r, kv, g, t, d). qh (r, kv, g, t, d) already scaled by
    head_dim^-0.5, kh and vh (r, kv, s, d), visible (r, t, s)."""
    outs = []
    for lo, hi in _tile_bounds(qh.shape[3]):
        p = _tile_probs(qh, kh, visible, lo, hi).astype(vh.dtype)
        outs.append(jnp.einsum("rkgts,rksd->rkgtd", p, vh[:, :, :hi]))
    return jnp.concatenate(outs, axis=3)


def _tile_backward(qh, kh, vh, visible, o, do):
    """One row group's (dq, dk, dv) in fp32, each tile's probabilities recomputed."""
    f32 = jnp.float32

    def mm(eq, x, y):
        return jnp.einsum(eq, x, y, preferred_element_type=f32)

    dqs, dk, dv = [], jnp.zeros(kh.shape, f32), jnp.zeros(vh.shape, f32)
    for lo, hi in _tile_bounds(qh.shape[3]):
        p = _tile_probs(qh, kh, visible, lo, hi).astype(vh.dtype)
        dot = do[:, :, :, lo:hi]
        # per tile, not sliced from one whole-group delta: XLA:CPU fuses it better (1.4x)
        delta = (dot.astype(f32) * o[:, :, :, lo:hi].astype(f32)).sum(-1, keepdims=True)
        dv = dv.at[:, :, :hi].add(mm("rkgts,rkgtd->rksd", p, dot))
        ds = (p * (mm("rkgtd,rksd->rkgts", dot, vh[:, :, :hi]) - delta)).astype(qh.dtype)
        dqs.append(mm("rkgts,rksd->rkgtd", ds, kh[:, :, :hi]))
        dk = dk.at[:, :, :hi].add(mm("rkgts,rkgtd->rksd", ds, qh[:, :, :, lo:hi]))
    return jnp.concatenate(dqs, axis=3), dk, dv


def _grouped(rows, *xs):
    return tuple(x.reshape(x.shape[0] // rows, rows, *x.shape[1:]) for x in xs)


def _ungrouped(*xs):
    return tuple(x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]) for x in xs)


@jax.custom_vjp
def tiled_attention(q, k, v, segment_ids=None):
    """Causal attention in tiles, plain XLA, for XLA:CPU: a loop over groups of rows, and
    in each, query tiles that see the keys up to their end. The work above the diagonal
    is skipped and one tile's scores at a time stay in cache; the backward recomputes
    them (the flash algorithm's trade, Dao 2022), so the s² scores are never stored.
    2.5x faster than `xla` on this repository's CPU shape (benchmarks/RESULTS.md)."""
    return _tiled_fwd(q, k, v, segment_ids)[0]


def _tiled_layout(q, k, v, segment_ids):
    """Head-major q (b, kv, g, t, d) scaled, k and v (b, kv, s, d), visible (b, t, s):
    transposed once so every product in the loop is a plain batched matmul."""
    b, t, h, d = q.shape
    kv = k.shape[2]
    qh = (q * d**-0.5).reshape(b, t, kv, h // kv, d).transpose(0, 2, 3, 1, 4)
    visible = jnp.broadcast_to(mask(segment_ids, t)[:, 0], (b, t, k.shape[1]))
    return qh, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), visible


def _tiled_fwd(q, k, v, segment_ids):
    b, t, h, d = q.shape
    rows = _tiled_rows(b)
    qh, kh, vh, visible = _tiled_layout(q, k, v, segment_ids)
    (o,) = _ungrouped(jax.lax.map(lambda x: _tile_forward(*x), _grouped(rows, qh, kh, vh, visible)))
    out = o.transpose(0, 3, 1, 2, 4).reshape(b, t, h, d)
    return out, (qh, kh, vh, visible, o)


def _tiled_bwd(res, dout):
    qh, kh, vh, visible, o = res
    b, kv, g, t, d = qh.shape
    rows = _tiled_rows(b)
    do = dout.reshape(b, t, kv, g, d).transpose(0, 2, 3, 1, 4)
    groups = _grouped(rows, qh, kh, vh, visible, o, do)
    dq, dk, dv = _ungrouped(*jax.lax.map(lambda x: _tile_backward(*x), groups))
    dq = (dq * d**-0.5).transpose(0, 3, 1, 2, 4).reshape(b, t, kv * g, d)
    dk, dv = dk.transpose(0, 2, 1, 3), dv.transpose(0, 2, 1, 3)
    return dq.astype(dout.dtype), dk.astype(kh.dtype), dv.astype(vh.dtype), None


tiled_attention.defvjp(_tiled_fwd, _tiled_bwd)


def cudnn_attention(q, k, v, segment_ids=None, q_offset=0):
    """cuDNN flash attention through jax.nn (GPU only; BTNH layout, GQA native). Packed
    documents need a dense causal-and-same-document mask here."""
    m = None if segment_ids is None else mask(segment_ids, q.shape[1])
    return jax.nn.dot_product_attention(
        q, k, v, mask=m, is_causal=segment_ids is None, implementation="cudnn"
    )


def pallas_attention(q, k, v, segment_ids=None, q_offset=0, *, blocks=None):
    """Our Pallas flash attention (kernels/flash_attention.py): segment ids per block, no
    dense mask. Interpreted on a CPU (slow: for tests), compiled through Triton on a GPU.
    `blocks`: model.attention_blocks ([q, k, q_bwd, k_bwd]; None: the kernel's defaults)."""
    from ultrajax.kernels.flash_attention import BlockSizes, flash_attention

    interpret = jax.default_backend() != "gpu"
    out, _ = flash_attention(
        q, k, v, segment_ids, segment_ids, blocks=BlockSizes.of(blocks), interpret=interpret
    )
    return out


BACKENDS = {
    b.name: b
    for b in (
        Backend("xla", xla_attention, False, False, True, False, "plain einsum, s² fp32 scores"),
        Backend(
            "cudnn", cudnn_attention, True, False, False, True, "cuDNN via jax.nn", gpu_kernel=True
        ),
        Backend(
            "pallas",
            pallas_attention,
            False,
            True,
            False,
            True,
            "kernels/, Pallas",
            tiles=True,
            gpu_kernel=True,
        ),
        Backend(
            "blocked",
            lambda q, k, v, seg=None: blocked_attention(q, k, v, seg),
            False,
            True,
            False,
            True,
            "key blocks with an online softmax, plain XLA",
        ),
        Backend(
            "tiled",
            lambda q, k, v, seg=None: tiled_attention(q, k, v, seg),
            False,
            True,
            False,
            True,
            "causal query tiles, probabilities recomputed, plain XLA",
        ),
    )
}
CHOICES = ("auto", *BACKENDS)


def resolve(name: str, platform: str, packed: bool, seq_len: int | None = None) -> str:
    """The backend `model.attention` means on `platform` ("gpu", "cpu", ...).

    auto, on a GPU: cuDNN for causal-only masks, our Pallas kernel for packed documents
    (cuDNN needs a dense mask there and was slower: benchmarks/RESULTS.md). Elsewhere the
    tiled XLA attention up to one block of keys (`seq_len <= BLOCK`: 2.5x the plain one's
    speed on XLA:CPU, benchmarks/RESULTS.md), and the blocked one beyond, whose working
    set does not grow with the square of the sequence."""
    if name != "auto":
        return name
    if platform == "gpu":
        return "pallas" if packed else "cudnn"
    return "tiled" if seq_len is not None and seq_len <= BLOCK else "blocked"


def problem(name: str, platform: str) -> str | None:
    """Why backend `name` cannot run on `platform`, or None."""
    backend = BACKENDS[name]
    if backend.gpu_only and platform != "gpu":
        return f"model.attention={name} needs a GPU (backend is {platform}); use auto or xla"
    return None


def attend(q, k, v, segment_ids=None, *, implementation: str = "xla", q_offset=0, blocks=None):
    """Dispatch to a backend of the table; `auto` resolves for the platform compiling.
    `blocks` (model.attention_blocks) reaches the backends that take tile sizes."""
    if implementation == "auto":
        implementation = resolve(
            "auto", jax.default_backend(), segment_ids is not None, seq_len=k.shape[1]
        )
    try:
        backend = BACKENDS[implementation]
    except KeyError:
        raise ValueError(
            f"model.attention: unknown implementation {implementation!r}; "
            f"use one of {', '.join(CHOICES)}"
        ) from None
    tiles = {"blocks": blocks} if backend.tiles and blocks is not None else {}
    if isinstance(q_offset, int) and q_offset == 0:
        return backend.fn(q, k, v, segment_ids, **tiles)
    if not backend.q_offset:
        raise ValueError(f"attention backend {implementation!r} cannot place queries after keys")
    return backend.fn(q, k, v, segment_ids, q_offset, **tiles)
