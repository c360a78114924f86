"""Config: YAML + dotted overrides, type conversion, validation, mesh resolution."""

from pathlib import Path

import pytest

from ultrajax.config import parse
from ultrajax.config.no_effect import no_effect
from ultrajax.config.parse import load
from ultrajax.config.schema import Config, ConfigError
from ultrajax.config.validate import resolve_mesh
from ultrajax.parallel.layout import unsupported


def _write(tmp_path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def _error(*overrides, path=None) -> str:
    with pytest.raises(ConfigError) as info:
        load(path, list(overrides))
    message = str(info.value)
    assert message and "\n" not in message, f"not one line: {message!r}"
    return message


# --------------------------------------------------------------------------- parsing


def test_yaml_file_sets_values_and_leaves_defaults(tmp_path):
    path = _write(
        tmp_path,
        "model:\n  d_model: 64\n  n_heads: 4\n  n_kv_heads: 1\n"
        "optim:\n  lr: 3.0e-4\n  schedule: wsd\n"
        "mesh: {data: 1, fsdp: 1, pipeline: 1, sequence: 1, tensor: 1}\n",
    )
    cfg = load(path)
    assert cfg.model.d_model == 64 and cfg.model.n_kv_heads == 1
    assert cfg.optim.lr == pytest.approx(3e-4) and isinstance(cfg.optim.lr, float)
    assert cfg.optim.schedule == "wsd"
    default = Config()
    assert cfg.train.steps == default.train.steps
    assert cfg.model.d_ff == default.model.d_ff


def test_overrides_convert_types(tmp_path):
    path = _write(tmp_path, "train:\n  steps: 10\n")
    cfg = load(
        path,
        [
            "train.steps=50",
            "optim.lr=3e-4",  # YAML 1.1 reads this as a string: it must become a float
            "optim.b2=0.99",
            "optim.min_lr=0",  # an int where a float is expected
            "model.tie_embeddings=true",
            "train.profile_steps=[2, 4]",
            "model.remat=[query, attn_out]",
            "model.head_dim=16",
            "checkpoint.dir=null",
            "data.path=",  # empty value: None for an optional key
            "model.dtype=float32",
        ],
    )
    assert cfg.train.steps == 50 and type(cfg.train.steps) is int
    assert cfg.optim.lr == 3e-4 and type(cfg.optim.lr) is float
    assert cfg.optim.b2 == 0.99
    assert cfg.optim.min_lr == 0.0 and type(cfg.optim.min_lr) is float
    assert cfg.model.tie_embeddings is True
    assert cfg.train.profile_steps == [2, 4]
    assert cfg.model.remat == ["query", "attn_out"]
    assert cfg.model.head_dim == 16 and cfg.model.hd == 16
    assert cfg.checkpoint.dir is None
    assert cfg.data.path is None
    assert cfg.model.dtype == "float32"


def test_overrides_win_over_the_file_in_order(tmp_path):
    path = _write(tmp_path, "train:\n  steps: 10\n  seed: 3\n")
    cfg = load(path, ["train.steps=40", "train.steps=50"])
    assert cfg.train.steps == 50
    assert cfg.train.seed == 3


def test_optional_int_accepts_value_and_null():
    assert load(None, ["model.head_dim=32"]).model.head_dim == 32
    cfg = load(None, ["model.head_dim=32", "model.head_dim=null"])
    assert cfg.model.head_dim is None
    assert cfg.model.hd == cfg.model.d_model // cfg.model.n_heads


def test_batch_sizes_in_samples_and_tokens():
    cfg = load(
        None,
        [
            "train.micro_batch_size=4",
            "train.grad_accum=3",
            "mesh.data=2",
            "mesh.fsdp=2",
            "model.seq_len=64",
        ],
    )
    assert cfg.dp == 4
    assert cfg.global_batch == 4 * 3 * 4
    assert cfg.tokens_per_step == 4 * 3 * 4 * 64


def test_dump_round_trips(tmp_path):
    cfg = load(None, ["optim.lr=1e-3", "train.profile_steps=[1, 2]", "model.remat=full"])
    path = tmp_path / "config.yaml"
    path.write_text(parse.dump(cfg))
    assert load(path) == cfg


# --------------------------------------------------------------------------- errors


def test_unknown_key_suggests_closest():
    message = _error("train.stepz=5")
    assert "train.stepz" in message and "train.steps" in message


def test_unknown_section_suggests_closest():
    message = _error("trian.steps=5")
    assert "trian" in message and "did you mean train" in message


def test_yaml_key_without_space_is_named(tmp_path):
    """YAML reads `{path:x}` as the key 'path:x': the error says to add the space."""
    message = _error("data.mixture=[{path:/tmp/a, weight: 1}]")
    assert "write 'path: /tmp/a'" in message, message
    path = _write(tmp_path, "train: {steps:3}\n")
    assert "write 'steps: 3'" in _error(path=path)


def test_unknown_key_in_yaml_file(tmp_path):
    path = _write(tmp_path, "optim:\n  learning_rate: 0.1\n")
    message = _error(path=path)
    assert "optim.learning_rate" in message


def test_unknown_key_without_close_match_lists_known_keys():
    message = _error("mesh.zzzzzz=2")
    assert "mesh.zzzzzz" in message and "tensor" in message


@pytest.mark.parametrize(
    "override, key",
    [
        ("train.steps=abc", "train.steps"),
        ("train.steps=1.5", "train.steps"),
        ("train.steps=true", "train.steps"),
        ("optim.lr=fast", "optim.lr"),
        ("model.tie_embeddings=maybe", "model.tie_embeddings"),
        ("model.tie_embeddings=1", "model.tie_embeddings"),
        ("model.dtype=float64", "model.dtype"),
        ("train.profile_steps=5", "train.profile_steps"),
        ("train.profile_steps=[a, b]", "train.profile_steps"),
        ("model.head_dim=wide", "model.head_dim"),
        ("data.path=[1, 2]", "data.path"),
    ],
)
def test_wrong_type_names_the_key(override, key):
    assert key in _error(override)


def test_a_seed_past_32_bits_is_refused():
    """JAX's key keeps 32 bits: train.seed=2**32 initialised as seed 0 under another name."""
    assert "train.seed must be in 0..4294967295" in _error(f"train.seed={2**32}")
    assert "would be seed 0's" in _error(f"train.seed={2**32}")
    assert "train.seed must be in" in _error("train.seed=-1")
    assert load(None, [f"train.seed={2**32 - 1}"]).train.seed == 2**32 - 1


def test_wrong_type_in_yaml_file(tmp_path):
    path = _write(tmp_path, "model:\n  n_layers: four\n")
    assert "model.n_layers" in _error(path=path)


def test_d_model_must_divide_by_n_heads():
    message = _error("model.d_model=100", "model.n_heads=3", "model.n_kv_heads=1")
    assert "model.d_model" in message and "model.n_heads" in message


def test_explicit_head_dim_lifts_the_d_model_rule():
    cfg = load(
        None, ["model.d_model=96", "model.n_heads=5", "model.n_kv_heads=1", "model.head_dim=16"]
    )
    assert cfg.model.hd == 16


def test_n_heads_must_divide_by_n_kv_heads():
    message = _error("model.n_heads=4", "model.n_kv_heads=3")
    assert "model.n_heads" in message and "model.n_kv_heads" in message


def test_missing_file_names_it(tmp_path):
    missing = tmp_path / "nope.yaml"
    message = _error(path=missing)
    assert str(missing) in message


def test_a_directory_is_not_a_config_file_and_its_yaml_files_are_named(tmp_path):
    (tmp_path / "b.yaml").write_text("")
    (tmp_path / "a.yml").write_text("")
    (tmp_path / "notes.txt").write_text("")
    message = _error(path=f"{tmp_path}/")
    assert message == (
        f"config file '{tmp_path}/' is a directory; give one of its YAML files: "
        f"{tmp_path / 'a.yml'}, {tmp_path / 'b.yaml'}"
    )
    (tmp_path / "empty").mkdir()
    assert "is a directory, and holds no .yaml files" in _error(path=tmp_path / "empty")


def test_invalid_yaml_names_the_file_the_place_and_the_reason(tmp_path):
    path = _write(tmp_path, "model:\n  d_model: [1, 2\n")
    message = _error(path=path)
    assert str(path) in message and "line 3, column 1" in message and "expected" in message


def test_top_level_must_be_sections(tmp_path):
    path = _write(tmp_path, "steps: 10\n")
    assert "steps" in _error(path=path)


def test_override_without_equals_sign():
    assert "train.steps" in _error("train.steps")


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["train.steps=0"], "train.steps"),
        (["optim.warmup_steps=400", "train.steps=300"], "optim.warmup_steps"),
        (["optim.min_lr=1.0", "optim.lr=0.1"], "optim.min_lr"),
        (["optim.lr=inf"], "optim.lr must be positive and finite"),  # a nan lr from step 1
        (["train.steps=3", "optim.warmup_steps=1", "train.profile_steps=[1, 3]"], "ends at 2"),
        (["data.source=files"], "data.path"),
        (["data.eval_fraction=1.0"], "data.eval_fraction"),
        (["mesh.data=-1", "mesh.fsdp=-1"], "-1"),
        (["mesh.tensor=0"], "mesh.tensor"),
        (["parallel.zero=4"], "parallel.zero"),
        (["model.remat=sometimes"], "model.remat"),
        (["model.remat=[query, bogus]"], "model.remat"),
        (["model.loss_chunk=100", "model.seq_len=256"], "model.loss_chunk"),
        (["model.loss_chunk=-1"], "model.loss_chunk"),
        (["model.attention=flash9000"], "model.attention"),
        (["model.attention_blocks=[64, 64]"], "model.attention_blocks"),
        (["model.fp8=delayed", "model.fp8_history=0"], "model.fp8_history"),
        (["model.fp8=tensorwise", "model.fp8_history=8"], "model.fp8_history"),  # for nothing
        (["model.fp8_layers=[wq]"], "model.fp8_layers"),  # model.fp8=none: for nothing
        (["model.fp8=rowwise", "model.fp8_layers=[wq, lm_head]"], "model.fp8_layers"),
        (["model.fp8=rowwise", "model.fp8_layers=[]"], "model.fp8_layers"),
        (  # an MoE layer in every layer: no dense MLP (it ran without FP8, silently)
            ["model.moe_experts=4", "model.fp8=rowwise", "model.fp8_layers=[wq, w_up]"],
            "model.fp8_layers: w_up is not in this model",
        ),
        (["model.fp8=rowwise", "parallel.fp8_gather=true"], "parallel.fp8_gather"),
        (["parallel.fp8_gather=true"], "parallel.fp8_gather"),  # model.fp8=none
        (["model.attention_blocks=[64, 64, 48, 64]"], "model.attention_blocks"),
        (["model.attention_backward=atomic"], "model.attention_backward"),
        (["parallel.collectives=nccl"], "parallel.collectives"),
        (["parallel.grad_reduce_dtype=float16"], "parallel.grad_reduce_dtype"),
    ],
)
def test_inconsistent_values_are_rejected(overrides, key):
    assert key in _error(*overrides)


