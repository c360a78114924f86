"""Hugging Face conversion, checked against transformers itself: logits within 1e-4 in
fp32, from Hugging Face to ours and back."""

import dataclasses
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
import transformers

from ultrajax import cli
from ultrajax.config import parse
from ultrajax.config import schema as config
from ultrajax.model.llama import init_params
from ultrajax.model.stack import forward
from ultrajax.tools import convert
from ultrajax.train import checkpoint

TOL = 1e-4
REPO = Path(__file__).resolve().parents[1]


def hf_model(path, seed=0, **overrides):
    """A small random LlamaForCausalLM (every weight random, norms too), saved in fp32."""
    kw = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA
        rope_theta=50000.0,  # not the default 10000
        rms_norm_eps=1e-6,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    kw.update(overrides)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw)).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(path, max_shard_size="100KB")  # sharded: index.json + shards
    return model


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.from_numpy(ids)).logits.numpy()


def our_logits(ck, ids, **model_changes):
    m = dataclasses.replace(checkpoint.read_config(ck).model, **model_changes)
    params = checkpoint.load_params(ck, m)
    with jax.default_matmul_precision("highest"):
        return np.asarray(jax.jit(lambda p, t: forward(m, p, t))(params, ids))


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert")
    model = hf_model(root / "hf")
    assert len(list((root / "hf").glob("*.safetensors"))) > 1
    assert convert.main(["hf-to-orbax", "--hf", str(root / "hf"), "--out", str(root / "ck")]) == 0
    ids = np.random.default_rng(0).integers(0, 320, (2, 24))
    return root, model, ids


def test_hf_to_orbax_matches_transformers(converted):
    root, model, ids = converted
    diff = np.abs(hf_logits(model, ids) - our_logits(root / "ck", ids)).max()
    print(f"hf-to-orbax: max abs logit difference {diff:.2e}")
    assert diff <= TOL
    cfg = parse.load(root / "ck" / "config.yaml")  # the YAML written beside it is a valid config
    assert cfg.model.n_kv_heads == 2 and cfg.model.rope_theta == 50000.0
    assert cfg.checkpoint.init_from == str((root / "ck").absolute())


def test_orbax_to_hf_round_trip(converted, capsys):
    root, model, ids = converted
    out = root / "back"
    capsys.readouterr()
    assert convert.main(["orbax-to-hf", "--checkpoint", str(root / "ck"), "--out", str(out)]) == 0
    said = capsys.readouterr().out.splitlines()
    assert said[0] == f"converting {root / 'ck'} to {out} ..."  # before the minutes of a large one
    assert said[-1] == f"wrote {out / 'config.json'} and safetensors shards"
    again = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    diff = np.abs(hf_logits(model, ids) - hf_logits(again, ids)).max()
    print(f"orbax-to-hf: max abs logit difference {diff:.2e}")
    assert diff <= TOL
    capsys.readouterr()
    assert convert.main(["verify", "--hf", str(out), "--checkpoint", str(root / "ck")]) == 0
    printed = capsys.readouterr().out
    assert float(printed.split("difference:")[1].split()[0]) <= TOL
    assert printed.splitlines()[-1].startswith("PASS: ")


def test_tied_embeddings_and_explicit_head_dim(tmp_path):
    model = hf_model(
        tmp_path / "hf", seed=1, tie_word_embeddings=True, head_dim=32, num_key_value_heads=1
    )
    argv = ["hf-to-orbax", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ck")]
    assert convert.main(argv) == 0
    m = checkpoint.read_config(tmp_path / "ck").model
    assert m.tie_embeddings and m.hd == 32 and m.d_model // m.n_heads == 16
    ids = np.random.default_rng(1).integers(0, 320, (1, 16))
    assert np.abs(hf_logits(model, ids) - our_logits(tmp_path / "ck", ids)).max() <= TOL


# Rope scaling as Llama 3.1/3.2 and linear-scaled models use it. original_max_position
# 32 with theta 50000 and head_dim 16 puts the 8 frequencies in all three llama3 bands
# (kept, smoothed, divided); the test sequence (64) is twice that length.
SCALINGS = {
    "llama3": dict(
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
    ),
    "linear": dict(rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 50000.0}),
}


