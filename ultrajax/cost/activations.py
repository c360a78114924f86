"""What one layer keeps for the backward pass and what its backward holds while it
runs, per device, in bytes: exact saved activations, fitted working sets (the
coefficients and the shapes they were fitted on: docs/memory.md)."""

from __future__ import annotations

import copy
import math

import jax

from ultrajax.config.no_effect import layer_loop
from ultrajax.config.schema import Config, ModelConfig
from ultrajax.cost.sizes import dims, layer_kinds, layer_weight_elements
from ultrajax.model import grouped, llama, remat
from ultrajax.model.attention import backends as attention_lib
from ultrajax.model.attention import blocked, tiled
from ultrajax.parallel import layout
from ultrajax.parallel.context import pair_kernel
from ultrajax.parallel.pipeline import plan as plan_lib
from ultrajax.parallel.pipeline import schedules
from ultrajax.parallel.zero import prefetches

# One layer's backward working set, in copies of (per device):
#   S  b·a·s² fp32 attention scores     F  b·s·d_ff MLP hidden
#   X  b·s·h inside a TP region         R  b·s·h of the residual stream (/tp with SP)
#   K  b·s·kv·hd keys                   Wm h·d_ff one MLP matrix
#   Wa h·hd·(a + kv) attention weights  Z  the whole layer's weights, ZeRO-3 only
# Fitted by least squares over scripts/fit_memory.py's FIT_SHAPES (72 compiled shapes and
# layouts for these: fp32, XLA:CPU, one device, ZeRO-3, TP, TP+SP) and checked on its
# VALIDATION_SHAPES, kept apart; docs/memory.md. All but S count compute-dtype bytes.
# Z < 0 for `none`: under ZeRO-3 XLA reuses buffers the exact terms count.
WORK = {
    "none": {"X": 4.0, "R": 7.6, "K": 6.4, "Wm": 0.0, "Wa": 0.0, "Z": 0.0, "S": 2.0, "F": 2.6},
    "full": {"X": 4.6, "R": 7.1, "K": 9.1, "Wm": 0.0, "Wa": 0.0, "Z": 0.0, "S": 2.5, "F": 5.4},
    "selective": {"X": 2.7, "R": 4.8, "K": 0.0, "Wm": 0.0, "Wa": 0.0, "Z": 0.0, "S": 3.0, "F": 3.0},
}
# MoE: bytes per element of the grouped matmuls' dense temporaries (grouped_work), by
# platform, compute bytes and policy: the mean of what the compiled steps needed beyond
# the rest of the layer backward's working set. GPU (bf16): one H200's 6 steps (d_model
# 1024, 8 experts of 2816, top-2, 2048 and 4096 tokens; benchmarks/RESULTS.md,
# 2026-11-27), each within 4% of the mean; fp32 on a GPU is not measured (taken as bf16).
# CPU (model.moe_grouped=ragged there): XLA:CPU's compiled steps (fp32: 4/8 experts,
# hidden 256/512, 256/512 rows, within 10%; bf16, converted to fp32 on a CPU, one shape).
GROUPED = {
    ("gpu", 2): {"none": 17.9, "selective": 19.8, "full": 19.7},
    ("gpu", 4): {"none": 17.9, "selective": 19.8, "full": 19.7},
    ("cpu", 4): {"none": 15.3, "selective": 15.4, "full": 25.9},
    ("cpu", 2): {"none": 25.5, "selective": 24.5, "full": 31.3},
}
# model.moe_grouped=blocked: (fp32 copies of the rows multiplied, R' x d_model; of their
# hidden arrays, R' x hidden; of the local experts' weight gradient, d_model x hidden) in
# the backward's working set, and under expert parallelism BLOCKED_EXCHANGE fp32 copies
# of R' x d_model more (the exchange's send and receive slots of the rows' gradients
# and the copies around them). The rows' coefficients least squares over XLA:CPU's
# compiled steps (scripts/fit_moe_memory.py, 2026-12-07: 8 experts, top-2, d_model
# 64-256, hidden 32-512, 256 or 512 tokens a device, one device, expert 2 and 8, data 2
# x expert 4; 20 steps a policy, predicted / compiled peak 0.91-1.065); the weights' from
# the fit before (4 and 8 experts, d_model 128/256, hidden 256/512), which lumped both
# row terms into 1.4 / 2.4 copies of R' x (d_model + hidden): right where the hidden
# arrays outweigh the rows, 0.58-0.82 of the peak with hidden 32 or 64
BLOCKED = {"none": (2.4, 1.6, 4.0), "selective": (6.8, 0.27, 6.1), "full": (6.7, 0.25, 6.1)}
BLOCKED_EXCHANGE = {"none": 4.0, "selective": 2.2, "full": 1.55}
ATTN_S = 3.75  # fitted: scores, probabilities, their gradient, a transposed copy (fp32)
# Not fitted, read off XLA:CPU's buffer assignment: from this many softmax rows (b·a·s per
# device) XLA:CPU's fusion writes the normalised probabilities as an fp32 array of their
# own instead of fusing the division into the consumer (the step lies between b·a·s =
# 4032 and 4096, whatever b, a or s), so a recomputing forward holds one more copy of the
# scores (s = 1008 -> 1040 at b = 1, a = 4: predicted/compiled 0.99 -> 0.81 without it)
SOFTMAX_ROWS_SPLIT = 4096
# mesh.sequence > 1, the ring's own working set beyond one layer's, in copies of a pair of
# chunks' fp32 scores (S) and of an fp32 b·s·a·hd (Q: the running output and dq); fitted
CP_WORK = {"S": 0.94, "Q": 4.54}
# attention tiled / blocked (memory-efficient, plain XLA: XLA:CPU's `auto`): the scores
# they hold while one layer's attention runs, in copies of kernel_features' units (T one
# row group's fp32 scores, P one key block's, M the bool masks of every block); fitted
KERNEL_WORK = {"T": 1.46, "P": 4.16, "M": 1.55}
# mesh.pipeline > 1: the share of one layer's backward working set (layer_work, but its
# attention moment) live at a tick beside the chunk's residuals, and the copies of the fp32
# scores its attention backward holds; fitted on XLA:CPU, fp32 (scripts/fit_memory.py)
PIPE_WORK = {"none": 0.5, "full": 1.05, "selective": 1.0}
PIPE_ATTN_S = 3.0
# the copies of the fp32 scores XLA hoists out of a layer loop for plain attention's mask
# (two fp32 arrays and a bool one: memory.py `_hoisted`), live in the layer backward too
HOISTED_S = 2.25


