"""Memory-efficient attention in plain XLA: keys in blocks with an online softmax."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from ultrajax.kernels.varying import vary_like
from ultrajax.model import remat
from ultrajax.model.attention.xla import NEG_INF

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

    init = vary_like(
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
    # named, so that selective recomputation keeps them (model/remat.py)
    out, lse = checkpoint_name(out, remat.ATTN_SAVED), checkpoint_name(lse, remat.ATTN_SAVED)
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

    zero = vary_like(jnp.zeros(qg.shape, jnp.float32), q, k, v, segment_ids, dout)
    dq, (dk, dv) = jax.lax.scan(body, zero, blocks)
    n = dk.shape[0]
    dk = dk.transpose(1, 0, 2, 3, 4).reshape(b, n * BLOCK, kv, d)[:, : k.shape[1]]
    dv = dv.transpose(1, 0, 2, 3, 4).reshape(b, n * BLOCK, kv, d)[:, : k.shape[1]]
    dq = dq.reshape(b, t, h, d)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


blocked_attention.defvjp(_blocked_fwd, _blocked_bwd)