@pytest.fixture(scope="module", params=sorted(SCALINGS))
def scaled(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"rope_{request.param}")
    model = hf_model(root / "hf", seed=2, **SCALINGS[request.param])
    assert convert.main(["hf-to-orbax", "--hf", str(root / "hf"), "--out", str(root / "ck")]) == 0
    ids = np.random.default_rng(2).integers(0, 320, (2, 64))
    return request.param, root, model, ids


def test_rope_scaling_hf_to_orbax_matches_transformers(scaled):
    kind, root, model, ids = scaled
    m = parse.load(root / "ck" / "config.yaml").model
    assert m.rope_scaling == kind and m.rope_theta == 50000.0
    assert m.rope_factor == (8.0 if kind == "llama3" else 4.0)
    if kind == "llama3":
        assert (m.rope_low_freq_factor, m.rope_high_freq_factor) == (1.0, 4.0)
        assert m.rope_original_max_len == 32
    ref = hf_logits(model, ids)
    diff = np.abs(ref - our_logits(root / "ck", ids)).max()
    print(f"{kind}: hf-to-orbax max abs logit difference {diff:.2e}")
    assert diff <= TOL
    # the scaling matters here: without it the logits are far off
    assert np.abs(ref - our_logits(root / "ck", ids, rope_scaling="none")).max() > 100 * TOL


def test_rope_scaling_orbax_to_hf_round_trip(scaled, capsys):
    kind, root, model, ids = scaled
    out = root / "back"
    assert convert.main(["orbax-to-hf", "--checkpoint", str(root / "ck"), "--out", str(out)]) == 0
    written = json.loads((out / "config.json").read_text())
    assert written["rope_parameters"]["rope_type"] == written["rope_scaling"]["rope_type"] == kind
    again = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert again.config.rope_parameters == model.config.rope_parameters
    diff = np.abs(hf_logits(model, ids) - hf_logits(again, ids)).max()
    print(f"{kind}: orbax-to-hf max abs logit difference {diff:.2e}")
    assert diff <= TOL
    capsys.readouterr()
    argv = ["verify", "--hf", str(out), "--checkpoint", str(root / "ck"), "--tokens", "64"]
    assert convert.main(argv) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("PASS: ")


def test_llama3_config_json_both_spellings():
    """Meta's Llama-3.2-1B config.json (rope_scaling, top-level rope_theta) and the same
    model as transformers 5 writes it (rope_parameters only) read alike."""
    old = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
    }
    new = {k: v for k, v in old.items() if k not in ("rope_theta", "rope_scaling")}
    new["rope_parameters"] = {**old["rope_scaling"], "rope_theta": 500000.0}
    m = convert.model_config_from_hf(old)
    assert m == convert.model_config_from_hf(new)
    assert (m.rope_scaling, m.rope_factor, m.rope_theta) == ("llama3", 32.0, 500000.0)
    assert (m.rope_low_freq_factor, m.rope_high_freq_factor, m.rope_original_max_len) == (
        1.0,
        4.0,
        8192,
    )
    # and written back in both spellings
    tree = convert.hf_config(m, "bfloat16")
    assert tree["rope_parameters"] == new["rope_parameters"]
    assert tree["rope_scaling"] == old["rope_scaling"] and tree["rope_theta"] == 500000.0


