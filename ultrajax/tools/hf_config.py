"""A Hugging Face config.json <-> our ModelConfig: which families we hold (Llama,
Mixtral, Qwen3, Qwen3-MoE), the fields each maps to, the ones we refuse, and the
config.json written back (ultrajax/tools/convert.py moves the tensors)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ultrajax.config.schema import ConfigError, ModelConfig

ARCHITECTURE = "LlamaForCausalLM"
# model_type -> transformers class: Llama, and Mixtral (a Llama with an MoE MLP: softmax
# router, top-k with renormalised gates, SwiGLU experts; docs/moe.md)
ARCHITECTURES = {
    "llama": ARCHITECTURE,
    "mixtral": "MixtralForCausalLM",
    "qwen3": "Qwen3ForCausalLM",  # a Llama with each head's queries and keys normalised
    "qwen3_moe": "Qwen3MoeForCausalLM",  # Qwen3's attention, an MoE MLP
}
_L = "model.layers.{i}."
# where a family's tensor names differ from the parameter table's (Llama's, Mixtral's)
FAMILY_NAMES = {
    "qwen3_moe": {
        "router": _L + "mlp.gate.weight",
        "moe_gate": _L + "mlp.experts.{e}.gate_proj.weight",
        "moe_up": _L + "mlp.experts.{e}.up_proj.weight",
        "moe_down": _L + "mlp.experts.{e}.down_proj.weight",
    },
}
# transformers rope_type values we compute exactly; "dynamic" depends on the run-time length
ROPE_TYPES = ("default", "linear", "llama3")
# what transformers' config class of each family assumes for a field config.json leaves
# out (Llama's were taken for all: Mixtral's rope_theta is 1e6; tests/test_convert.py
# holds these against transformers' classes)
FAMILY_DEFAULTS = {
    "llama": {"rope_theta": 10000.0, "rms_norm_eps": 1e-6},
    "mixtral": {"rope_theta": 1e6, "rms_norm_eps": 1e-5},
    "qwen3": {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "head_dim": 128},
    "qwen3_moe": {"rope_theta": 10000.0, "rms_norm_eps": 1e-6},
}


def family(m: ModelConfig) -> str:
    """The Hugging Face model_type that holds this model."""
    if m.moe:
        return "qwen3_moe" if m.qk_norm else "mixtral"
    return "qwen3" if m.qk_norm else "llama"


def hf_name(p, m: ModelConfig) -> str:
    """A parameter's (model/llama.py `Param`) tensor name in this model's family (`{i}`
    the layer, `{e}` the expert)."""
    return FAMILY_NAMES.get(family(m), {}).get(p.key, p.hf)


GENERATION_CONFIG = "generation_config.json"  # a model's generation settings, its stop ids


def eos_ids(path: Path) -> list[int]:
    """The eos_token_id of a generation_config.json or config.json (an id or a list of
    them), or none, with a warning, when the file cannot be read."""
    try:
        value = json.loads(Path(path).read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError) as e:
        print(f"warning: {path}: not read ({type(e).__name__}): no stop ids from it",
              file=sys.stderr)  # fmt: skip
        return []
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


def read_hf_config(hf_dir: str | Path) -> dict:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"--hf: {path} does not exist (a Hugging Face model directory has one)")
    try:
        tree = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON (line {e.lineno})") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return tree


def hf_dtype(hf: dict) -> str:
    """The dtype a config.json says its weights are stored in (transformers 5 writes
    `dtype`, 4 `torch_dtype`)."""
    return str(hf.get("dtype") or hf.get("torch_dtype") or "float32")


def model_config_from_hf(hf: dict, where: str = "config.json") -> ModelConfig:
    """Our ModelConfig for a Llama config.json; anything that changes the math and that we
    do not implement is an error naming the field."""
    archs = hf.get("architectures") or []
    arch = ARCHITECTURES.get(hf.get("model_type"))
    if arch is None or any(a != arch for a in archs):
        name = ", ".join(archs) or f"model_type {hf.get('model_type')!r}"
        known = ", ".join(ARCHITECTURES.values())
        raise ConfigError(f"{where}: architecture {name} is not supported (only {known})")

    def need(key):
        if hf.get(key) is None:
            raise ConfigError(f"{where}: the field {key!r} is missing")
        return hf[key]

    def refuse(key, ok, allowed):
        if key in hf and hf[key] is not None and hf[key] not in ok:
            raise ConfigError(
                f"{where}: {key}={json.dumps(hf[key])} is not supported (only {allowed})"
            )

    refuse("hidden_act", ("silu", "swish"), "silu")
    refuse("attention_bias", (False,), "false")
    refuse("mlp_bias", (False,), "false")
    refuse("partial_rotary_factor", (1, 1.0), "1.0")
    kind = hf.get("model_type")
    default = FAMILY_DEFAULTS[kind]
    rope = _rope_from_hf(hf, where, default["rope_theta"])
    d, heads = need("hidden_size"), need("num_attention_heads")
    head_dim = hf.get("head_dim", default.get("head_dim"))
    if head_dim is not None and d % heads == 0 and head_dim == d // heads:
        head_dim = None  # the default: keep the YAML minimal
    moe = _moe_from_hf(hf, where, need) if kind in ("mixtral", "qwen3_moe") else {}
    if kind in ("qwen3", "qwen3_moe"):
        refuse("use_sliding_window", (False,), "false")
        moe["qk_norm"] = True
    return ModelConfig(
        vocab_size=need("vocab_size"),
        d_model=d,
        n_layers=need("num_hidden_layers"),
        n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads,
        d_ff=need("intermediate_size"),
        seq_len=hf.get("max_position_embeddings") or 2048,
        head_dim=head_dim,
        **rope,
        norm_eps=float(hf.get("rms_norm_eps", default["rms_norm_eps"])),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        dtype="float32" if hf_dtype(hf) == "float32" else "bfloat16",
        **moe,
    )


def _moe_from_hf(hf: dict, where: str, need) -> dict:
    """The MoE fields of a Mixtral config.json (its experts' hidden size is
    intermediate_size). A sliding window shorter than the context changes the attention,
    which we do not implement: refused."""
    window, context = hf.get("sliding_window"), hf.get("max_position_embeddings") or 2048
    if hf.get("model_type") == "qwen3_moe":
        step, layers = hf.get("decoder_sparse_step", 1), need("num_hidden_layers")
        if hf.get("mlp_only_layers") or not isinstance(step, int) or step < 1 or layers % step:
            raise ConfigError(
                f"{where}: decoder_sparse_step={step} with num_hidden_layers={layers} and "
                f"mlp_only_layers={hf.get('mlp_only_layers')}: only every step-th layer an "
                "MoE layer, the step dividing the layers and no mlp_only_layers, is supported "
                "(model.moe_every)"
            )
        return dict(
            moe_every=step,
            # transformers 5 writes num_local_experts; the published configs num_experts
            moe_experts=hf.get("num_experts") or need("num_local_experts"),
            moe_top_k=need("num_experts_per_tok"),
            moe_d_ff=need("moe_intermediate_size"),
            moe_router="softmax",
            moe_norm_topk=bool(hf.get("norm_topk_prob", False)),
            moe_balance="aux",
            moe_aux_coef=float(hf.get("router_aux_loss_coef", 0.001)),
        )
    if window is not None and window < context:
        raise ConfigError(
            f"{where}: sliding_window={window} (shorter than max_position_embeddings={context}) "
            "is not supported: ultrajax's attention sees the whole context"
        )
    return dict(
        moe_experts=need("num_local_experts"),
        moe_top_k=need("num_experts_per_tok"),
        moe_d_ff=need("intermediate_size"),
        moe_router="softmax",
        moe_norm_topk=True,
        moe_balance="aux",
        moe_aux_coef=float(hf.get("router_aux_loss_coef", 0.001)),
    )


def _rope_from_hf(hf: dict, where: str, default_theta: float) -> dict:
    """The ModelConfig rope fields of a config.json, read as transformers reads it: a
    `rope_scaling` object (transformers 4, and Llama 3.x's own files) wins over
    `rope_parameters` (transformers 5); `type` is the old spelling of `rope_type`."""
    params = hf.get("rope_parameters") or {}
    source = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    tree = hf.get("rope_scaling") or params
    if not isinstance(tree, dict) or any(isinstance(v, dict) for v in tree.values()):
        raise ConfigError(f"{where}: {source} must be one flat JSON object (not per layer type)")
    theta = tree.get("rope_theta", hf.get("rope_theta", params.get("rope_theta", default_theta)))
    kind = tree.get("rope_type", tree.get("type", "default"))
    out = {"rope_theta": float(theta)}
    if kind == "default":
        return out
    if kind not in ROPE_TYPES:
        raise ConfigError(
            f"{where}: {source} type {kind!r} is not supported (only {', '.join(ROPE_TYPES)})"
        )
    # transformers' fallback when a llama3 file leaves the pretraining length out
    tree = {"original_max_position_embeddings": hf.get("max_position_embeddings"), **tree}

    def need(key):
        value = tree.get(key)
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise ConfigError(f"{where}: {source} type {kind!r} needs a number {key!r}")
        return value

    out.update(rope_scaling=kind, rope_factor=float(need("factor")))
    if kind == "llama3":
        out.update(
            rope_low_freq_factor=float(need("low_freq_factor")),
            rope_high_freq_factor=float(need("high_freq_factor")),
            rope_original_max_len=int(need("original_max_position_embeddings")),
        )
    return out


def _rope_to_hf(m: ModelConfig) -> dict:
    """rope_parameters for config.json (rope_scaling is the same, without rope_theta)."""
    tree = {"rope_type": "default", "rope_theta": m.rope_theta}
    if m.rope_scaling != "none":
        tree.update(rope_type=m.rope_scaling, factor=m.rope_factor)
    if m.rope_scaling == "llama3":
        tree.update(
            low_freq_factor=m.rope_low_freq_factor,
            high_freq_factor=m.rope_high_freq_factor,
            original_max_position_embeddings=m.rope_original_max_len,
        )
    return tree


def hf_config(m: ModelConfig, dtype: str, tokenizer=None) -> dict:
    """config.json for transformers.LlamaConfig: rope written both ways (`rope_theta` and
    `rope_scaling` for transformers 4, `rope_parameters` for 5), so either loads it."""
    rope = _rope_to_hf(m)
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    model_type = family(m)
    tree = {
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": m.vocab_size,
        "hidden_size": m.d_model,
        "intermediate_size": m.d_ff,
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.n_kv_heads,
        "head_dim": m.hd,
        "hidden_act": "silu",
        "max_position_embeddings": m.seq_len,
        "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta,
        "rope_parameters": rope,
        "rope_scaling": scaling if m.rope_scaling != "none" else None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": m.tie_embeddings,
        "dtype": dtype,
        "torch_dtype": dtype,
    }
    if model_type in ("qwen3", "qwen3_moe"):
        tree.update(use_sliding_window=False, sliding_window=None)
    if model_type == "qwen3_moe":
        tree.update(
            num_experts=m.moe_experts,
            num_local_experts=m.moe_experts,
            num_experts_per_tok=m.moe_top_k,
            moe_intermediate_size=m.expert_ff,
            norm_topk_prob=m.moe_norm_topk,
            decoder_sparse_step=m.moe_every,
            mlp_only_layers=[],
            router_aux_loss_coef=m.moe_aux_coef,
            output_router_logits=False,
        )
    elif m.moe:
        tree.update(
            intermediate_size=m.expert_ff,
            num_local_experts=m.moe_experts,
            num_experts_per_tok=m.moe_top_k,
            router_aux_loss_coef=m.moe_aux_coef,
            sliding_window=None,
            output_router_logits=False,
        )
    for key, value in (
        ("bos", getattr(tokenizer, "BOS", None)),
        ("eos", getattr(tokenizer, "EOS", None)),
    ):
        if value is not None and value < m.vocab_size:
            tree[f"{key}_token_id"] = value
    return tree


# an MoE model trained with a capacity, read as inference reads it: every token routed
# (how many a call drops depends on how many tokens it holds: a prompt, one token)
DROPLESS = (
    "model.moe_capacity={} dropped the tokens past each expert's capacity in training; "
    "dropless here, the logits differ where training dropped"
)


def check_expressible(m: ModelConfig) -> None:
    """An MoE model that Mixtral's config cannot describe is refused, naming the key."""
    if not m.moe:
        return
    default = ModelConfig()
    qwen = family(m) == "qwen3_moe"  # Qwen3-MoE: its gates renormalised or not
    apart = {
        "moe_shared_experts": m.moe_shared_experts != 0,
        "moe_router": m.moe_router != "softmax",
        "moe_norm_topk": not m.moe_norm_topk and not qwen,
        "moe_every": m.moe_every != 1 and not qwen,
    }
    bad = [f"model.{k}={getattr(m, k)}" for k, off in apart.items() if off]
    if bad:
        name = ARCHITECTURES[family(m)]
        raise ConfigError(
            f"{', '.join(bad)}: a {name} checkpoint cannot hold this MoE model (softmax "
            f"router, top-k{'' if qwen else ' renormalised'}, no shared experts"
            f"{'' if qwen else ', every layer an MoE layer'}; the "
            f"default moe_router is {default.moe_router})"
        )