# --------------------------------------------------------------------------- activations


def _policy(m: ModelConfig) -> str:
    return m.remat if isinstance(m.remat, str) else "list"


def saved_per_layer(cfg: Config, platform: str | None = None) -> dict[str, float]:
    """Bytes one layer keeps for the backward pass, by part, per device: the mean over
    the layers when dense and MoE layers interleave (sizes.layer_kinds). With `platform`
    given, what the compiled step keeps there (`fused_loop`); else jax's residuals."""
    kinds = layer_kinds(cfg)
    if len(kinds) == 1:
        out = _saved_one(cfg)
        return fused_loop(cfg, out) if platform and loop_on_gpu(cfg, platform) else out
    out: dict[str, float] = {}
    for n, kind in kinds:
        for part, b in _saved_one(kind).items():
            out[part] = out.get(part, 0.0) + n * b / cfg.model.n_layers
    return out


def _saved_one(cfg: Config) -> dict[str, float]:
    """`saved_per_layer` for a model of one kind of layer.

    Derived from print_saved_residuals (tests/test_memory.py checks it exactly):
      no recompute:
        norms (x2): input and normalised output in fp32 (8·X), the matmul input
          in the compute dtype (c·X), two fp32 statistics per token (8·b·s) and
          the scale broadcast to (1, 1, h) in fp32;
        attention: rotated q and k, v, and the attention output (c·(2Q + 2K)),
          softmax probabilities in fp32 and cast for the PV matmul ((4 + c)·S),
          max and sum of the softmax per head and token (8·a·b·s);
        MLP: gate, up, sigmoid(gate), silu(gate), their product and a
          broadcast of it (6·c·F).
      full: the block input (c·X).
      selective: the block input, q, k, v, attention output, gate and up.
      a list of names: the block input and the named tensors.
    The block input is counted under norms.
    """
    d = dims(cfg)
    m = cfg.model
    c = d.c
    flash = _flash(cfg)  # the kernel keeps the log-sum-exp, never the scores
    block_input = c * d.X_res
    pol = _policy(m)
    if pol == "none":
        norms = 2 * (8 * d.X_res + c * d.X + 8 * d.N_res + 4 * d.h)  # + the broadcast scale
        if flash:
            attention = c * (2 * d.Q + 2 * d.K) + 4 * d.a * d.N
            kind = attention_lib.BACKENDS.get(m.attention) if cfg.mesh.sequence == 1 else None
            if kind is not None and kind.output_copy:  # its own output beside wo's input
                attention += c * d.Q
            if kind is not None and not kind.lse:  # no log-sum-exp kept (tiled)
                attention -= 4 * d.a * d.N
        else:
            attention = c * (2 * d.Q + 2 * d.K) + (4 + c) * d.S + 8 * d.a * d.N
        if m.moe:  # the router reads the normalised stream in fp32, not in c (below)
            out = {"attention": attention, "mlp": moe_saved(cfg), "norms": norms - c * d.X}
        else:
            out = {"attention": attention, "mlp": 6 * c * d.F, "norms": norms}
        split = (
            cfg.mesh.pipeline > 1
            and schedules.SCHEDULES[cfg.parallel.pipeline_schedule].splits_backward
        )
        # zero bubble keeps each FP8 matmul's inputs themselves for its weight step
        return _fp8_saved(cfg, out) if m.fp8 in ("tensorwise", "delayed") and not split else out
    if pol in ("full", "offload"):
        return {"attention": 0.0, "mlp": 0.0, "norms": block_input}
    names = remat.kept_tags(m.remat)
    attention = c * (
        d.Q * (remat.QUERY in names)
        + d.K * (remat.KEY in names)
        + d.K * (remat.VALUE in names)
        + d.Q * (remat.ATTN_OUT in names)
    )
    if remat.ATTN_SAVED in names and keeps_residuals(cfg):
        # the log-sum-exp; the output, kept once, is wo's input (model/remat.py
        # names_attention_output)
        attention += 4 * d.a * d.N
    hidden = expert_rows(cfg) * m.expert_ff // cfg.mesh.tensor if m.moe else d.F
    mlp = 2 * c * hidden * (remat.MLP_IN in names)
    # the residual stream after attention, like the block input (sequence-split under SP)
    return {
        "attention": attention,
        "mlp": mlp,
        "norms": block_input * (1 + (remat.RESIDUAL in names)),
    }