# --------------------------------------------------------------------------- loss_chunk

# the 1B GPU shape of scripts/bench_step.py --sizes 1b with micro-batch 8: fp32 logits of
# 8 x 2048 x 128256 x 4 bytes = 7.8 GiB per micro-batch (a small model: only the head counts)
BIG_LOGITS = ["model.vocab_size=128256", "model.seq_len=2048", "train.micro_batch_size=8"]
TINY = Path(__file__).parents[1] / "configs" / "tiny.yaml"


def test_loss_chunk_auto_resolves_where_the_logits_are_large():
    """model.loss_chunk=null: 0 where one micro-batch's fp32 logits per device fit 1 GiB
    (tiny: its losses stay as they were), else the largest divisor of the tokens per device
    up to 1024 whose chunk's logits fit 1 GiB; an explicit value is kept, 0 included."""
    assert Config().model.loss_chunk is None  # the default is auto
    assert load(TINY).model.loss_chunk == 0
    assert load(None, BIG_LOGITS).model.loss_chunk == 256  # 0.98 GiB a chunk, not 3.9
    assert load(None, [*BIG_LOGITS, "model.loss_chunk=0"]).model.loss_chunk == 0
    assert load(None, [*BIG_LOGITS, "model.loss_chunk=256"]).model.loss_chunk == 256
    # 512 tokens a device, 1.96 GiB of logits: a chunk short of the whole, or none at all
    assert load(None, [*BIG_LOGITS, "mesh.sequence=4"]).model.loss_chunk == 256
    assert load(None, [*BIG_LOGITS, "model.seq_len=1536"]).model.loss_chunk == 256
    # 125m-like: a 32768 vocabulary, 2 GiB of logits: halves of 1 GiB
    assert load(None, [*BIG_LOGITS, "model.vocab_size=32768"]).model.loss_chunk == 1024
    # a chunk of even 128 tokens above 1 GiB: the smallest chunk, not none
    assert load(None, [*BIG_LOGITS, "train.micro_batch_size=64"]).model.loss_chunk == 128
    # per device: 2 rows of 2048 tokens, the vocabulary split 4 ways -> 0.49 GiB, whole
    split = load(
        None, [*BIG_LOGITS, "train.micro_batch_size=2", "mesh.tensor=4", "model.n_kv_heads=4"]
    )
    assert split.model.loss_chunk == 0
    # a sequence with no divisor in [128, 1024] stays whole rather than in tiny chunks
    assert load(None, [*BIG_LOGITS, "model.seq_len=2053"]).model.loss_chunk == 0


