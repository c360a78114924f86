"""The training loss of one micro-batch: summed next-token NLL and its target count.

Sums, not means: gradient accumulation divides the sum over every micro-batch by
the total count of target tokens (GUIDE section 6), so micro-batches holding
different numbers of valid tokens weigh each token the same.
"""

from __future__ import annotations

from ultrajax.batch import Batch
from ultrajax.config import Config
from ultrajax.model import forward
from ultrajax.parallel.tensor import SINGLE


def loss_sum(cfg: Config, params, mb: Batch, *, tp=SINGLE, prepare=None, gathers=False):
    """(sum of token NLLs, count of target tokens) for one micro-batch (rows, seq_len)."""
    segments = mb.segment_ids if cfg.data.cross_doc_mask else None
    logits = forward(
        cfg.model,
        params,
        mb.inputs,
        mb.positions,
        segments,
        tp=tp,
        prepare=prepare,
        gathers=gathers,
    )
    mask = mb.loss_mask
    nll = tp.cross_entropy(logits, mb.targets) * mask
    return nll.sum(), mask.sum()
