"""Generation with a KV cache equals re-running the full forward pass."""

import dataclasses
import functools
import hashlib
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ultrajax.config.schema import Config, ConfigError, ModelConfig
from ultrajax.model.decode import forward_with_cache, init_cache
from ultrajax.model.stack import forward
from ultrajax.tools import generate
from ultrajax.train import checkpoint

ROOT = Path(__file__).resolve().parent.parent

CFG = ModelConfig(
    vocab_size=384,
    d_model=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    d_ff=64,
    seq_len=64,
    rope_theta=20000.0,
    dtype="float32",
)


def random_params(cfg: ModelConfig, seed: int = 0) -> dict:
    """Weights from numpy (no compile): norm scales near 1, matmuls scaled by fan-in."""
    rng = np.random.default_rng(seed)

    def leaf(path, s):
        name = path[-1].key
        if "norm" in name:
            return jnp.asarray(1 + 0.1 * rng.standard_normal(s.shape), s.dtype)
        fan_in = s.shape[-1] if name == "embed" else s.shape[0 if name == "lm_head" else 1]
        return jnp.asarray(rng.standard_normal(s.shape) * 2 * fan_in**-0.5, s.dtype)

    return jax.tree_util.tree_map_with_path(leaf, checkpoint.abstract_params(cfg))


def generate_uncached(cfg: ModelConfig, params: dict, prompt: list[int], max_new_tokens: int):
    """Greedy decoding that runs the full forward pass over the whole sequence at every
    step: the reference the KV cache is tested against. The sequence is padded to its
    final length (causal attention: the padding never reaches earlier positions), so
    it compiles once."""
    full_logits = jax.jit(functools.partial(forward, cfg))
    ids = list(prompt)
    total = len(prompt) + max_new_tokens
    for _ in range(max_new_tokens):
        padded = jnp.asarray([ids + [0] * (total - len(ids))], jnp.int32)
        logits = full_logits(params, padded)
        ids.append(int(jnp.argmax(logits[0, len(ids) - 1])))
    return ids[len(prompt) :]


@pytest.fixture(scope="module")
def params():
    return random_params(CFG)


def test_cached_logits_match_forward(params):
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, CFG.vocab_size, (2, 9)))
    full = jax.jit(functools.partial(forward, CFG))(params, tokens)
    step = jax.jit(functools.partial(forward_with_cache, CFG))
    cache = init_cache(CFG, 2, 12)
    logits, cache = step(params, tokens[:, :6], cache, 0)  # prefill
    np.testing.assert_allclose(logits, full[:, :6], atol=1e-5)
    for t in range(6, 9):  # then one token at a time
        logits, cache = step(params, tokens[:, t : t + 1], cache, t)
        np.testing.assert_allclose(logits[:, 0], full[:, t], atol=1e-5)


def test_greedy_with_cache_equals_full_recompute(params):
    prompt = [256, 100, 101, 102, 32]
    cached = generate.generate(CFG, params, prompt, 16, temperature=0.0)
    assert cached == generate_uncached(CFG, params, prompt, 16)
    assert len(cached) == 16 and len(set(cached)) > 1  # a real sequence, not one token


def test_sampling_filters(params):
    prompt = [256, 100, 101]
    greedy = generate.generate(CFG, params, prompt, 8, temperature=0.0)
    # top-k 1 and a tiny nucleus leave only the argmax, at any temperature
    assert generate.generate(CFG, params, prompt, 8, temperature=2.0, top_k=1, seed=3) == greedy
    assert generate.generate(CFG, params, prompt, 8, temperature=2.0, top_p=1e-6, seed=4) == greedy
    a = generate.generate(CFG, params, prompt, 8, temperature=1.0, top_k=20, top_p=0.9, seed=5)
    b = generate.generate(CFG, params, prompt, 8, temperature=1.0, top_k=20, top_p=0.9, seed=5)
    assert a == b  # seeded
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
    keys = jax.random.split(jax.random.key(0), 200)
    draws = {int(generate.sample_logits(logits, k, 1.0, top_p=0.7)[0]) for k in keys}
    assert draws == {0, 1}  # 0.5 + 0.3 reaches 0.7: the two most likely tokens only