def test_loss_chunk_auto_waits_for_a_filled_mesh_and_keeps_the_run_directory(tmp_path):
    """A -1 mesh size leaves auto open until the device count fills it (cp or tp may be
    the fill); resolving it changes no run directory, as no loss_chunk does."""
    cfg = load(None, [*BIG_LOGITS, "mesh.data=1", "mesh.sequence=-1"])
    assert cfg.model.loss_chunk is None
    resolve_mesh(cfg, 2)
    assert cfg.model.loss_chunk == 256  # 1024 tokens a device, 3.9 GiB: in four chunks
    path = _write(tmp_path, "model: {vocab_size: 128256, seq_len: 2048}\n")
    auto = load(path, ["train.micro_batch_size=8"])
    assert auto.model.loss_chunk == 256
    for explicit in ("model.loss_chunk=0", "model.loss_chunk=1024"):
        assert (
            load(path, ["train.micro_batch_size=8", explicit]).train.run_dir == auto.train.run_dir
        )
    assert load(TINY).train.run_dir == load(TINY, ["model.loss_chunk=0"]).train.run_dir


# --------------------------------------------------------------------------- mesh


def test_resolve_mesh_fills_minus_one():
    cfg = load(None, ["mesh.data=2", "mesh.fsdp=-1"])
    resolve_mesh(cfg, 8)
    assert (cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor) == (2, 4, 1)