def test_verify_verdict_and_exit_code(converted, scaled, capsys):
    """A scaled Hugging Face model against the unscaled checkpoint: FAIL, exit 1."""
    root, _, _ = converted
    kind, scaled_root, _, _ = scaled
    argv = ["verify", "--hf", str(scaled_root / "hf"), "--checkpoint", str(root / "ck")]
    with pytest.raises(SystemExit) as e:
        cli.run(lambda: convert.main(argv))
    assert e.value.code == 1
    out = capsys.readouterr().out
    assert f"note: model.rope_scaling is none in {root / 'ck'}, {kind} in" in out
    assert "using the config's" not in out  # each difference said once, as it is used
    assert len([line for line in out.splitlines() if "model.rope_scaling" in line]) == 1
    verdict = out.splitlines()[-1]
    assert verdict.startswith("FAIL: ") and verdict.endswith("> tol 0.0001"), verdict
    assert convert.main(argv + ["--tol", "1e9"]) == 0  # a looser bound passes
    assert capsys.readouterr().out.splitlines()[-1].startswith("PASS: ")
    # more tokens than the model's length were cut to it, and the verdict said nothing
    assert "--tokens must be in 1..64" in _error(argv + ["--tokens", "65"], capsys)


def _error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        cli.run(lambda: convert.main(argv))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: ")
    return err


def test_unsupported_and_mismatched_inputs(converted, tmp_path, capsys):
    root, _, _ = converted
    hf = json.loads((root / "hf" / "config.json").read_text())
    cases = {
        "architecture MistralForCausalLM": dict(architectures=["MistralForCausalLM"]),
        "rope_scaling type 'dynamic' is not supported (only default, linear, llama3)": dict(
            rope_scaling={"rope_type": "dynamic", "factor": 2.0}
        ),
        "rope_parameters type 'yarn' is not supported": dict(
            rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 50000.0}
        ),
        "rope_scaling type 'llama3' needs a number 'low_freq_factor'": dict(
            rope_scaling={"rope_type": "llama3", "factor": 8.0}
        ),
        "attention_bias=true": dict(attention_bias=True),
        "'model.layers.0.mlp.gate_proj.weight' has shape (96, 64)": dict(intermediate_size=128),
    }
    for i, (message, change) in enumerate(cases.items()):
        d = tmp_path / f"hf{i}"
        d.mkdir()
        for f in (root / "hf").iterdir():
            (d / f.name).symlink_to(f)
        (d / "config.json").unlink()
        (d / "config.json").write_text(json.dumps({**hf, **change}))
        err = _error(["hf-to-orbax", "--hf", str(d), "--out", str(tmp_path / f"o{i}")], capsys)
        assert message in err, err
        assert not (tmp_path / f"o{i}").exists()  # nothing half-written
    # a truncated shard (a download cut short): a traceback from safetensors before
    d = tmp_path / "cut"
    d.mkdir()
    shards = sorted((root / "hf").glob("*.safetensors"))
    for f in (root / "hf").iterdir():
        if f != shards[-1]:
            (d / f.name).symlink_to(f)
    (d / shards[-1].name).write_bytes(shards[-1].read_bytes()[:1000])
    err = _error(["hf-to-orbax", "--hf", str(d), "--out", str(tmp_path / "o_cut")], capsys)
    assert f"{d / shards[-1].name} is not a readable safetensors file" in err, err
    assert not (tmp_path / "o_cut").exists()
    # the --out directory is never overwritten
    assert "not empty" in _error(
        ["hf-to-orbax", "--hf", str(root / "hf"), "--out", str(root / "ck")], capsys
    )


@pytest.mark.slow
def test_command_line_error_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    cmd = [sys.executable, "-m", "ultrajax.convert", "hf-to-orbax", "--hf", str(tmp_path)]
    run = subprocess.run(cmd + ["--out", str(tmp_path / "o")], capture_output=True, text=True)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        f"error: {tmp_path}/config.json: architecture model_type 'gpt2' is not supported "
        "(only LlamaForCausalLM, MixtralForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM)"
    ]


def tiny_checkpoint(path, tokenizer="bytes"):
    """A parameter-only checkpoint of a tiny model (zeros: only the tokenizer is checked)."""
    m = config.ModelConfig(vocab_size=384, d_model=16, n_layers=1, n_heads=2, d_ff=32, seq_len=16)
    cfg = config.Config(model=m)
    cfg.data.tokenizer = tokenizer
    shapes = checkpoint.abstract_params(m)
    params = jax.tree.map(lambda a: np.zeros(a.shape, np.float32), shapes)
    checkpoint.write_params(path, params, cfg)
    return path