def loop_on_gpu(cfg: Config, platform: str | None = None) -> bool:
    """The layers as a Python loop (config/no_effect.py layer_loop) on a GPU: no buffers
    stacked over the layers, each layer's gradient made as its backward runs, and XLA's
    fusion free to recompute elementwise residuals (docs/memory.md, the layer loop). On a
    CPU the estimate stays the scan's (XLA:CPU's schedule holds more: the train command
    warns)."""
    return layer_loop(cfg) and (platform or jax.default_backend()) == "gpu"


def fused_loop(cfg: Config, parts: dict[str, float]) -> dict[str, float]:
    """`_saved_one`'s parts as XLA's GPU compiler keeps them under the layer loop, where
    it fuses elementwise producers into their backward consumers instead of storing them.
    Without recomputation (a dense layer, not FP8), read off the 1B step's buffer
    assignment (compiled for an H200, micro-batch 8): the MLP keeps gate, up and their
    SwiGLU product (3·c·F, not jax's six arrays), the norms one fp32 copy of the residual
    stream, the two normalised matmul inputs in the compute dtype and four fp32 statistics
    per token (not two fp32 inputs and outputs). The attention's and every recomputing
    policy's arrays are jax's own (what the policy names is stored as named)."""
    m = cfg.model
    if _policy(m) != "none" or m.moe or m.fp8 in ("tensorwise", "delayed"):
        return parts
    d = dims(cfg)
    norms = 4 * d.X_res + 2 * d.c * d.X + 16 * d.N_res
    return dict(parts, mlp=3 * d.c * d.F, norms=norms)