def test_resolve_mesh_fill_must_divide_device_count():
    cfg = load(None, ["mesh.data=3", "mesh.fsdp=-1"])
    with pytest.raises(ConfigError, match=r"mesh\.fsdp=-1"):
        resolve_mesh(cfg, 8)


def test_resolve_mesh_product_must_equal_device_count():
    cfg = load(None, ["mesh.data=2", "mesh.fsdp=2"])
    with pytest.raises(ConfigError, match="multiply to 4") as info:
        resolve_mesh(cfg, 8)
    assert "8 devices" in str(info.value)


def test_resolve_mesh_accepts_exact_product():
    cfg = load(None, ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"])
    resolve_mesh(cfg, 8)
    assert cfg.mesh.tensor == 2


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["model.n_heads=4", "model.n_kv_heads=1", "mesh.tensor=2"], "model.n_kv_heads"),
        (
            ["model.n_heads=6", "model.n_kv_heads=3", "model.d_model=96", "mesh.tensor=4"],
            "model.n_heads",
        ),
        (["model.d_ff=301", "mesh.tensor=2"], "model.d_ff"),
        (["model.vocab_size=385", "mesh.tensor=2"], "model.vocab_size"),
        # an expert's hidden size: a traceback from the parameters' placement before
        (["model.moe_experts=4", "model.moe_d_ff=65", "mesh.tensor=2"], "model.moe_d_ff"),
    ],
)
def test_tensor_divisibility(overrides, key):
    message = _error(*overrides)
    assert key in message and "mesh.tensor" in message


def test_tensor_divisibility_checked_after_fill():
    cfg = load(None, ["model.n_heads=4", "model.n_kv_heads=2", "mesh.tensor=-1"])
    with pytest.raises(ConfigError, match=r"model\.n_heads \(4\).*mesh\.tensor \(8\)"):
        resolve_mesh(cfg, 8)


