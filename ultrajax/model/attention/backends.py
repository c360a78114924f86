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

from ultrajax.model.attention.blocked import BLOCK, blocked_attention
from ultrajax.model.attention.gpu import cudnn_attention, pallas_attention
from ultrajax.model.attention.tiled import tiled_attention
from ultrajax.model.attention.xla import xla_attention


@dataclass(frozen=True)
class Backend:
    name: str
    fn: Callable  # (q, k, v, segment_ids, q_offset) -> out
    gpu_only: bool  # needs a GPU to compile
    segments: bool  # packed documents without a dense (length x length) mask
    q_offset: bool  # queries after earlier keys (KV-cache decoding)
    flash: bool  # never stores the (length x length) scores; saves the log-sum-exp instead
    note: str
    tiles: bool = False  # takes model.attention_blocks and attention_backward (Pallas's)
    # a GPU kernel: off a GPU it cannot run (gpu_only) or runs interpreted, for tests only,
    # so its speed and memory there say nothing (analyze compiles xla in its place)
    gpu_kernel: bool = False
    # what the memory model reads (cost/activations.py): tiled keeps a copy of its output
    # beside the one wo reads, and no log-sum-exp; each holds scores while it runs, per
    # row group (tiled) or key block (blocked)
    output_copy: bool = False
    lse: bool = True
    holds: str = ""  # "" | "row groups" | "key blocks"

    @property
    def output_residual(self) -> str:
        """What it keeps of its own output for its backward pass: "saved" (with its
        log-sum-exp, under the name model/remat.py ATTN_SAVED or, cuDNN's, by its
        primitive), "kept" (unnamed: tiled), "" (none: the plain attention, whose
        backward reads its probabilities)."""
        if not self.flash:
            return ""
        return "saved" if self.lse else "kept"


BACKENDS = {
    b.name: b
    for b in (
        Backend("xla", xla_attention, False, False, True, False, "plain einsum, s² fp32 scores"),
        Backend("cudnn", cudnn_attention, True, False, False, True, "cuDNN via jax.nn",
                gpu_kernel=True),
        Backend("pallas", pallas_attention, False, True, False, True, "kernels/, Pallas",
                tiles=True, gpu_kernel=True),
        Backend("blocked", lambda q, k, v, seg=None: blocked_attention(q, k, v, seg),
                False, True, False, True, "key blocks with an online softmax, plain XLA",
                holds="key blocks"),
        Backend("tiled", lambda q, k, v, seg=None: tiled_attention(q, k, v, seg),
                False, True, False, True,
                "causal query tiles, probabilities recomputed, plain XLA",
                output_copy=True, lse=False, holds="row groups"),
    )
}  # fmt: skip
CHOICES = ("auto", *BACKENDS)


def resolve(
    name: str, platform: str, packed: bool, seq_len: int | None = None, partly_manual=False
) -> str:
    """The backend `model.attention` means on `platform` ("gpu", "cpu", ...).

    auto, on a GPU: cuDNN for causal-only masks, our Pallas kernel for packed documents
    (cuDNN needs a dense mask there and was slower: benchmarks/RESULTS.md) and where the
    attention runs `partly_manual`: in a shard_map manual over some mesh axes while the
    partitioner splits it over others, where jax's custom partitioning of cuDNN's call
    fails to compile (jax 0.10; parallel/layout.py, `partly_manual`). Elsewhere the
    tiled XLA attention up to one block of keys (`seq_len <= BLOCK`: 2.5x the plain one's
    speed on XLA:CPU, benchmarks/RESULTS.md), and the blocked one beyond, whose working
    set does not grow with the square of the sequence."""
    if name != "auto":
        return name
    if platform == "gpu":
        return "pallas" if packed or partly_manual else "cudnn"
    return "tiled" if seq_len is not None and seq_len <= BLOCK else "blocked"


def output_residual(name: str, segment_ids, seq_len: int) -> str:
    """`Backend.output_residual` of the backend `name` means here, while tracing (`auto`
    resolved for the platform compiling, as `attend` does)."""
    packed = segment_ids is not None
    return BACKENDS[resolve(name, jax.default_backend(), packed, seq_len)].output_residual


def problem(name: str, platform: str) -> str | None:
    """Why backend `name` cannot run on `platform`, or None."""
    backend = BACKENDS[name]
    if backend.gpu_only and platform != "gpu":
        return f"model.attention={name} needs a GPU (backend is {platform}); use auto or xla"
    return None


def attend(q, k, v, segment_ids=None, *, implementation: str = "xla", q_offset=0, blocks=None,
           fused_bwd: bool = False, partly_manual: bool = False, per_device=None):  # fmt: skip
    """Dispatch to a backend of the table; `auto` resolves for the platform compiling
    (and `partly_manual`, `resolve`'s). `blocks` (model.attention_blocks), `fused_bwd`
    (model.attention_backward=fused) and `per_device` (the kernels' own shard_map,
    parallel/context.py) reach the backends that take tile sizes."""
    if implementation == "auto":
        packed = segment_ids is not None
        implementation = resolve(
            "auto", jax.default_backend(), packed, seq_len=k.shape[1], partly_manual=partly_manual
        )
    try:
        backend = BACKENDS[implementation]
    except KeyError:
        raise ValueError(
            f"model.attention: unknown implementation {implementation!r}; "
            f"use one of {', '.join(CHOICES)}"
        ) from None
    tiles = {"blocks": blocks, "fused_bwd": fused_bwd, "per_device": per_device}
    tiles = tiles if backend.tiles else {}
    if isinstance(q_offset, int) and q_offset == 0:
        return backend.fn(q, k, v, segment_ids, **tiles)
    if not backend.q_offset:
        raise ValueError(f"attention backend {implementation!r} cannot place queries after keys")
    return backend.fn(q, k, v, segment_ids, q_offset, **tiles)