def test_cli_on_a_checkpoint(params, tmp_path, capsys, monkeypatch):
    cfg = Config(model=CFG)
    checkpoint.write_params(tmp_path / "ck", params, cfg)
    argv = ["--checkpoint", str(tmp_path / "ck"), "--max-new-tokens", "6", "--temperature", "0"]
    assert generate.main(argv + ["--prompt-ids", "256,100,101", "--ids"]) == 0
    ids = [int(i) for i in capsys.readouterr().out.strip().split(",")]
    assert ids == generate.generate(CFG, params, [256, 100, 101], 6, eos=257)
    assert generate.main(argv + ["--prompt", "def "]) == 0
    assert capsys.readouterr().out.startswith("def ")
    # ids in and out stop at the tokenizer's end-of-text as text does (they ran on, eos None)
    seen = []
    real = generate.generate
    monkeypatch.setattr(
        generate, "generate", lambda *a, **k: seen.append(k["eos"]) or real(*a, **k)
    )
    assert generate.main(argv + ["--prompt-ids", "256,100", "--ids"]) == 0
    assert seen == [{257}]  # the bytes tokenizer's
    capsys.readouterr()
    with pytest.raises(ConfigError, match="not in the vocabulary"):
        generate.main(argv + ["--prompt-ids", "1,999"])
    with pytest.raises(ConfigError, match="exceed model.seq_len"):
        generate.main(argv[:2] + ["--prompt-ids", "1", "--max-new-tokens", "100"])
    # a NaN temperature sampled token 0 on and on; a seed past 32 bits was another's
    for flag, value, said in (("--temperature", "nan", "a number >= 0"),
                              ("--seed", str(2**32), "0..4294967295"),
                              ("--seed", "-1", "0..4294967295")):  # fmt: skip
        with pytest.raises(ConfigError, match=said):
            generate.main(argv[:2] + ["--prompt-ids", "1", flag, value])


def test_cli_on_a_hugging_face_folder_points_to_the_converter(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match="convert hf-to-orbax --hf") as info:
        generate.main(["--checkpoint", str(tmp_path), "--prompt-ids", "1"])
    assert "\n" not in str(info.value)


def test_a_run_keeps_its_tokenizer_for_generate_and_convert(tmp_path, monkeypatch, capsys):
    """A run with its own tokenizer.json, named by a relative path: generate from another
    directory could not find it, and once the file moved or was replaced, generate and
    convert used another tokenizer or none. The run keeps a copy beside its checkpoints,
    named by the digest its data position carries, and both read that copy."""
    from ultrajax.config import parse
    from ultrajax.tools import convert
    from ultrajax.train import loop

    monkeypatch.chdir(tmp_path)
    Path("tok").mkdir()
    convert.byte_tokenizer_json().save("tok/tokenizer.json")
    original = Path("tok/tokenizer.json").read_bytes()
    Path("docs").mkdir()
    for i in range(20):
        Path(f"docs/{i}.txt").write_text(f"def f{i}(x):\n    return x * {i}\n" * 20)
    small = ["train.steps=2", "optim.warmup_steps=1", "train.eval_batches=0", "model.n_layers=2",
             "model.seq_len=64", "train.micro_batch_size=4", "train.grad_accum=2"]  # fmt: skip
    data = ["data.source=files", "data.path=docs", "data.tokenizer=tok/tokenizer.json"]
    where = ["mesh.data=-1", "train.run_dir=run"]
    cfg = parse.load(str(ROOT / "configs/tiny.yaml"), [*small, *data, *where])
    assert loop.train(cfg) == 0
    digest = hashlib.sha256(original).hexdigest()[:12]
    assert (tmp_path / f"run/checkpoints/tokenizers/{digest}.json").read_bytes() == original

    Path("tok/tokenizer.json").write_text("{}")  # replaced: not a tokenizer at all
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    argv = ["--checkpoint", str(tmp_path / "run"), "--max-new-tokens", "4", "--temperature", "0"]
    capsys.readouterr()
    assert generate.main([*argv, "--prompt", "def "]) == 0
    assert capsys.readouterr().out.startswith("def ")
    convert.orbax_to_hf(tmp_path / "run", tmp_path / "hf")
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == original