def test_zero_needs_d_model_divisible_by_fsdp():
    message = _error("model.d_model=96", "model.n_heads=4", "mesh.fsdp=5", "parallel.zero=1")
    assert "model.d_model" in message and "mesh.fsdp" in message


def test_data_path_without_the_files_source_is_an_error():
    message = _error("data.path=corpus.txt")
    assert message.startswith("data.path") and "data.source=files" in message


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["parallel.zero=3"], "parallel.zero=3"),
        (["parallel.sequence_parallel=true"], "parallel.sequence_parallel"),
        (["parallel.pipeline_schedule=zb-h1"], "parallel.pipeline_schedule"),
        (["parallel.context=allgather"], "parallel.context"),
        (["data.source=prepared", "data.path=d", "data.tokenizer=t.json"], "data.tokenizer"),
        (["data.strict=true"], "data.strict=true"),
        (["data.source=prepared", "data.path=d", "data.strict=true"], "data.strict=true"),
        (["train.noise_every=10"], "train.noise_every"),
        (["model.attention=tiled", "model.attention_blocks=[64,64,64,64]"], "model.attention_b"),
        (["model.attention=xla", "model.attention_backward=fused"], "model.attention_backward"),
        (  # both in one line
            [
                "model.attention=cudnn",
                "model.attention_backward=fused",
                "model.attention_blocks=[64,64,64,64]",
            ],
            "model.attention_blocks=[64, 64, 64, 64] and model.attention_backward=fused have",
        ),  # fmt: skip
        (["model.scan_unroll=4", "model.remat=full"], "model.scan_unroll=4"),
        (["model.scan_unroll=2", "mesh.fsdp=2", "parallel.zero=3"], "model.scan_unroll=2"),
        (["model.scan_layers=false", "model.scan_unroll=2"], "model.scan_unroll=2"),
        (
            ["model.scan_layers=false", "model.scan_unroll=2", "model.remat=full"],
            "model.scan_unroll=2 has no effect with model.scan_layers=false",
        ),
        (
            ["model.scan_layers=false", "mesh.pipeline=2", "train.grad_accum=2"],
            "model.scan_layers=false",
        ),
        (
            ["model.scan_layers=false", "model.moe_experts=4", "model.moe_every=2"],
            "model.scan_layers=false",
        ),
        (["model.scan_layers=false", "mesh.fsdp=2", "parallel.zero=3"], "model.scan_layers"),
        (
            ["model.fp8=tensorwise", "parallel.fp8_gather=true", "mesh.fsdp=2", "parallel.zero=2"],
            "parallel.fp8_gather",
        ),  # fmt: skip
        # settings nothing else set reads (they were silent; rope_factor even named the run)
        (["model.rope_factor=4.0"], "model.rope_factor=4.0 has no effect with model.rope_sc"),
        (["model.rope_scaling=linear", "model.rope_factor=2.0", "model.rope_low_freq_factor=2.0"],
         "model.rope_low_freq_factor=2.0 has no effect with model.rope_scaling=linear"),
        (["optim.decay_fraction=0.5"], "optim.decay_fraction=0.5 has no effect with optim.sch"),
        (["optim.schedule=constant", "optim.min_lr=1e-4"], "optim.min_lr=0.0001 has no effect"),
        (["optim.name=sgd", "optim.b1=0.8", "optim.eps=1e-6"], "optim.b1=0.8, optim.eps=1e-06"),
        (["parallel.diloco_outer_lr=0.1"], "parallel.diloco_outer_lr=0.1 has no effect with par"),
        (["data.eval_fraction=0", "train.eval_batches=2"], "train.eval_batches=2 has no effect"),
        # each MoE balance reads its own coefficient; a schedule, prefetch, eval cadence
        (["model.moe_experts=4", "model.moe_balance=bias", "model.moe_aux_coef=0.5"],
         "model.moe_aux_coef=0.5 has no effect with model.moe_balance=bias"),
        (["model.moe_experts=4", "model.moe_bias_rate=0.5"],
         "model.moe_bias_rate=0.5 has no effect with model.moe_balance=aux"),
        (["model.moe_experts=4", "model.moe_balance=none", "model.moe_aux_coef=0.5",
          "model.moe_bias_rate=0.5"], "model.moe_aux_coef=0.5, model.moe_bias_rate=0.5 have"),
        (["optim.schedule=constant", "optim.schedule_steps=100"],
         "optim.schedule_steps=100 has no effect with optim.schedule=constant"),
        (["parallel.prefetch=false", "mesh.fsdp=2", "parallel.zero=1"],
         "parallel.prefetch=false has no effect with parallel.zero=1 and mesh.fsdp=2"),
        (["train.eval_batches=0", "train.eval_every=1"], "train.eval_every=1 has no effect"),
    ],
)  # fmt: skip
def test_settings_without_effect_are_named_once(overrides, key):
    lines = no_effect(load(None, overrides))
    assert len(lines) == 1 and lines[0].startswith(key) and "\n" not in lines[0], lines