def _fp8_saved(cfg: Config, parts: dict[str, float]) -> dict[str, float]:
    """`_saved_one`'s parts without recomputation under model.fp8=tensorwise or delayed
    (model/fp8.py): each FP8 matmul keeps its e4m3 operands and two fp32 scales for the
    backward, in place of its input in the compute dtype. Read off print_saved_residuals:
    an e4m3 copy of the input per FP8 matmul (q, k, v; gate, up: no sharing in the saved
    set), the input in the compute dtype only while a matmul in model.dtype still reads
    it, and an e4m3 copy of each FP8 weight as the layer uses it (gathered over fsdp). An
    MoE layer's experts stay in the compute dtype: only its attention changes. Rowwise
    keeps the inputs themselves (it re-quantises along other axes): the plain parts."""
    d = dims(cfg)
    c, moe = d.c, cfg.model.moe
    chosen = set(llama.fp8_weights(cfg.model))
    weights = layer_weight_elements(cfg, by="key")
    parts = dict(parts)
    # (the matmuls reading one input, its elements, the part that holds it in c)
    inputs = [(("wq", "wk", "wv"), d.X, "norms"), (("wo",), d.Q, "attention")]
    if not moe:
        inputs += [(("w_gate", "w_up"), d.X, "norms"), (("w_down",), d.F, "mlp")]
    copies = 0.0
    for keys, elements, part in inputs:
        fp8 = [k for k in keys if k in chosen]
        if len(fp8) == len(keys):  # no matmul in model.dtype keeps the input
            parts[part] -= c * elements
        copies += len(fp8) * (elements + 2 * 4) + sum(weights[k] for k in fp8)
    parts["fp8 operands"] = copies
    return parts


def _moe_rows(cfg: Config) -> int:
    """An MoE layer's assignments on one device: its tokens (inside the TP region) x k."""
    d = dims(cfg)
    return d.N * cfg.model.moe_top_k


def expert_rows(cfg: Config) -> int:
    """The rows one device's experts multiply: its own assignments, or under expert
    parallelism a slot of each expert rank's (parallel/expert.py pads every slot to the
    dropless worst case, so mesh.expert x its own)."""
    return _moe_rows(cfg) * cfg.mesh.expert


def moe_saved(cfg: Config) -> float:
    """Bytes one MoE layer keeps for the backward pass without recomputation (model/moe.py),
    per device (under expert parallelism the experts' rows are the received slots,
    `expert_rows`):
      router, fp32: its input (N·h), the router weight cast to fp32 (h·E, when the
        compute dtype is not fp32), the logits (N·E), softmax's max and sum (2N), the
        top-k's indices (int32 N·k), the normalised gates (their sum and the scores
        before: N·k + 2N), the z-loss's logits, mask and log-sum-exp (N·E + 9N bytes/4)
        the auxiliary loss's load share (E), and a scalar per loss that joins the
        backward pass (`_attach`);
      experts: the token of each sorted row and the inverse permutation (int32 2R), each
        expert's rows (int32 E), the rows multiplied (c·R'·h), the SwiGLU's six hidden
        arrays (6c·R'·f, as the dense MLP's), capacity's keep mask (c·R), the gates
        and the outputs in fp32 for the combine (N·k + N·k·h);
      shared experts: a dense SwiGLU's six hidden arrays, and its input in c unless that
        is the router's fp32 one.
    R = N·k assignments, R' = `expert_rows` (R on one expert rank), f = moe_d_ff / tensor.
    Checked against print_saved_residuals on one device (tests/test_memory.py)."""
    m = cfg.model
    d = dims(cfg)
    c, n, e, k, h = d.c, d.N, m.moe_experts, m.moe_top_k, d.h
    rows, f = _moe_rows(cfg), m.expert_ff // cfg.mesh.tensor
    held = expert_rows(cfg)  # the rows the experts multiply here
    aux = m.moe_balance == "aux" and m.moe_aux_coef > 0
    router = 4 * (n * h + n * e + n * k) + 4 * h * e * (c != 4)
    router += 8 * n * (m.moe_router == "softmax")
    router += (4 * n * k + 8 * n) * m.moe_norm_topk
    router += (4 * n * e + 9 * n) * (m.moe_z_coef > 0)
    router += 4 * e * aux
    router += 4 * (aux + (m.moe_z_coef > 0))  # each attached loss's zero (moe._attach)
    experts = 8 * rows + 4 * e + c * held * h + 6 * c * held * f + 4 * n * k * (1 + h)
    experts += c * rows * (m.moe_capacity > 0)
    shared = 0.0
    if m.moe_shared_experts:
        shared = 6 * c * n * m.moe_shared_experts * f + c * n * h * (c != 4)
    return float(router + experts + shared)


