"""Hugging Face conversion, checked against transformers itself: logits within 1e-4 in
fp32, from Hugging Face to ours and back."""

import json
import subprocess
import sys

import jax
import numpy as np
import pytest
import torch
import transformers

from ultrajax import checkpoint, cli, config, convert
from ultrajax.model import forward

TOL = 1e-4


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


def our_logits(ck, ids):
    m = checkpoint.read_config(ck).model
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
    cfg = config.load(root / "ck" / "config.yaml")  # the YAML written beside it is a valid config
    assert cfg.model.n_kv_heads == 2 and cfg.model.rope_theta == 50000.0
    assert cfg.checkpoint.init_from == str((root / "ck").absolute())


def test_orbax_to_hf_round_trip(converted, capsys):
    root, model, ids = converted
    out = root / "back"
    assert convert.main(["orbax-to-hf", "--checkpoint", str(root / "ck"), "--out", str(out)]) == 0
    again = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    diff = np.abs(hf_logits(model, ids) - hf_logits(again, ids)).max()
    print(f"orbax-to-hf: max abs logit difference {diff:.2e}")
    assert diff <= TOL
    capsys.readouterr()
    assert convert.main(["verify", "--hf", str(out), "--checkpoint", str(root / "ck")]) == 0
    printed = capsys.readouterr().out
    assert float(printed.split("difference:")[1]) <= TOL


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
        "rope_scaling type 'llama3'": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}),
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
        "(only LlamaForCausalLM)"
    ]
