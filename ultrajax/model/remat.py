"""Activation recomputation: the tags the block names its tensors with, and the
`jax.checkpoint` policy each `model.remat` setting means.

The block tags its matmuls' outputs and the residual stream after attention with
`checkpoint_name(x, tag)`; a policy keeps some tags and recomputes the rest in the
backward pass. The tags are named here once: the config's validation, the block, the
memory model and the tests read them from this file.
"""

from __future__ import annotations

import jax

# the block's tags, in the order the block makes them
QUERY, KEY, VALUE, ATTN_OUT, RESIDUAL, MLP_IN, MLP_OUT = TAGS = (
    "query",
    "key",
    "value",
    "attn_out",
    "residual",  # the residual stream after attention, the MLP norm's input
    "mlp_in",
    "mlp_out",
)
POLICIES = ("none", "full", "selective", "offload")  # or a list of tags to keep
SELECTIVE = TAGS  # Korthikanti et al.: keep all the tagged tensors, recompute the rest
GATHERED = "weights"  # ZeRO-3's gathered weights (parallel/layout.py): never kept
# a flash attention's residuals besides its inputs: its output and log-sum-exp, named by
# the attentions' forward rules (our Pallas kernel, ring attention, the XLA blocked one;
# not tiled, whose residuals are copies of q, k and v); jax.nn's cuDNN forward by its
# primitive, whose outputs are the same two.
# Selective keeps them: (b·s·a) fp32 more a layer, and no attention forward in the
# backward pass (Korthikanti's selective recomputation drops the s² scores, which a
# flash attention never stores)
ATTN_SAVED = "attn_saved"
CUDNN_FORWARD = "dot_product_attention_fwd_wrapper"


def kept_tags(remat) -> set[str]:
    """The names a model.remat setting keeps (offload: moves to the host) rather than
    recomputes: every tag and the attention's residuals (ATTN_SAVED) without
    recomputation and under selective, every tag under offload, none under full, a
    list's own names. The policies below, the memory, FLOPs and communication models
    read this."""
    if remat == "full":
        return set()
    if remat in ("none", "selective"):
        return {*TAGS, ATTN_SAVED}
    return set(TAGS) if remat == "offload" else set(remat)


def names_attention_output(remat, residual: str) -> bool:
    """Whether the block names the attention's output ATTN_OUT, given what the attention
    keeps of it for its own backward (backends.output_residual). A name is a new array
    to jax: where the attention's backward keeps its output and the policy keeps that too
    (without recomputation every flash attention's; under selective those that name it
    ATTN_SAVED), naming wo's input as well would keep the output twice, a second stacked
    copy under the layer scan."""
    if remat == "none":
        return residual == ""
    if remat == "selective":
        return residual != "saved"
    return True


def remat_policy(remat):
    """model.remat -> a jax.checkpoint policy, or None (no recomputation)."""
    cp = jax.checkpoint_policies
    if remat == "none":
        return None
    if remat == "full":
        return cp.nothing_saveable  # keep only the block input
    if remat == "selective":
        # keep the tagged tensors and the attention's residuals; recompute elementwise work
        named = cp.save_only_these_names(*kept_tags(remat))

        def keep(prim, *args, **params) -> bool:
            return prim.name == CUDNN_FORWARD or named(prim, *args, **params)

        return keep
    if remat == "offload":
        return cp.save_and_offload_only_these_names(
            names_which_can_be_saved=[],
            names_which_can_be_offloaded=list(SELECTIVE),
            offload_src="device",
            offload_dst="pinned_host",
        )
    return cp.save_only_these_names(*remat)  # a list of tags to keep


def all_but_gathered_weights(axis: str):
    """remat policy for ZeRO-3 without recomputation: keep every activation, but never a
    weight gathered over mesh axis `axis` (it is all-gathered again in the backward pass
    instead): neither the all-gather's output nor what is tagged GATHERED."""

    def keep(prim, *_, **params) -> bool:
        if prim.name == "all_gather":
            names = params.get("axis_name", ())
            return axis not in (names if isinstance(names, tuple) else (names,))
        if prim.name == "sharding_constraint":  # the partitioner's gather (gspmd): its
            return False  # input is kept instead, the shard (or the same activation)
        return not (prim.name == "name" and params.get("name") == GATHERED)

    return keep


def layers_per_iteration(scan_unroll: int, n_layers: int, recomputes: bool) -> int:
    """The layer loop's unroll: model.scan_unroll (at most the layers), but one layer per
    iteration wherever the backward recomputes (a remat policy, or ZeRO-3's re-gather).

    Unrolled, XLA merges each layer's recomputation with its forward and keeps every
    unrolled layer's activations (8 layers, full remat: 31 MiB of temporaries rolled,
    164 MiB unrolled, as much as no remat), and ZeRO-3 keeps every gathered layer; the
    config's validation warns that the unroll has no effect there."""
    return 1 if recomputes else max(1, min(scan_unroll, n_layers))
