"""FLOPs per token: the model's (MFU), and the hardware's with recomputation (HFU)."""

from __future__ import annotations

from ultrajax.config.schema import ModelConfig
from ultrajax.model import grouped, remat
from ultrajax.model.llama import fp8_param_count, matmul_param_count
from ultrajax.parallel.context import work


def attention_flops_per_token(m: ModelConfig) -> float:
    """Forward QK^T and PV: 2 matmuls x 2 FLOPs x s x (heads x head_dim), per layer."""
    return 4.0 * m.n_layers * m.n_heads * m.hd * m.seq_len


def flops_per_token(m: ModelConfig, *, causal: bool = False) -> float:
    """Model FLOPs per trained token: 6N + 12·L·h·s (h = heads x head_dim).

    The default counts the whole s x s score square, as PaLM's MFU and the playbook do
    (`mfu`). causal=True halves the attention term, 6N + 6·L·h·s: a causal mask (every
    model here is causal) leaves half the square to compute, which is how FlashAttention's
    benchmarks and some trainers count (`mfu_causal`), so their MFU reads lower by that.
    """
    attention = attention_flops_per_token(m) / (2.0 if causal else 1.0)
    return 6.0 * matmul_param_count(m) + 3.0 * attention


def fp8_flops_per_token(m: ModelConfig) -> float:
    """Of `flops_per_token`, what runs through FP8 operands (model.fp8): the forward and
    both backward products of the attention projections and the dense MLP, 6 x their
    weights; 0 without FP8."""
    return 6.0 * fp8_param_count(m)


def model_peak(m: ModelConfig, peak_of) -> float:
    """The peak FLOP/s that MFU divides by, `peak_of(dtype)` a device's dense peak: the
    model dtype's, or with model.fp8 the FLOPs over the time they take at peak, the FP8
    matmuls' at the FP8 peak and the rest at the dtype's (bf16's where a device lists
    no FP8 peak). Why: MFU against the bf16 peak alone would read above what FP8 leaves."""
    total, f8 = flops_per_token(m), fp8_flops_per_token(m)
    high = peak_of(m.dtype)
    if not f8:
        return high
    return total / ((total - f8) / high + f8 / peak_of("float8_e4m3fn"))


def recompute_flops_per_token(m: ModelConfig, attention_saved: bool = False) -> float:
    """Forward FLOPs that the remat policy runs a second time in the backward pass.
    `attention_saved`: the attention keeps its output and log-sum-exp under selective
    recomputation (activations.keeps_residuals: the flash attentions with a log-sum-exp
    and context parallelism), so selective runs no attention forward again.

    What the backward pass recomputes is what it needs and was not saved (checked
    against the compiled HLO's dots in tests/test_remat.py):
    - the attention scores QK^T: saved by no policy but selective with a flash attention
      that keeps its residuals (half the attention FLOPs);
    - the output projection wo: its output feeds the residual stream that the MLP's
      norm needs, so it is recomputed unless that stream is kept (`residual`: selective
      and offload keep it);
    - q, k, v, PV (attn_out) and the MLP's gate and up (mlp_in): unless kept by name;
    - never w_down: its output only enters a residual sum, whose backward needs nothing.
    full keeps no names, selective and offload keep (or offload) all of them.
    """
    if m.remat == "none":
        return 0.0
    h, hd, a, akv, f = m.d_model, m.hd, m.n_heads, m.n_kv_heads, m.d_ff
    if m.moe:  # gate and up of the experts a token visits and of the shared experts, in
        # the MoE layers; the dense layers' own between them (model.moe_every)
        moe = m.n_layers // m.moe_every
        experts = (m.moe_top_k + m.moe_shared_experts) * m.expert_ff
        f = (moe * experts + (m.n_layers - moe) * m.d_ff) / m.n_layers
    attention = attention_flops_per_token(m)
    kept = remat.kept_tags(m.remat)  # selective keeps SELECTIVE, offload moves it to the host
    per_layer = {
        remat.QUERY: 2 * h * a * hd,
        remat.KEY: 2 * h * akv * hd,
        remat.VALUE: 2 * h * akv * hd,
        remat.MLP_IN: 4 * h * f,
    }
    redo = sum(v for k, v in per_layer.items() if k not in kept) * m.n_layers
    redo += 2 * a * hd * h * m.n_layers * (remat.RESIDUAL not in kept)  # wo
    if attention_saved and remat.ATTN_SAVED in kept:
        return redo
    redo += attention / 2 if remat.ATTN_OUT not in kept else 0.0  # PV
    return redo + attention / 2  # QK^T


def grouped_flops_per_token(m: ModelConfig, platform: str | None = None) -> float:
    """What the MoE layers' grouped matmuls run beyond the experts a token visits: jax's
    `ragged_dot` runs as a dense product over every group, on a CPU (jax's lowering) and
    on a GPU (XLA's rewriter, jax 0.11.2: on one H200 the layer ran 100.6 TFLOP/s of the
    counted FLOPs, 4x that executed at 8 experts and top-2, benchmarks/RESULTS.md), so
    each row is multiplied by all E experts' weights, not k: (E - k) x the three expert
    matmuls, forward and backward, per layer. model.moe_grouped=blocked: none (its
    padding, under a block a group, is not counted)."""
    if not m.moe or grouped.implementation(m.moe_grouped, platform) == "blocked":
        return 0.0
    layers = m.n_layers // m.moe_every  # the MoE layers
    return 18.0 * m.d_model * m.expert_ff * (m.moe_experts - m.moe_top_k) * layers


def hardware_flops_per_token(
    m: ModelConfig, platform: str | None = None, attention_saved: bool = False
) -> float:
    """What the hardware runs per token on `platform` (default: this backend): the
    model's FLOPs, what the remat policy recomputes (`attention_saved`: as
    recompute_flops_per_token) and the grouped matmuls' dense excess (HFU's numerator)."""
    redo = recompute_flops_per_token(m, attention_saved)
    return flops_per_token(m) + redo + grouped_flops_per_token(m, platform)


# --------------------------------------------------------------------------- FLOPs


def attention_flops(cfg) -> dict:
    """Causal attention FLOPs per device per step (forward + backward = 3 x forward), for
    this run's layout and for the other zig-zag setting: {zigzag: [per device]}."""
    m, cp = cfg.model, cfg.mesh.sequence
    chunk = m.seq_len // (2 * cp)
    per_pair = 3 * 4 * cfg.train.micro_batch_size * chunk**2 * m.n_heads * m.hd
    per_pair *= m.n_layers * cfg.train.grad_accum // cfg.mesh.tensor
    return {z: (work(cp, z) * per_pair).tolist() for z in (True, False)}
