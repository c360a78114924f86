"""The places where a layer may meet other devices, as the block calls them, with
their one-device versions: the model never imports parallel/.

- Tensor boundaries: a tensor-parallel region (attention, MLP, LM head) starts with
  `enter` and ends with `exit`; the embedding lookup and the loss may split the
  vocabulary. Across devices: parallel/tensor.py (explicit collectives) and
  parallel/partitioned.py (sharding constraints for XLA's partitioner).
- The attention boundary: `attend` sees this device's queries and may need other
  devices' keys (context parallelism: parallel/context.py).
- The expert boundary: an MoE layer's balance losses and capacity are over the
  micro-batch's tokens on every data-parallel rank (`tokens`, `before`), and its
  experts may live on other devices (`experts`: expert parallelism, parallel/expert.py).

On one device each boundary is the identity, and `attend` is the attention interface.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from ultrajax.model.attention.backends import attend, output_residual
from ultrajax.model.nn import cross_entropy, cross_entropy_grad
from ultrajax.model.ops import lookup


@dataclass(frozen=True)
class TensorBoundary:
    """Tensor parallelism's boundaries, on one device (size 1): identities."""

    size: int = 1
    # the matmuls reading one region input run as one (ops.dense_joined): under the
    # partitioner their input gradient is then reduced once, not once per matmul
    join_inputs: bool = False

    def enter(self, x):
        """Residual stream -> input of a TP region."""
        return x

    def exit(self, x):
        """Output of a TP region (partial sums across devices) -> residual stream."""
        return x

    def sum(self, x):
        """Sum of per-rank parts (vocabulary-parallel loss terms)."""
        return x

    def max(self, x):
        """Max over ranks; used only for numerical stability, so no gradient."""
        return jax.lax.stop_gradient(x)

    def vocab_start(self, local_vocab: int):
        return 0

    def constrain(self, x, names):
        """Where an activation with these logical axis names lives (here: nowhere else)."""
        return x

    def embed(self, table, tokens, dtype):
        return lookup(table, tokens, dtype)

    def cross_entropy(self, logits, targets):
        return cross_entropy(logits, targets, self)

    def cross_entropy_grad(self, logits, targets, mask, dtype):
        return cross_entropy_grad(logits, targets, mask, self, dtype)


@dataclass(frozen=True)
class AttentionBoundary:
    """Attention over this device's whole sequence: the attention interface."""

    blocks: tuple | None = None  # model.attention_blocks: the Pallas tiles (None: defaults)
    fused_bwd: bool = False  # model.attention_backward=fused: the kernel's one backward

    def attend(self, q, k, v, segment_ids, implementation: str):
        return attend(q, k, v, segment_ids, implementation=implementation, blocks=self.blocks,
                      fused_bwd=self.fused_bwd)  # fmt: skip

    def output_residual(self, implementation: str, segment_ids, seq_len: int) -> str:
        """What the attention keeps of its output for its backward (backends.py)."""
        return output_residual(implementation, segment_ids, seq_len)


@dataclass(frozen=True)
class ExpertBoundary:
    """An MoE layer's reach beyond this device's tokens and experts: none here."""

    micro_batches: int = 1  # the step's, over which a balance loss is averaged
    ranks: int = 1  # the devices that split the micro-batch's tokens (this one alone)
    copies: int = 1  # the devices that hold these same tokens (tensor parallelism's)

    def same(self, x):
        """A statistic the `copies` computed alike, as one value."""
        return x

    def tokens(self, x):
        """Sum of a per-device count over the ranks that split the micro-batch's tokens."""
        return x

    def before(self, counts):
        """Each expert's assignments on the ranks holding earlier tokens: none."""
        return jnp.zeros_like(counts)

    def experts(self, mlp, xs, sorted_e, sizes):
        """mlp(rows, group sizes) over the assignments sorted by expert (`sorted_e` each
        row's expert, `sizes` each expert's rows): every expert is here."""
        return mlp(xs, sizes)


SINGLE = TensorBoundary()
LOCAL = AttentionBoundary()
ONE_DEVICE = ExpertBoundary()