def test_orbax_to_hf_byte_tokenizer_gives_our_ids(tmp_path):
    from ultrajax.data.tokenizer import ByteTokenizer

    ck = tiny_checkpoint(tmp_path / "ck")
    convert.orbax_to_hf(ck, tmp_path / "hf")
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    ours = ByteTokenizer()
    text = "Grüße, 世界! naïve café 🙂\ttabs  and\nlines <s> ∑"
    want = [ours.BOS, *ours.encode(text).tolist()]  # what train and generate feed the model
    assert tok(text)["input_ids"] == want
    assert tok.encode(text, add_special_tokens=False) == want[1:]
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (256, 257, 258)
    assert tok.decode(want, skip_special_tokens=True) == ours.decode(want) == text
    assert tok.decode([*want, ours.EOS], skip_special_tokens=True) == text
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (hf["bos_token_id"], hf["eos_token_id"], hf["vocab_size"]) == (256, 257, 384)


def test_orbax_to_hf_copies_a_tokenizer_json_or_warns(tmp_path, capsys):
    source = tmp_path / "my_tokenizer.json"
    convert.byte_tokenizer_json().save(str(source))
    convert.orbax_to_hf(tiny_checkpoint(tmp_path / "ck", str(source)), tmp_path / "hf")
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == source.read_bytes()
    source.unlink()
    convert.orbax_to_hf(tmp_path / "ck", tmp_path / "hf2")
    err = capsys.readouterr().err.strip().splitlines()
    want = f"warning: data.tokenizer: file {str(source)!r} does not exist; no tokenizer written"
    assert err == [want]
    assert not (tmp_path / "hf2" / "tokenizer.json").exists()


def test_hugging_face_files_get_the_mode_of_any_new_file(tmp_path):
    """Shards readable as the user's umask allows (0644 typically), like config.json:
    safetensors alone leaves them 0600."""
    convert.orbax_to_hf(tiny_checkpoint(tmp_path / "ck"), tmp_path / "hf")
    umask = os.umask(0o022)
    os.umask(umask)
    written = sorted((tmp_path / "hf").iterdir())
    assert any(p.suffix == ".safetensors" for p in written)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in written}
    assert modes == {p.name: oct(0o666 & ~umask) for p in written}