def offloaded_per_layer(cfg: Config) -> float:
    """remat=offload: bytes per layer moved to pinned host memory instead of kept: what
    keeping the tagged matmul outputs (remat.SELECTIVE) keeps but the block input (an MoE
    layer's experts' rows included; the mean over the layers where dense and MoE layers
    interleave). Checked against the step lowered for a GPU (tests/test_remat.py)."""
    if cfg.model.remat != "offload":
        return 0.0
    tagged = copy.copy(cfg)
    tagged.model = copy.copy(cfg.model)
    tagged.model.remat = list(remat.SELECTIVE)
    d = dims(cfg)
    return sum(saved_per_layer(tagged).values()) - d.c * d.X_res  # the block input stays


def invariant_activations(cfg: Config) -> float:
    """Saved once, not per layer, without recomputation: the attention mask (1 byte per
    score) and the rotary cos/sin tables (fp32, b·s·hd/2 each)."""
    d = dims(cfg)
    if _policy(cfg.model) != "none":
        return float(d.b * d.s * d.s)  # the causal/segment mask, recomputed per layer
    mask = 0 if _flash(cfg) else d.S
    return float(mask + 2 * 4 * d.N * d.hd // 2)


def work_features(cfg: Config) -> tuple[str, dict[str, float], dict[str, float]]:
    """(policy row of WORK, bytes per unit of each common coefficient, bytes per unit of
    each MLP-moment coefficient): layer_work is their dot product with WORK, so the
    coefficients can be fitted (scripts/fit_memory.py)."""
    d, m = dims(cfg), cfg.model
    pol = _policy(m)
    if pol == "list":  # recomputing the MLP's inputs works like full, keeping them selective
        pol = "selective" if remat.MLP_IN in cfg.model.remat else "full"
    lw = layer_weight_elements(cfg)
    zero3 = cfg.parallel.zero >= 3 and cfg.mesh.fsdp > 1
    flash = _flash(cfg)
    common = {
        "X": d.c * (d.X - d.X_res),
        "R": d.c * d.X_res,
        "K": d.c * d.K,
        "Wm": d.c * lw[llama.MLP] / 3,
        "Wa": d.c * lw[llama.ATTENTION] / 2,
        "Z": d.c * (lw[llama.MLP] + lw[llama.ATTENTION]) * zero3,
    }
    mlp = {"S": 0.0 if flash else 4 * d.S, "F": d.c * d.F}
    if m.moe:  # the experts' hidden rows for the dense MLP's
        f = m.expert_ff // cfg.mesh.tensor
        mlp["F"] = d.c * (expert_rows(cfg) * f + d.N * m.moe_shared_experts * f)
    return ("full" if pol == "offload" else pol), common, mlp


def grouped_work(cfg: Config, platform: str | None = None) -> float:
    """The MoE layer's grouped matmuls' own temporaries (bytes per device): jax's
    `ragged_dot` runs as a dense product over every group, on a CPU (jax's lowering)
    and on a GPU (XLA's rewriter, jax 0.11.2), so the backward holds arrays of
    (local experts, rows multiplied, hidden) elements, E·R·f whatever the expert split
    (E / n experts over n slots of R). Bytes per element from the compiled steps
    (GROUPED). model.moe_grouped=blocked (model/grouped.py) holds none of them, but
    copies of the rows padded to blocks, of their hidden arrays and the experts' fp32
    weight gradients as its loops sum them, and under expert parallelism the exchange's
    slots (BLOCKED, BLOCKED_EXCHANGE)."""
    m = cfg.model
    if not m.moe:
        return 0.0
    platform = "gpu" if (platform or jax.default_backend()) == "gpu" else "cpu"
    pol = work_features(cfg)[0]
    f = m.expert_ff // cfg.mesh.tensor
    if grouped.implementation(m.moe_grouped, platform) == "blocked":
        by_h, by_f, weights = BLOCKED[pol]
        by_h += BLOCKED_EXCHANGE[pol] * (cfg.mesh.expert > 1)
        local = m.moe_experts // cfg.mesh.expert
        rows = expert_rows(cfg)
        return 4.0 * (rows * (by_h * m.d_model + by_f * f) + weights * local * m.d_model * f)
    return GROUPED[platform, dims(cfg).c][pol] * m.moe_experts * _moe_rows(cfg) * f


def layer_work(
    cfg: Config, share: float = 1.0, attn_s: float = ATTN_S, platform: str | None = None
) -> float:
    """One layer's backward working set (bytes per device), from the WORK table.

    Two moments compete: the MLP's backward (its hidden-size temporaries, with the
    layer's attention scores already sliced out or recomputed: the `S` coefficient),
    and the attention's backward (scores, probabilities, their gradients and a
    transposed copy: `attn_s` copies of the fp32 scores). The larger is the working set.
    `share` scales everything but the attention's moment (the pipeline's tick keeps a
    share of it: PIPE_WORK). Dense and MoE layers interleaved: the larger kind's.
    """
    kinds = layer_kinds(cfg)
    if len(kinds) > 1:
        return max(layer_work(k, share, attn_s, platform) for _, k in kinds)
    pol, common, mlp = work_features(cfg)
    coef = WORK[pol]
    if prefetches(cfg):  # ZeRO-3's prefetch: its own backward loop (model/prefetch.py)
        # hoists no mask out of it: the MLP's moment holds no hoisted masks' copies of
        # the scores, the attention's those of a pipeline's tick (fp32, 512-2048 tokens:
        # predicted/compiled 1.08-1.11 -> 0.99-1.01 with remat, `none` unchanged)
        coef = dict(coef, S=max(0.0, coef["S"] - HOISTED_S))
        attn_s = PIPE_ATTN_S
    d = dims(cfg)
    attn = 0.0 if _flash(cfg) else attn_s * 4 * d.S
    if cfg.mesh.sequence > 1:  # context parallelism: one pair of chunks' fp32 scores at a
        # time, (s / 2cp)² = S / 4 with d.s = s / cp, unless a flash kernel runs the pair

        attn = attn_s * d.S if pair_kernel(cfg, "cpu") == "xla" else 0.0
    # tiled / blocked attention (KERNEL_WORK): blocked's loop over key blocks is a moment
    # of its own, in place of the s² scores; tiled's row groups add to the layer's
    kernel = {k: KERNEL_WORK[k] * v for k, v in kernel_features(cfg).items()}
    attn += kernel["P"] + kernel["M"]
    base = sum(coef[k] * v for k, v in common.items()) + weight_work(cfg)
    mlp_moment = sum(coef[k] * v for k, v in mlp.items()) + grouped_work(cfg, platform)
    moment = max(share * mlp_moment, attn)
    return share * base + moment + ring_work(cfg) + kernel["T"]


def weight_work(cfg: Config) -> float:
    """The weights' part of one layer's backward working set (bytes per device), read off
    XLA:CPU's buffer assignment where it dominates (d_model 1024, d_ff 2816, 64 tokens a
    device): the layer's weights as the scan slices them out of the stack (ZeRO-3 gathers
    them, and transposes one MLP matrix for its matmul), one MLP matrix's fp32 weight
    gradient as its matmul writes it and XLA:CPU's transposed copy of it, and, with a
    whole fp32 running sum (grad_accum > 1 below ZeRO-2), the layer's fp32 gradient
    slices its backward rules add into the sum. ZeRO-3's prefetch holds the next layer's
    gathered weights besides (model/prefetch.py)."""
    d = dims(cfg)
    lw = layer_weight_elements(cfg)
    matrix = lw[llama.MLP] / 3
    out = d.c * sum(lw.values()) + 2 * 4 * matrix
    if cfg.parallel.zero >= 3 and cfg.mesh.fsdp > 1:
        out += d.c * matrix
    if prefetches(cfg):
        out += d.c * sum(lw.values())
    whole_sum = cfg.parallel.zero < 2 or cfg.mesh.fsdp == 1
    if cfg.train.grad_accum > 1 and whole_sum and cfg.mesh.pipeline == 1:
        out += 4 * sum(lw.values())
    return out


def ring_features(cfg: Config) -> dict[str, float]:
    """Context parallelism (mesh.sequence > 1): bytes per unit of each CP_WORK coefficient,
    S a pair of chunks' fp32 scores (b·a·(s/2)², s per device; none when a flash kernel
    runs the pair), Q an fp32 b·s·a·hd (the ring's running output and dq)."""
    if cfg.mesh.sequence == 1:
        return {"S": 0.0, "Q": 0.0}

    d = dims(cfg)
    return {"S": d.S if pair_kernel(cfg, "cpu") == "xla" else 0.0, "Q": 4.0 * d.Q}


def kernel_features(cfg: Config) -> dict[str, float]:
    """The plain-XLA attentions that store no s² scores (model/attention/: `tiled` and
    `blocked`: counted as flash kernels in what they save) still hold scores while one
    layer's attention runs: bytes per unit of each KERNEL_WORK coefficient.
      T  tiled: r·a·s² fp32, the scores of one row group (r rows per iteration of its
         loop: TILE_ROWS of this device's rows, all of them under the partitioner);
      P  blocked: b·a·s·min(s, BLOCK) fp32, the scores of one block of keys;
      M  blocked: b·a·s² bytes, the bool masks of every block (XLA:CPU hoists them out of
         the loop over blocks)."""
    out = {"T": 0.0, "P": 0.0, "M": 0.0}
    kind = attention_lib.BACKENDS.get(cfg.model.attention)
    if cfg.mesh.sequence > 1 or kind is None or not kind.holds:
        return out
    d = dims(cfg)
    if kind.holds == "row groups":
        shared = cfg.parallel.collectives == "gspmd" and math.prod(cfg.mesh.sizes().values()) > 1
        rows = min(tiled.TILE_ROWS, d.b)
        rows = d.b if shared or d.b % rows else rows
        out["T"] = 4.0 * rows * d.a * d.s * d.s
    else:
        out["P"] = 4.0 * d.b * d.a * d.s * min(d.s, blocked.BLOCK)
        out["M"] = float(d.S)
    return out


def ring_work(cfg: Config) -> float:
    """The ring's own working set beside one layer's (CP_WORK . ring_features)."""
    return sum(CP_WORK[k] * v for k, v in ring_features(cfg).items())


# --------------------------------------------------------------------------- pipeline


def pipeline_plan(cfg: Config):
    """The executor's plan (parallel/pipeline/plan.py) of this config: its table and slots."""

    par = cfg.parallel
    return plan_lib.make_plan(
        par.pipeline_schedule, cfg.mesh.pipeline, cfg.train.grad_accum, par.virtual_stages
    )


def pipeline_saved_per_layer(cfg: Config) -> dict[str, float]:
    """Bytes of one layer's residuals in the pipeline's buffer, by part, per device: what
    one layer's `jax.vjp` keeps (parallel/pipeline/residuals.py) and the compiled program does not
    drop (tests/test_memory.py reads them off the tick loop's carry).

    saved_per_layer's parts (the RMSNorm scale as a scalar, not broadcast), and:
      no recompute: the mask (bool b·a·s², both `where`s keep their own broadcast) and
        rotary cos/sin for q and k apart (fp32 4·b·s·hd/2 each), in every layer: the
        layer scan keeps these once (invariant_activations), one layer's vjp cannot
        share them, so 2 x invariant_activations per layer;
      under jax.checkpoint: what the policy saves, nothing more (the layer's weights and
        the zeros it is differentiated at are inputs the executor hands back).
    """
    m = cfg.model
    parts = dict(saved_per_layer(cfg))
    pol = _policy(m)
    if pol == "none":
        parts["norms"] -= 2 * 4 * m.d_model  # the scale stays a scalar residual
        parts["masks and rotary tables"] = 2 * invariant_activations(cfg)
        return parts
    return parts


def zero_bubble_pairs_per_layer(cfg: Config) -> float:
    """Bytes per layer zero bubble's input step keeps for its weight step: each weight's
    (input, output cotangent) (model/ops.py Deferred), an input several weights read
    kept once. The attention's matmuls in the compute dtype: wq (X, Q), wk and wv (K;
    they share wq's input), wo (Q, X); the two RMSNorm scales' (y, dy) in fp32 on the
    residual stream; then a dense MLP's w_gate (X, F), w_up (F; w_gate's input), w_down
    (F, X), or an MoE layer's:
      router, fp32: its input and logits (N·h, N·E); its bias takes no gradient, no pair;
      experts, over the rows they multiply (R' = `expert_rows`, f = moe_d_ff / tensor):
        moe_gate (R'·h, R'·f), moe_up (R'·f), moe_down (R'·f, R'·h), each with its
        local experts' group sizes (fp32, E / mesh.expert);
      shared experts: a dense SwiGLU's (N·h, unless that is the router's fp32 input;
        3·N·f_s; N·h)."""
    m, d = cfg.model, dims(cfg)
    c = d.c
    pairs = c * (2 * d.X + 2 * d.Q + 2 * d.K) + 2 * 2 * 4 * d.X_res
    if not m.moe:
        return pairs + c * (2 * d.X + 3 * d.F)
    n, h = d.N, d.h
    rows, f = expert_rows(cfg), m.expert_ff // cfg.mesh.tensor
    pairs += 4 * (n * h + n * m.moe_experts)
    pairs += c * rows * (2 * h + 3 * f) + 3 * 4 * (m.moe_experts // cfg.mesh.expert)
    if m.moe_shared_experts:
        pairs += c * (n * h * (c != 4) + 3 * n * m.moe_shared_experts * f + n * h)
    return float(pairs)


def pipeline_buffers(cfg: Config) -> dict[str, float]:
    """Bytes per device of the executor's buffers (parallel/pipeline/tick.py's
    `initial_state`): the residuals of `slots` micro-batch chunks of n_layers / (p v)
    layers, the arriving activations and gradients (b·s·h each, compute dtype; each with
    its spare slot, the sink for "nothing arrives"), and zero bubble's (input, cotangent)
    pairs per chunk (one b·s·h slot otherwise)."""
    m, plan = cfg.model, pipeline_plan(cfg)
    d = dims(cfg)
    per_chunk = m.n_layers // (plan.p * plan.v)
    x = d.c * d.X_res
    layers = plan.slots["res"] * per_chunk
    out = {k: layers * v for k, v in pipeline_saved_per_layer(cfg).items()}
    out["arriving activations"] = (plan.slots["act"] + 1) * x
    out["arriving gradients"] = (plan.slots["grad"] + 1) * x
    if schedules.SCHEDULES[plan.kind].splits_backward:
        pairs = zero_bubble_pairs_per_layer(cfg)
        out["weight-step pairs (zb-h1)"] = plan.slots["cot"] * per_chunk * pairs
    else:
        out["unused cotangent slot"] = x
    return out


def concrete(cfg: Config, platform: str | None = None) -> Config:
    """The config with `model.attention` resolved for `platform` (default: this process's
    backend): the memory model needs to know whether the scores are stored."""
    platform = platform or jax.default_backend()
    name = layout.attention_backend(cfg, platform)
    if name == cfg.model.attention:
        return cfg
    cfg = copy.deepcopy(cfg)
    cfg.model.attention = name
    return cfg


def keeps_residuals(cfg: Config, platform: str | None = None) -> bool:
    """Whether selective recomputation keeps the attention's output and log-sum-exp
    (model/remat.py ATTN_SAVED), so the backward pass runs no attention forward: the
    flash attentions that save a log-sum-exp (cuDNN, Pallas, blocked) and context
    parallelism's ring and all-gather; not the plain one (its s² probabilities are
    recomputed, Korthikanti's trade) nor tiled (whose residuals are copies of q, k, v).
    `platform`: the backend `model.attention` is resolved for (default: this one)."""
    if cfg.mesh.sequence > 1:
        return True
    return (
        attention_lib.BACKENDS[concrete(cfg, platform).model.attention].output_residual == "saved"
    )


def _flash(cfg: Config) -> bool:
    """Whether the attention never stores the s² scores (a flash kernel; context
    parallelism's ring and all-gather keep only each pair of chunks' log-sum-exp)."""
    if cfg.mesh.sequence > 1:
        return True
    return attention_lib.BACKENDS[concrete(cfg).model.attention].flash
