"""The GPU kernels behind the attention interface: cuDNN through jax.nn, and our
Pallas flash attention (kernels/flash_attention.py)."""

from __future__ import annotations

import jax

from ultrajax.kernels import flash_attention as fa
from ultrajax.model import remat
from ultrajax.model.attention.xla import mask


def cudnn_attention(q, k, v, segment_ids=None, q_offset=0):
    """cuDNN flash attention through jax.nn (GPU only; BTNH layout, GQA native). Packed
    documents need a dense causal-and-same-document mask here."""
    m = None if segment_ids is None else mask(segment_ids, q.shape[1])
    return jax.nn.dot_product_attention(
        q, k, v, mask=m, is_causal=segment_ids is None, implementation="cudnn"
    )


def pallas_attention(q, k, v, segment_ids=None, q_offset=0, *, blocks=None, fused_bwd=False,
                     per_device=None):  # fmt: skip
    """Our Pallas flash attention (kernels/flash_attention.py): segment ids per block, no
    dense mask. Interpreted on a CPU (slow: for tests), compiled through Triton on a GPU.
    `blocks`: model.attention_blocks ([q, k, q_bwd, k_bwd]; None: the kernel's defaults);
    `fused_bwd`: model.attention_backward=fused (one backward kernel); `per_device`: the
    kernels' own shard_map (kernels/flash_attention.py, parallel/context.py)."""
    interpret = jax.default_backend() != "gpu"
    out, _ = fa.flash_attention(
        q,
        k,
        v,
        segment_ids,
        segment_ids,
        blocks=fa.BlockSizes.of(blocks, q.shape[-1], q.dtype.itemsize, fused_bwd),
        interpret=interpret,
        saved_as=remat.ATTN_SAVED,
        per_device=per_device,
    )
    return out