BASE_INSTALL = """
import sys
for name in {hidden!r}:
    sys.modules[name] = None  # as if not installed: `import name` raises ImportError
from ultrajax.tools import convert
for argv in {commands!r}:
    assert convert.main(argv) == 0
"""


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_conversion_works_from_the_base_install(tmp_path):
    """Both directions with every package that only the [test] extra installs hidden: the
    README's first command installs the base alone, and conversion is a base feature."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    base = {_name(r) for r in project["dependencies"]}
    test_only = {_name(r) for r in project["optional-dependencies"]["test"]} - base
    hidden = sorted(
        module
        for module, dists in importlib.metadata.packages_distributions().items()
        if all(_name(d) in test_only for d in dists)
    )
    assert {"torch", "transformers"} <= set(hidden)
    ck = tiny_checkpoint(tmp_path / "ck")
    hf, back = tmp_path / "hf", tmp_path / "back"
    commands = [
        ["orbax-to-hf", "--checkpoint", str(ck), "--out", str(hf)],
        ["hf-to-orbax", "--hf", str(hf), "--out", str(back)],
    ]
    script = BASE_INSTALL.format(hidden=hidden, commands=commands)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, env=env,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (hf / "tokenizer.json").is_file() and (back / "config.yaml").is_file()
    assert "warning" not in proc.stderr


def test_rope_scaling_greedy_tokens_match_transformers(scaled):
    """Greedy decoding past the original context length: transformers' generate on the
    Hugging Face model and ours on the converted checkpoint pick the same tokens."""
    from ultrajax.tools import generate

    kind, root, model, ids = scaled
    prompt = ids[0, :40].tolist()  # already past original_max_position_embeddings (32)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0
        )
    theirs = out[0, len(prompt) :].tolist()
    m = checkpoint.read_config(root / "ck").model
    with jax.default_matmul_precision("highest"):
        ours = generate.generate(m, checkpoint.load_params(root / "ck", m), prompt, 12)
    assert ours == theirs, (kind, ours, theirs)


def mixtral_model(path, seed=0):
    """A small random MixtralForCausalLM (4 experts, top-2), saved in fp32."""
    kw = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        rope_theta=50000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=64,
        sliding_window=None,
        tie_word_embeddings=False,
    )
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**kw))
    return _random_save(model, path, seed)


def test_mixtral_both_ways_matches_transformers(tmp_path, capsys):
    """A Mixtral checkpoint (experts as separate tensors) converts to ours and back:
    logits within 1e-4 both ways, verify passes, greedy tokens as transformers'."""
    from ultrajax.tools import generate

    model = mixtral_model(tmp_path / "hf")
    ck, back = tmp_path / "ck", tmp_path / "back"
    assert convert.main(["hf-to-orbax", "--hf", str(tmp_path / "hf"), "--out", str(ck)]) == 0
    m = checkpoint.read_config(ck).model
    assert (m.moe_experts, m.moe_top_k, m.moe_d_ff, m.moe_router) == (4, 2, 48, "softmax")
    ids = np.random.default_rng(0).integers(0, 320, (2, 24))
    assert np.abs(hf_logits(model, ids) - our_logits(ck, ids)).max() <= TOL
    assert convert.main(["orbax-to-hf", "--checkpoint", str(ck), "--out", str(back)]) == 0
    again = transformers.MixtralForCausalLM.from_pretrained(back, dtype=torch.float32).eval()
    assert np.abs(hf_logits(model, ids) - hf_logits(again, ids)).max() <= TOL
    capsys.readouterr()
    assert convert.main(["verify", "--hf", str(back), "--checkpoint", str(ck)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("PASS: ")
    prompt = ids[0, :10].tolist()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                             pad_token_id=0)  # fmt: skip
    with jax.default_matmul_precision("highest"):
        ours = generate.generate(m, checkpoint.load_params(ck, m), prompt, 8)
    assert ours == out[0, len(prompt) :].tolist()


def test_an_moe_model_mixtral_cannot_hold_is_refused(tmp_path):
    """Shared experts (or a sigmoid router, unnormalised gates) have no Mixtral field."""
    cfg = config.Config(
        model=config.ModelConfig(
            vocab_size=64,
            d_model=32,
            n_layers=1,
            n_heads=2,
            n_kv_heads=1,
            d_ff=32,
            seq_len=16,
            moe_experts=4,
            moe_shared_experts=1,
        )  # fmt: skip
    )
    params = jax.tree.map(np.asarray, init_params(cfg.model, jax.random.key(0)))
    checkpoint.write_params(tmp_path / "ck", params, cfg)
    with pytest.raises(config.ConfigError, match="moe_shared_experts"):
        convert.orbax_to_hf(tmp_path / "ck", tmp_path / "out")


def _random_save(model, path, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.float().eval().save_pretrained(path, max_shard_size="100KB")
    return model


@pytest.mark.parametrize("kind", ["qwen3_moe"])  # dense qwen3: the same attention and
def test_qwen3_and_qwen3_moe_both_ways_match_transformers(kind, tmp_path, capsys):  # names
    """Qwen3-MoE (each head's queries and keys normalised: model.qk_norm; its experts'
    tensors named its way; unnormalised top-k gates; a dense layer before each MoE layer:
    decoder_sparse_step=2, model.moe_every): to ours and back within 1e-4, verify PASS.
    Dense Qwen3 takes the same path with Llama's MLP (kind="qwen3")."""
    kw = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=50000.0,
              rms_norm_eps=1e-6, max_position_embeddings=64, tie_word_embeddings=False)  # fmt: skip
    if kind == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**kw))
    else:
        kw.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                  norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[])  # fmt: skip
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**kw))
    model = _random_save(model, tmp_path / "hf", 0)
    ck, back = tmp_path / "ck", tmp_path / "back"
    assert convert.main(["hf-to-orbax", "--hf", str(tmp_path / "hf"), "--out", str(ck)]) == 0
    m = checkpoint.read_config(ck).model
    assert m.qk_norm and m.moe == (kind == "qwen3_moe")
    assert m.moe_every == (2 if kind == "qwen3_moe" else 1)
    ids = np.random.default_rng(0).integers(0, 320, (2, 24))
    assert np.abs(hf_logits(model, ids) - our_logits(ck, ids)).max() <= TOL
    assert convert.main(["orbax-to-hf", "--checkpoint", str(ck), "--out", str(back)]) == 0
    assert json.loads((back / "config.json").read_text())["model_type"] == kind
    capsys.readouterr()
    assert convert.main(["verify", "--hf", str(back), "--checkpoint", str(ck)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("PASS: ")


def test_a_model_without_tokenizer_json_is_not_given_the_byte_tokenizer(converted, capsys):
    """Without a tokenizer.json, hf-to-orbax warns and names where the model's belongs: the
    config once kept `bytes`, so text became byte ids (BOS 256) that mean nothing to the
    model, and orbax-to-hf then wrote a byte tokenizer back as the model's own."""
    from ultrajax.data import sources

    root, _, _ = converted
    assert not (root / "hf" / "tokenizer.json").exists()
    out = root / "ck_warned"
    assert convert.main(["hf-to-orbax", "--hf", str(root / "hf"), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "no tokenizer.json" in err and str(out) in err, err
    cfg = parse.load(out / "config.yaml")
    assert cfg.data.tokenizer == str(out / "tokenizer.json")
    with pytest.raises(config.ConfigError, match="does not exist"):
        sources.make_tokenizer(cfg.data)
    convert.byte_tokenizer_json().save(str(out / "tokenizer.json"))  # put in place: used
    assert sources.make_tokenizer(cfg.data).encode("a").tolist() == [ord("a")]


def test_fp16_both_weight_files_and_out_paths(converted, tmp_path, capsys):
    """A float16 checkpoint was rounded to bf16 (verify failed by 1e-2): its weights are
    kept exactly, in fp32. A folder with model.safetensors and a stale index of shards is
    read as transformers reads it (we read the shards: logits 2.3 apart). An --out that
    is a file, or under one, was a traceback."""
    model = hf_model(tmp_path / "hf32", seed=2)
    model.half().save_pretrained(tmp_path / "hf16")  # one file: model.safetensors
    model.float()  # the fp16-rounded weights, in fp32: what the checkpoint holds
    assert (
        convert.main(["hf-to-orbax", "--hf", str(tmp_path / "hf16"), "--out", str(tmp_path / "ck")])
        == 0
    )
    assert checkpoint.read_config(tmp_path / "ck").model.param_dtype == "float32"
    ids = np.random.default_rng(2).integers(0, 320, (2, 24))
    fp32 = dict(dtype="float32")  # the converted config computes in bf16, as it trains
    assert np.abs(hf_logits(model, ids) - our_logits(tmp_path / "ck", ids, **fp32)).max() <= TOL

    root = converted[0]
    both = tmp_path / "both"
    both.mkdir()
    for f in (root / "hf").iterdir():  # the shards and their index (another model's)
        (both / f.name).symlink_to(f)
    (both / "model.safetensors").symlink_to(tmp_path / "hf16" / "model.safetensors")
    capsys.readouterr()
    assert convert.main(["hf-to-orbax", "--hf", str(both), "--out", str(tmp_path / "ck2")]) == 0
    assert "reading model.safetensors, as transformers does" in capsys.readouterr().err
    assert np.abs(hf_logits(model, ids) - our_logits(tmp_path / "ck2", ids, **fp32)).max() <= TOL

    (tmp_path / "afile").write_text("")
    for out, said in (("afile", "afile is a file; choose"), ("afile/sub", "afile is a file, so")):
        for argv in (["hf-to-orbax", "--hf", str(root / "hf")],
                     ["orbax-to-hf", "--checkpoint", str(root / "ck")]):  # fmt: skip
            err = _error([*argv, "--out", str(tmp_path / out)], capsys)
            assert said in err, err


def test_a_familys_own_defaults_for_fields_config_json_leaves_out():
    """A field config.json leaves out takes transformers' default for that family: Llama's
    were taken for all (a Mixtral without rope_theta ran at 1e4, not 1e6)."""
    from ultrajax.tools import hf_config

    classes = {"llama": "LlamaConfig", "mixtral": "MixtralConfig", "qwen3": "Qwen3Config",
               "qwen3_moe": "Qwen3MoeConfig"}  # fmt: skip
    assert set(classes) == set(hf_config.ARCHITECTURES) == set(hf_config.FAMILY_DEFAULTS)
    for kind, name in classes.items():
        theirs = getattr(transformers, name)()
        ours = hf_config.FAMILY_DEFAULTS[kind]
        assert ours["rope_theta"] == theirs.rope_parameters["rope_theta"], kind
        assert ours["rms_norm_eps"] == theirs.rms_norm_eps, kind
        assert ours.get("head_dim") == (128 if kind == "qwen3" else None), kind
    mixtral = {"model_type": "mixtral", "hidden_size": 64, "num_attention_heads": 4,
               "num_hidden_layers": 2, "vocab_size": 320, "intermediate_size": 96,
               "num_local_experts": 4, "num_experts_per_tok": 2}  # fmt: skip
    m = hf_config.model_config_from_hf(mixtral)
    assert (m.rope_theta, m.norm_eps) == (1e6, 1e-5)


def test_the_models_stop_ids_travel_with_it_and_a_capacity_is_said(converted, tmp_path, capsys):
    """hf-to-orbax keeps generation_config.json (its eos_token_id: generate stops there)
    and orbax-to-hf writes it back; config.json's eos_token_id alone is kept in one. An
    MoE model trained with model.moe_capacity goes to a dropless transformers model, said."""
    root = converted[0]
    hf = tmp_path / "hf"
    hf.mkdir()
    for f in (root / "hf").iterdir():
        (hf / f.name).symlink_to(f)
    (hf / "generation_config.json").unlink(missing_ok=True)
    (hf / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert convert.main(["hf-to-orbax", "--hf", str(hf), "--out", str(tmp_path / "ck")]) == 0
    kept = json.loads((tmp_path / "ck" / "generation_config.json").read_text())
    assert kept["eos_token_id"] == [2, 7]
    assert (
        convert.main(
            ["orbax-to-hf", "--checkpoint", str(tmp_path / "ck"), "--out", str(tmp_path / "back")]
        )
        == 0
    )
    assert json.loads((tmp_path / "back" / "generation_config.json").read_text()) == kept

    (hf / "generation_config.json").unlink()
    tree = json.loads((hf / "config.json").read_text())
    (hf / "config.json").unlink()
    (hf / "config.json").write_text(json.dumps({**tree, "eos_token_id": [5, 9]}))
    assert convert.main(["hf-to-orbax", "--hf", str(hf), "--out", str(tmp_path / "ck2")]) == 0
    kept = json.loads((tmp_path / "ck2" / "generation_config.json").read_text())
    assert kept == {"eos_token_id": [5, 9]}

    m = config.ModelConfig(vocab_size=384, d_model=16, n_layers=1, n_heads=2, d_ff=32,
                           seq_len=16, moe_experts=4, moe_top_k=2, moe_capacity=1.25)  # fmt: skip
    zeros = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), checkpoint.abstract_params(m))
    checkpoint.write_params(tmp_path / "moe", zeros, config.Config(model=m))
    capsys.readouterr()
    convert.orbax_to_hf(tmp_path / "moe", tmp_path / "moe_hf")
    assert "warning: model.moe_capacity=1.25 dropped the tokens" in capsys.readouterr().err