def test_stop_ids_the_prompts_length_and_the_text_where_they_meet(params, tmp_path, capsys):
    """The model's own eos_token_id (a generation_config.json kept beside the checkpoint,
    as hf-to-orbax keeps it) stops generation: Llama-3-Instruct's <|eot_id|> ran on. A
    prompt + N needs P + N - 1 positions (the last token is never fed back): one too many
    was refused. A decoded continuation keeps the space where it meets the prompt."""
    checkpoint.write_params(tmp_path / "ck", params, Config(model=CFG))
    argv = ["--checkpoint", str(tmp_path / "ck"), "--temperature", "0", "--ids"]
    assert generate.main([*argv, "--prompt-ids", "256,100,101", "--max-new-tokens", "6"]) == 0
    free = [int(i) for i in capsys.readouterr().out.strip().split(",")]
    stop = free[2]
    assert stop not in free[:2] and stop != 257
    (tmp_path / "ck" / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, stop]}))
    assert generate.main([*argv, "--prompt-ids", "256,100,101", "--max-new-tokens", "6"]) == 0
    assert capsys.readouterr().out.strip() == ",".join(map(str, free[:3]))
    fits = ["--prompt-ids", "1,2,3", "--max-new-tokens", str(CFG.seq_len - 2)]
    assert generate.main([*argv, *fits]) == 0  # 3 + 62 - 1 = 64 positions
    capsys.readouterr()
    with pytest.raises(ConfigError, match="need 65 positions: they exceed model.seq_len"):
        generate.main([*argv, "--prompt-ids", "1,2,3", "--max-new-tokens", str(CFG.seq_len - 1)])

    class Words:  # decodes as SentencePiece's Metaspace does: no space before the first word
        def decode(self, ids):
            return " ".join(f"w{i}" for i in ids)

    assert generate._continued(Words(), [5, 6], [7, 8], "w5 w6") == "w5 w6 w7 w8"  # was w6w7


def test_an_empty_prompt_without_bos_and_an_moe_model_trained_with_a_capacity(tmp_path, capsys):
    """An empty --prompt with a tokenizer that has no BOS was a traceback. An MoE model
    trained with model.moe_capacity dropped tokens by how many a call holds, so the
    prompt, each one-token step and the full forward each dropped others: generate runs
    dropless (every token routed) and says so."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({"<unk>": 0, "</s>": 1, "a": 2}, "<unk>")
    )
    tok.save(str(tmp_path / "tok.json"))
    moe = dataclasses.replace(CFG, moe_experts=4, moe_top_k=2, moe_capacity=1.0)
    cfg = Config(model=moe)
    cfg.data.tokenizer = str(tmp_path / "tok.json")
    weights = random_params(moe, seed=3)
    checkpoint.write_params(tmp_path / "ck", weights, cfg)
    argv = ["--checkpoint", str(tmp_path / "ck"), "--max-new-tokens", "5", "--temperature", "0"]
    with pytest.raises(ConfigError, match="--prompt: empty, and the tokenizer has no BOS"):
        generate.main([*argv, "--prompt", ""])
    assert generate.main([*argv, "--prompt-ids", "2,2,2", "--ids"]) == 0
    out = capsys.readouterr()
    assert "note: model.moe_capacity=1.0 dropped the tokens past each expert's capacity" in out.err
    dropless = dataclasses.replace(moe, moe_capacity=0.0)
    want = generate_uncached(dropless, weights, [2, 2, 2], 5)
    got = [int(i) for i in out.out.strip().split(",")]
    assert got == want[: len(got)] and (len(got) == 5 or got[-1] == 1)
