"""Hugging Face Llama and Mixtral <-> ultrajax checkpoints, and a logit check between
the two.

  python -m ultrajax.convert hf-to-orbax --hf DIR --out DIR [--param-dtype auto|float32|bfloat16]
  python -m ultrajax.convert orbax-to-hf --checkpoint DIR --out DIR [--dtype auto|float32|...]
  python -m ultrajax.convert verify --hf DIR --checkpoint DIR [--tokens N] [--batch B] [--tol T]

verify prints the largest |logit difference| (both in fp32) and a PASS/FAIL line against
--tol (default 1e-4, VERIFY_TOL); FAIL exits 1.

Weight layout. Hugging Face stores torch `Linear` weights as (out, in); ours are
einsum operands (in, ..., out) with the heads split out and the layers stacked (the
names and shapes are model/llama.py's PARAMS table; `_layout` turns one into the other):

  model.embed_tokens.weight           (V, d)        -> embed       (V, d)
  layers.i.input_layernorm.weight     (d,)          -> attn_norm   (L, d)
  layers.i.self_attn.q_proj.weight    (H*hd, d)     -> wq          (L, d, H, hd)
  layers.i.self_attn.k_proj.weight    (KV*hd, d)    -> wk          (L, d, KV, hd)
  layers.i.self_attn.v_proj.weight    (KV*hd, d)    -> wv          (L, d, KV, hd)
  layers.i.self_attn.o_proj.weight    (d, H*hd)     -> wo          (L, H, hd, d)
  layers.i.post_attention_layernorm   (d,)          -> mlp_norm    (L, d)
  layers.i.mlp.gate_proj/up_proj      (d_ff, d)     -> w_gate/w_up (L, d, d_ff)
  layers.i.mlp.down_proj.weight       (d, d_ff)     -> w_down      (L, d_ff, d)
  model.norm.weight                   (d,)          -> final_norm  (d,)
  lm_head.weight                      (V, d)        -> lm_head     (d, V)  (absent when tied)

Mixtral (model_type mixtral, docs/moe.md): the MLP is an MoE layer, each expert its own
tensors, stacked along our `experts` axis; Mixtral has no router bias (ours: zero; a
checkpoint whose bias balance moved it is refused on the way out):

  layers.i.block_sparse_moe.gate.weight          (E, d)  -> router   (L, d, E)
  layers.i.block_sparse_moe.experts.e.w1/w3      (f, d)  -> moe_gate/moe_up (L, E, d, f)
  layers.i.block_sparse_moe.experts.e.w2.weight  (d, f)  -> moe_down (L, E, f, d)

Rotary convention. `model.rope` rotates the two halves of each head, pairing
dimension i with i + hd/2 (Hugging Face Llama's `rotate_half`), with frequencies
theta^(-2i/hd), rescaled as transformers' `linear` and `llama3` rope types do (Llama 3.1
and 3.2: `rope_scaling` in config.json; transformers 5 calls it `rope_parameters`; other
types are refused). Hugging Face Llama checkpoints are stored for exactly this
layout (its conversion script permuted Meta's interleaved-pair weights once, when
they were imported), so q_proj and k_proj are copied with no permutation, both
ways. A checkpoint in Meta's original interleaved layout (consolidated.*.pth) is
not accepted; convert it to Hugging Face format first.

Streaming. Tensors are read one at a time (safetensors `safe_open`) straight
into the stacked arrays, and written one layer per safetensors shard, so a model
is never held twice in host memory; sharded Hugging Face checkpoints (an
index.json beside the shards) are read the same way.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
from pathlib import Path

import jax
import numpy as np

from ultrajax import cli
from ultrajax.config import parse, validate
from ultrajax.config.schema import Config, ConfigError, ModelConfig
from ultrajax.data import tokenizer as tokenizer_lib
from ultrajax.model import llama
from ultrajax.model.stack import forward
from ultrajax.tools.hf_config import (
    ARCHITECTURES,
    DROPLESS,
    GENERATION_CONFIG,
    check_expressible,
    family,
    hf_config,
    hf_dtype,
    hf_name,
    model_config_from_hf,
    read_hf_config,
)
from ultrajax.train import checkpoint as checkpoint_lib

VERIFY_TOL = 1e-4  # max abs fp32 logit difference that verify calls a PASS
DTYPES = {"float32": np.float32, "bfloat16": jax.numpy.bfloat16, "float16": np.float16}


# --------------------------------------------------------------------------- layouts


def _layout(p: llama.Param, m: ModelConfig):
    """(HF -> ours, ours -> HF) for one parameter (a layer's slice of a stacked one).

    A torch Linear is stored (out, in); ours is an einsum operand (in..., out...), the
    `in` axes the parameter's fan-in, with the heads split out. Norm scales and the
    embedding (a lookup, no fan-in) are stored alike."""
    if not p.fan_in:
        return (lambda w: w), (lambda a: a)
    shape = p.shape(m)[_stacked(p, m) :]
    fan_in = math.prod(llama.axis_sizes(m)[n] for n in p.fan_in)
    if len(shape) == 2:  # only transposed: a tensor of the wrong shape is refused, not reshaped
        return (lambda w: w.T), (lambda a: a.T)
    return (lambda w: w.T.reshape(shape)), (lambda a: a.reshape(fan_in, -1).T)


def _stacked(p: llama.Param, m: ModelConfig) -> int:
    """Leading axes ours stacks that Hugging Face keeps as separate tensors: the layers,
    and an MoE layer's experts (one tensor each, `{e}` in the name)."""
    return int(p.layered) + int("experts" in p.names and "{e}" in hf_name(p, m))


def _in_hf(p: llama.Param) -> bool:
    """Whether Hugging Face's files hold it: Mixtral has no router bias (ours: zero)."""
    return p.key != "router_bias"


def _split(m: ModelConfig) -> tuple[list[llama.Param], list[llama.Param]]:
    """The parameters whole in one tensor (embedding, final norm, LM head), and a layer's,
    as Hugging Face's files hold them."""
    present = [p for p in llama.params_of(m) if _in_hf(p)]
    return [p for p in present if not p.layered], [p for p in present if p.layered]


def _hf_slices(p: llama.Param, m: ModelConfig, i: int):
    """(HF name, index into our stacked array) of layer i's tensors of `p`: none where
    layer i has no copy of it (the MLP of an MoE layer, the experts of a dense one)."""
    name, row = hf_name(p, m), p.row(m, i)
    if row is None:
        return []
    if _stacked(p, m) == 2:
        return [(name.format(i=i, e=e), (row, e)) for e in range(m.moe_experts)]
    return [(name.format(i=i), row)]


def hf_names(m: ModelConfig) -> dict[str, tuple]:
    """HF tensor name -> (our key, index into the stacked array or None, HF -> ours): the
    whole-model tensors first, then layer by layer."""
    top, layer = _split(m)
    names = {p.hf: (p.key, None, _layout(p, m)[0]) for p in top}
    to_ours = {p.key: _layout(p, m)[0] for p in layer}
    for i in range(m.n_layers):
        for p in layer:
            names.update({n: (p.key, at, to_ours[p.key]) for n, at in _hf_slices(p, m, i)})
    return names


def _weight_files(hf_dir: Path) -> list[Path]:
    """The files transformers would load: model.safetensors before an index (a folder
    re-saved with another sharding keeps both, and one of them is stale)."""
    single, index = hf_dir / "model.safetensors", hf_dir / "model.safetensors.index.json"
    if single.is_file():
        if index.is_file():
            print(
                f"warning: {hf_dir} holds both model.safetensors and an index of shards "
                "(a re-save with another sharding leaves both): reading model.safetensors, "
                "as transformers does",
                file=sys.stderr,
            )
        return [single]
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ConfigError(f"{index}: not a safetensors index (no 'weight_map')") from None
        files = sorted({hf_dir / f for f in weight_map.values()})
    else:
        files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(
            f"--hf: {hf_dir} holds no .safetensors files (a pytorch_model.bin checkpoint is not "
            "supported: re-save it with save_pretrained(safe_serialization=True))"
        )
    for f in files:
        if not f.is_file():
            raise ConfigError(f"--hf: the index names {f.name}, which does not exist")
    return files


def check_out(out: Path) -> None:
    """--out must be a new or empty directory that can be made: a file there, or above it,
    was a traceback (after every tensor was read)."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out: {out} is a file; choose a new directory")
    if out.is_dir() and any(out.iterdir()):
        raise ConfigError(f"--out: {out} is not empty; choose a new directory")
    above = next(p for p in out.absolute().parents if p.exists())
    if not above.is_dir():
        raise ConfigError(f"--out: {above} is a file, so {out} cannot be made")


# --------------------------------------------------------------------------- hf -> orbax


def _read_shard(path: Path, f, names: dict, tied: set, params: dict, seen: set, m) -> None:
    """Every tensor of one open safetensors file into its place in `params` (one in memory
    at a time), its name added to `seen`."""
    for name in f.keys():
        if name.endswith("rotary_emb.inv_freq"):
            continue  # a buffer some versions saved: recomputed from rope_theta
        if name in tied:
            continue
        if name not in names:
            raise ConfigError(
                f"{path.name}: tensor {name!r} has no place in a "
                f"{ARCHITECTURES[family(m)]} with "
                f"this config.json (n_layers={m.n_layers})"
            )
        key, layer, to_ours = names[name]
        dest = params["layers"][key] if layer is not None else params[key]
        want = dest[layer].shape if layer is not None else dest.shape
        w = f.get_tensor(name)  # one tensor in memory at a time
        try:
            value = to_ours(w)
        except ValueError:
            value = None
        if value is None or value.shape != want:
            raise ConfigError(
                f"{path.name}: tensor {name!r} has shape {tuple(w.shape)}, which does "
                f"not fit {key} {tuple(want)} as config.json describes it"
            )
        if layer is None:
            dest[...] = value
        else:
            dest[layer] = value
        seen.add(name)
        del w, value


def hf_to_orbax(hf_dir: str | Path, out: str | Path, param_dtype: str = "auto") -> Path:
    """Write an ultrajax checkpoint (step 0, parameters only) plus out/config.yaml."""
    from safetensors import SafetensorError, safe_open

    hf_dir, out = Path(hf_dir), Path(out).absolute()
    hf = read_hf_config(hf_dir)
    m = model_config_from_hf(hf, str(hf_dir / "config.json"))
    if param_dtype == "auto":  # bf16 as it is; fp16 and fp32 exactly, in fp32 (fp16 was
        # rounded to bf16, and verify failed)
        param_dtype = "bfloat16" if hf_dtype(hf) == "bfloat16" else "float32"
    m.param_dtype = param_dtype
    cfg = Config(model=m)
    validate.validate(cfg)  # heads dividing, head_dim even, ...
    check_out(out)
    files = _weight_files(hf_dir)

    dtype = np.dtype(DTYPES[param_dtype])
    abstract = checkpoint_lib.abstract_params(m)
    params = jax.tree.map(lambda a: np.empty(a.shape, dtype), abstract)
    for p in llama.params_of(m):  # not in Hugging Face's files: zero (the router bias)
        if not _in_hf(p):
            (params["layers"] if p.layered else params)[p.key][...] = 0
    names = hf_names(m)
    tied = {p.hf for p in llama.PARAMS if not p.present(m)}  # the embedding is the head
    seen = set()
    for path in files:
        try:
            with safe_open(str(path), framework="numpy") as f:
                _read_shard(path, f, names, tied, params, seen, m)
        except SafetensorError as e:  # a truncated or corrupt file: its header or its data
            raise ConfigError(
                f"--hf: {path} is not a readable safetensors file ({e}); download it again"
            ) from None
    missing = [n for n in names if n not in seen]
    if missing:
        raise ConfigError(f"--hf: {hf_dir} lacks the tensor {missing[0]!r}")

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = hf_dir / "tokenizer.json"
    # the model's ids are its tokenizer's: without one, name where it belongs (an error
    # when text is read) rather than the default bytes, whose ids mean nothing to it
    cfg.data.tokenizer = str(out / "tokenizer.json")
    if tokenizer.is_file():
        shutil.copy(tokenizer, out / "tokenizer.json")
    else:
        print(
            f"warning: {hf_dir} has no tokenizer.json: copy the model's to {out}/ before "
            "training or generating from text (config.yaml's data.tokenizer names it there)",
            file=sys.stderr,
        )
    _keep_generation_config(hf_dir, hf, out)
    cfg.checkpoint.init_from = str(out)
    cfg.train.run_dir = f"runs/{hf_dir.absolute().name}"
    checkpoint_lib.write_params(out, params, cfg)
    header = (
        f"# Converted from {hf_dir.absolute()} by `python -m ultrajax.convert hf-to-orbax`.\n"
        "# Fine-tune: python -m ultrajax.train --config THIS_FILE model.seq_len=... "
        "(seq_len is max_position_embeddings here)\n"
    )
    (out / "config.yaml").write_text(header + parse.dump(cfg))
    return out


def _keep_generation_config(hf_dir: Path, hf: dict, out: Path) -> None:
    """The model's generation settings beside its checkpoint: generate stops at their
    eos_token_id (Llama-3-Instruct's <|eot_id|>), orbax-to-hf writes them back. Without a
    generation_config.json, config.json's eos_token_id is kept in one."""
    source = hf_dir / GENERATION_CONFIG
    if source.is_file():
        shutil.copy(source, out / GENERATION_CONFIG)
    elif hf.get("eos_token_id") is not None:
        kept = {"eos_token_id": hf["eos_token_id"]}
        (out / GENERATION_CONFIG).write_text(json.dumps(kept, indent=2) + "\n")


# --------------------------------------------------------------------------- orbax -> hf


def orbax_to_hf(checkpoint: str | Path, out: str | Path, dtype: str = "auto") -> Path:
    """config.json + one safetensors shard per layer (and one for the rest) + index."""
    from safetensors.numpy import save_file

    out = Path(out)
    check_out(out)
    cfg = checkpoint_lib.read_config(checkpoint)
    m = cfg.model
    check_expressible(m)
    if m.moe and m.moe_capacity > 0:
        print(f"warning: {DROPLESS.format(m.moe_capacity)}; transformers' model routes every "
              "token, as ultrajax.generate does", file=sys.stderr)  # fmt: skip
    if dtype == "auto":
        dtype = m.param_dtype
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    params = checkpoint_lib.load_params(checkpoint, m, cpu, warn=lambda s: None)
    np_dtype = np.dtype(DTYPES[dtype])
    n_files = m.n_layers + 1
    out.mkdir(parents=True, exist_ok=True)
    weight_map, total, mode = {}, 0, new_file_mode()

    def write(i: int, tensors: dict) -> None:
        nonlocal total
        name = f"model-{i + 1:05d}-of-{n_files:05d}.safetensors"
        tensors = {k: np.ascontiguousarray(v, dtype=np_dtype) for k, v in tensors.items()}
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        os.chmod(out / name, mode)
        for k, v in tensors.items():
            weight_map[k] = name
            total += v.nbytes

    top, layer = _split(m)
    to_hf = {p.key: _layout(p, m)[1] for p in top + layer}
    write(0, {p.hf: to_hf[p.key](np.asarray(params[p.key])) for p in top})
    if m.moe and np.any(np.asarray(params["layers"]["router_bias"]) != 0):
        raise ConfigError(
            f"{checkpoint}: the router biases are not zero (model.moe_balance=bias moved them) "
            "and a Mixtral checkpoint has none: its routing would differ"
        )
    for i in range(m.n_layers):  # one layer's copies at a time
        tensors = {
            name: to_hf[p.key](np.asarray(params["layers"][p.key][at]))
            for p in layer
            for name, at in _hf_slices(p, m, i)
        }
        write(i + 1, tensors)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    tokenizer = None
    try:
        tokenizer = checkpoint_lib.read_tokenizer(checkpoint, cfg)
    except ConfigError as e:
        print(f"warning: {e}; no tokenizer written", file=sys.stderr)
    (out / "config.json").write_text(json.dumps(hf_config(m, dtype, tokenizer), indent=2) + "\n")
    if tokenizer is not None:
        write_hf_tokenizer(tokenizer, out, m.seq_len)
    generation = checkpoint_lib.beside(checkpoint, cfg, GENERATION_CONFIG)
    if generation is not None:  # the model's stop ids, as it came from Hugging Face
        shutil.copy(generation, out / GENERATION_CONFIG)
    return out


def new_file_mode() -> int:
    """The mode open() gives a new file (0o666 less the umask). safetensors writes a
    private temporary (0600) and renames it into place: shards nobody else could read."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


BYTE_SPECIALS = ("<s>", "</s>", "<pad>")  # ByteTokenizer's BOS, EOS, PAD, in id order


def _byte_to_char() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the alphabet of a ByteLevel tokenizer."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    out, extra = {b: chr(b) for b in keep}, 256
    for b in range(256):
        if b not in out:
            out[b], extra = chr(extra), extra + 1
    return out


def byte_tokenizer_json():
    """A `tokenizers` Tokenizer with our ByteTokenizer's ids: byte b is id b (a ByteLevel BPE
    with no merges, so every byte is its own token), <s> </s> <pad> are 256 257 258, and
    encoding prepends <s> as our data pipeline and generate do."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {c: b for b, c in _byte_to_char().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in BYTE_SPECIALS])
    bos = tokenizer_lib.ByteTokenizer.BOS
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    ours = tokenizer_lib.ByteTokenizer
    assert [tok.token_to_id(t) for t in BYTE_SPECIALS] == [ours.BOS, ours.EOS, ours.PAD]
    return tok


def write_hf_tokenizer(tokenizer, out: Path, max_len: int) -> None:
    """The run's tokenizer beside the weights, so AutoTokenizer.from_pretrained(out) works:
    for `bytes`, a tokenizer.json built to give our ids; for a tokenizer.json, a copy."""
    if tokenizer.path is not None:
        shutil.copy(tokenizer.path, out / "tokenizer.json")
        return
    try:
        tok = byte_tokenizer_json()
    except ImportError:
        print("warning: the 'tokenizers' package is missing; no tokenizer written", file=sys.stderr)
        return
    tok.save(str(out / "tokenizer.json"))
    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",  # not Llama's: that would add its own
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "add_bos_token": True,
        "split_special_tokens": True,  # "<s>" in text is 4 bytes, as ours encodes it
        "model_max_length": max_len,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n")


# --------------------------------------------------------------------------- verify


def verify(hf_dir, checkpoint, tokens: int = 32, batch: int = 2, seed: int = 0) -> float:
    """Largest |logit difference| between transformers' model and ours on random tokens
    (both in fp32; our matmuls at full precision)."""
    try:
        import torch
        import transformers
    except ImportError:
        raise ConfigError("verify needs torch and transformers: pip install -e '.[test]'") from None
    hf_dir = Path(hf_dir)
    cfg = checkpoint_lib.read_config(checkpoint)
    m = cfg.model
    hf_m = model_config_from_hf(read_hf_config(hf_dir), str(hf_dir / "config.json"))
    checkpoint_lib.check_model(m, hf_m, f"{checkpoint} vs {hf_dir}", warn=lambda s: None)
    for k in checkpoint_lib.NUMERIC_KEYS:  # each side computes with its own: a likely FAIL
        saved, want = getattr(m, k), getattr(hf_m, k)
        if saved != want:
            print(f"note: model.{k} is {saved} in {checkpoint}, {want} in {hf_dir}")
    if not 1 <= tokens <= m.seq_len:
        raise ConfigError(f"--tokens must be in 1..{m.seq_len} (the checkpoint's model.seq_len)")
    m.dtype, m.param_dtype = "float32", "float32"
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    params = checkpoint_lib.load_params(checkpoint, m, cpu, warn=lambda s: None)
    ids = np.random.default_rng(seed).integers(0, m.vocab_size, (batch, tokens))

    with jax.default_device(jax.devices("cpu")[0]), jax.default_matmul_precision("highest"):
        ours = np.asarray(jax.jit(lambda p, t: forward(m, p, t))(params, ids))
    del params
    arch = getattr(transformers, ARCHITECTURES[family(m)])
    try:
        model = arch.from_pretrained(hf_dir, dtype=torch.float32)
    except TypeError:  # transformers < 4.56 spells it torch_dtype
        model = arch.from_pretrained(hf_dir, torch_dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        ref = model(torch.from_numpy(ids)).logits.float().numpy()
    return float(np.max(np.abs(ref - ours)))


# --------------------------------------------------------------------------- command line


def main(argv=None) -> int:
    p = cli.ArgumentParser(prog="ultrajax.convert", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True, parser_class=cli.ArgumentParser)
    a = sub.add_parser("hf-to-orbax", help="Hugging Face Llama -> ultrajax checkpoint")
    a.add_argument("--hf", required=True, help="directory with config.json and *.safetensors")
    a.add_argument("--out", required=True, help="new directory for the checkpoint + config.yaml")
    a.add_argument("--param-dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    b = sub.add_parser("orbax-to-hf", help="ultrajax checkpoint -> Hugging Face Llama")
    b.add_argument("--checkpoint", required=True, help="a checkpoint directory or one step")
    b.add_argument("--out", required=True, help="new directory for config.json + safetensors")
    b.add_argument("--dtype", default="auto", choices=["auto", *DTYPES])
    c = sub.add_parser("verify", help="largest logit difference, transformers vs ultrajax")
    c.add_argument("--hf", required=True)
    c.add_argument("--checkpoint", required=True)
    c.add_argument("--tokens", type=int, default=32, help="sequence length of the random batch")
    c.add_argument("--batch", type=int, default=2)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument(
        "--tol",
        type=float,
        default=VERIFY_TOL,
        help=f"FAIL (exit 1) above this max abs fp32 logit difference (default {VERIFY_TOL:g})",
    )
    for q in (a, b, c):
        q.add_argument("--cpu-devices", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    cli.setup_devices(args.cpu_devices)
    if args.command != "verify":  # a large model's weights take minutes to read and write
        source = args.hf if args.command == "hf-to-orbax" else args.checkpoint
        print(f"converting {source} to {args.out} ...", flush=True)
    if args.command == "hf-to-orbax":
        out = hf_to_orbax(args.hf, args.out, args.param_dtype)
        print(f"wrote {out / '0'} and {out / 'config.yaml'}")
    elif args.command == "orbax-to-hf":
        out = orbax_to_hf(args.checkpoint, args.out, args.dtype)
        print(f"wrote {out / 'config.json'} and safetensors shards")
    else:
        if args.tokens < 1 or args.batch < 1:
            raise ConfigError("--tokens and --batch must be >= 1")
        if not args.tol >= 0:
            raise ConfigError(f"--tol must be >= 0, got {args.tol:g}")
        diff = verify(args.hf, args.checkpoint, args.tokens, args.batch, args.seed)
        print(f"max abs logit difference: {diff:.3e}")
        ok = diff <= args.tol  # a NaN difference fails
        print(f"{'PASS' if ok else 'FAIL'}: {diff:.3e} {'<=' if ok else '>'} tol {args.tol:g}")
        return 0 if ok else 1
    return 0