def test_settings_with_effect_give_no_warning():
    cfg = load(None, ["mesh.fsdp=2", "parallel.zero=1", "mesh.tensor=2",
                      "parallel.sequence_parallel=true"])  # fmt: skip
    assert no_effect(cfg) == []
    # cuDNN takes no tiles, but under context parallelism the ring's pairs run the kernel
    kernel = ["model.attention_blocks=[64,64,64,64]", "model.attention_backward=fused"]
    assert no_effect(load(None, ["model.attention=cudnn", "mesh.sequence=2", *kernel])) == []
    assert no_effect(load(None, kernel)) == []  # auto: the kernel where packed on a GPU
    # a Python layer loop under ZeRO-3 without prefetch, and for an MoE layer in every layer
    assert no_effect(load(None, ["model.scan_layers=false", "mesh.fsdp=2", "parallel.zero=3",
                                 "parallel.prefetch=false"])) == []  # fmt: skip
    assert no_effect(load(None, ["model.scan_layers=false", "model.moe_experts=4"])) == []
    # the loop's recomputation holds on a GPU, not on a CPU (docs/memory.md)
    loop = load(None, ["model.scan_layers=false", "model.remat=selective"])
    assert no_effect(loop, "gpu") == [] and no_effect(loop) == []
    # the settings that read them: llama3 scaling, wsd, adamw, DiLoCo, a held-out split
    rope = ["model.rope_scaling=llama3", "model.rope_factor=8.0", "model.rope_low_freq_factor=2.0"]
    read = [*rope, "optim.schedule=wsd", "optim.decay_fraction=0.5", "optim.b1=0.8",
            "mesh.data=2", "parallel.diloco_steps=4", "parallel.diloco_outer_lr=0.1"]  # fmt: skip
    assert no_effect(load(None, read)) == []
    # a constant schedule does not read optim.min_lr, so it need not sit below optim.lr
    assert no_effect(load(None, ["optim.schedule=constant", "optim.lr=1e-4"])) == []
    (line,) = no_effect(loop, "cpu")
    assert line.startswith("model.scan_layers=false with model.remat=selective holds on a CPU")


def test_settings_without_effect_on_the_platform_are_named():
    """What the backend decides: `auto`'s attention, the GPU's XLA flags, and the ring's
    pairs of chunks, which the Pallas kernel runs only where the chunk fits its tiles (they
    fell back to plain XLA without a word)."""
    kernel = ["model.attention_blocks=[32,32,32,32]", "model.attention_backward=fused"]
    (line,) = no_effect(load(None, ["model.seq_len=256", *kernel]), "cpu")
    assert "have no effect with model.attention=auto, tiled here, (the Pallas" in line
    assert no_effect(load(None, ["data.cross_doc_mask=true", *kernel]), "gpu") == []  # pallas
    (line,) = no_effect(load(None, ["parallel.overlap=false"]), "cpu")
    assert line.startswith("parallel.overlap=False has no effect with the cpu backend")
    assert no_effect(load(None, ["parallel.overlap=false"]), "gpu") == []
    ring = ["mesh.sequence=2", "model.seq_len=256", "data.cross_doc_mask=true"]
    big, small = "model.attention_blocks=[128,128,128,128]", "model.attention_blocks=[64,64,64,64]"
    for platform, attention in (("gpu", "auto"), ("gpu", "cudnn"), ("cpu", "pallas")):
        cfg = load(None, [*ring, f"model.attention={attention}", big])
        (line,) = no_effect(cfg, platform)  # 64-token chunks: the pairs run in plain XLA
        assert line.startswith(f"model.attention={attention} under context parallelism")
        assert "a chunk of 64 tokens" in line and "their lcm is 128" in line
        fits = load(None, [*ring, f"model.attention={attention}", small])
        assert no_effect(fits, platform) == []  # the kernel runs them
    # and on a CPU that kernel cannot run inside the step: refused before it is built
    cfg = load(None, [*ring, "model.attention=pallas", small])
    assert "whose CPU interpreter fails JAX's varying-axes check" in unsupported(cfg, "cpu")
    assert unsupported(cfg, "gpu") is None


def test_odd_head_dimension_says_what_to_change():
    message = _error("model.d_model=100", "model.n_heads=4")
    assert "head dimension 25" in message and "model.head_dim" in message


def test_mesh_fill_error_points_to_cpu_devices():
    cfg = load(None, ["mesh.data=-1", "mesh.tensor=8"])
    with pytest.raises(ConfigError, match="--cpu-devices 8"):
        resolve_mesh(cfg, 1)


def test_help_lists_every_key_with_a_default_that_loads_back():
    """The commands' --help epilog: every key once, and each line is a valid override
    giving the default config back."""
    lines = [line.strip() for line in parse.keys_help().splitlines()[1:]]
    keys = [line.split("=", 1)[0] for line in lines]
    assert len(keys) == len(set(keys)) and "model.d_model" in keys and "mesh.dcn.pipeline" in keys
    assert parse.dump(load(None, lines)) == parse.dump(load(None, []))


# --------------------------------------------------------------------------- run directories


def test_run_directory_is_named_after_the_config_and_what_defines_the_run(tmp_path):
    """Unset train.run_dir: runs/<file name>-<hash of model, data, optim, seed>. The same
    command finds the same directory (a requeued job resumes); a changed shape, dataset,
    optimizer or seed gets its own; layout, batch split, length, logging and how the step
    computes (attention backend, remat) do not."""
    path = _write(tmp_path, "model: {d_model: 64, n_heads: 4}\n")
    base = load(path).train.run_dir
    assert base.startswith("runs/run-") and len(base) == len("runs/run-") + 6
    assert load(path).train.run_dir == base
    same = ["train.steps=70", "data.prefetch=0", "mesh.data=2", "train.log_every=3",
            "train.grad_accum=4", "optim.schedule_steps=50", "checkpoint.every=5",
            "model.attention=blocked", "model.remat=full", "model.scan_unroll=2",
            "model.loss_chunk=16", "model.attention_blocks=[64,64,32,32]",
            "model.attention_backward=fused"]  # fmt: skip
    for override in same:
        assert load(path, [override]).train.run_dir == base, override
    others = {load(path, [o]).train.run_dir for o in (
        "model.d_model=128", "model.n_layers=2", "data.cross_doc_mask=true", "optim.lr=1e-2",
        "train.seed=1")}  # fmt: skip
    assert len(others) == 5 and base not in others
    assert load(None).train.run_dir.startswith("runs/default-")
    assert load(path, ["train.run_dir=somewhere"]).train.run_dir == "somewhere"


def test_data_strict_is_outside_the_run_identity():
    """strict trains on the same documents as not strict, or refuses to start: the same run
    (and adding the key left every existing run's directory where it was)."""
    strict = load(None, ["data.source=files", "data.path=corpus.jsonl", "data.strict=true"])
    assert strict.data.strict is True
    loose = load(None, ["data.source=files", "data.path=corpus.jsonl"])
    assert loose.data.strict is False
    assert parse.run_identity(strict) == parse.run_identity(loose)
    assert no_effect(strict) == []


def test_resume_modes():
    assert load(None, ["checkpoint.resume=none"]).checkpoint.resume == "never"  # older name
    for mode in ("auto", "never", "must", "runs/x/checkpoints/10"):
        assert load(None, [f"checkpoint.resume={mode}"]).checkpoint.resume == mode
    assert "optim.schedule_steps (5) must be larger" in _error(
        "optim.schedule_steps=5", "optim.warmup_steps=5"
    )
