"""`python -m ultrajax.generate --checkpoint DIR (--prompt TEXT | --prompt-ids 1,2,3)
--max-new-tokens N [--temperature T] [--top-k K] [--top-p P] [--seed S] [--ids]`

Sampling with a KV cache: the prompt is run once (prefill), writing every
layer's keys and values into a cache sized for prompt + new tokens; then each
new token costs one position's forward pass against the cache
(`model/decode.py`'s `forward_with_cache`), instead of the whole sequence again. Temperature 0
is greedy decoding. Generation stops after N new tokens, at the tokenizer's
end-of-text token, or at the model's own eos_token_id (a generation_config.json that
hf-to-orbax kept). Works on any checkpoint: a training run's or a converted one.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import sys
from collections.abc import Iterable
from pathlib import Path

import jax
import jax.numpy as jnp

from ultrajax import cli
from ultrajax.config.schema import ConfigError, ModelConfig
from ultrajax.config.validate import SEEDS
from ultrajax.model.decode import forward_with_cache, init_cache
from ultrajax.tools.hf_config import DROPLESS, GENERATION_CONFIG, eos_ids
from ultrajax.train import checkpoint as checkpoint_lib


@jax.jit
def sample_logits(logits, key, temperature, top_k=0, top_p=1.0):
    """One token id per row of logits (batch, vocab). temperature 0: argmax; top_k 0 and
    top_p 1: no filter. The settings are traced values: one compiled sampler for all."""
    vocab = logits.shape[-1]
    greedy = jnp.argmax(logits, axis=-1)
    scaled = logits.astype(jnp.float32) / jnp.maximum(temperature, 1e-6)
    ranked = -jnp.sort(-scaled, axis=-1)  # most likely first
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    ranked = jnp.where(jnp.arange(vocab) < k, ranked, -jnp.inf)  # top-k
    # nucleus: keep the most likely tokens until their probability reaches top_p
    probs = jax.nn.softmax(ranked, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of the more likely tokens
    kept = (before < top_p) & (ranked > -jnp.inf)
    cutoff = jnp.min(jnp.where(kept, ranked, jnp.inf), axis=-1, keepdims=True)
    sampled = jax.random.categorical(key, jnp.where(scaled < cutoff, -jnp.inf, scaled), axis=-1)
    return jnp.where(temperature == 0, greedy, sampled)


def _static(cfg: ModelConfig) -> tuple:
    """A hashable copy of the model config, so jit can treat it as static."""
    items = dataclasses.asdict(cfg).items()
    return tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in items)


def _model(static: tuple) -> ModelConfig:
    return ModelConfig(**{k: list(v) if isinstance(v, tuple) else v for k, v in static})


@functools.partial(jax.jit, static_argnames="static", donate_argnames="cache")
def _cached_step(params, tokens, cache, start, static):
    return forward_with_cache(_model(static), params, tokens, cache, start)


def generate(
    cfg: ModelConfig,
    params: dict,
    prompt: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    eos: int | Iterable[int] | None = None,
) -> list[int]:
    """New token ids after `prompt`, with a KV cache (one prefill, then one token a step),
    until `eos` (an id, or ids: any of them stops it). Compiles twice: the prefill (per
    prompt length) and the one-token step."""
    stops = {eos} if isinstance(eos, int) else set(eos or ())
    static = _static(cfg)
    cache = init_cache(cfg, 1, len(prompt) + max_new_tokens)
    key = jax.random.key(seed)
    start = jnp.asarray(0, jnp.int32)
    logits, cache = _cached_step(params, jnp.asarray([prompt], jnp.int32), cache, start, static)
    out = []
    for i in range(max_new_tokens):
        key, sub = jax.random.split(key)
        token = int(sample_logits(logits[:, -1], sub, temperature, top_k, top_p)[0])
        out.append(token)  # the int() above is a host sync: we stop at end-of-text
        if token in stops or i == max_new_tokens - 1:
            break
        position = jnp.asarray(len(prompt) + i, jnp.int32)
        tokens = jnp.asarray([[token]], jnp.int32)
        logits, cache = _cached_step(params, tokens, cache, position, static)
    return out


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise ConfigError(f"--prompt-ids: expected integers like 1,2,3, got {text!r}") from None
    if not ids:
        raise ConfigError("--prompt-ids: no ids given")
    return ids


def main(argv=None) -> int:
    p = cli.ArgumentParser(prog="ultrajax.generate", description="Sample from a checkpoint.")
    p.add_argument("--checkpoint", required=True, help="a checkpoint directory or one step of it")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="text, encoded with the checkpoint's tokenizer")
    src.add_argument("--prompt-ids", help="token ids, e.g. 256,100,101")
    p.add_argument("--max-new-tokens", type=int, default=100, metavar="N")
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="0: no top-k filter")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="1: no nucleus filter")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ids", action="store_true", help="print the new token ids, not text")
    p.add_argument("--cpu-devices", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    cli.setup_devices(args.cpu_devices)
    if args.max_new_tokens < 1:
        raise ConfigError("--max-new-tokens must be >= 1")
    if not 0 <= args.temperature < math.inf:  # NaN too: it sampled token 0 on and on
        raise ConfigError("--temperature must be a number >= 0 (0: greedy)")
    if not 0 <= args.seed < SEEDS:
        raise ConfigError(f"--seed must be in 0..{SEEDS - 1} (JAX's key keeps 32 bits)")
    if args.top_k < 0:
        raise ConfigError("--top-k must be >= 0")
    if not 0 < args.top_p <= 1:
        raise ConfigError("--top-p must be in (0, 1]")

    hf = Path(args.checkpoint)
    if (hf / "config.json").is_file() and any(hf.glob("*.safetensors")):
        raise ConfigError(
            f"{hf} is a Hugging Face model folder, not an ultrajax checkpoint: convert it "
            f"first (python -m ultrajax.convert hf-to-orbax --hf {hf} --out DIR), then "
            "pass --checkpoint DIR"
        )
    cfg = checkpoint_lib.read_config(args.checkpoint)
    m = cfg.model
    try:  # ids in and out need it too: its end-of-text token ends the generation
        tokenizer = checkpoint_lib.read_tokenizer(args.checkpoint, cfg)
    except ConfigError as e:
        if args.prompt is not None or not args.ids:
            raise
        tokenizer = None
        print(f"warning: {e}: generating {args.max_new_tokens} tokens, not stopping at an "
              "end-of-text token", file=sys.stderr)  # fmt: skip
    if args.prompt is not None:
        bos = [tokenizer.BOS] if tokenizer.BOS is not None else []
        prompt = bos + [int(i) for i in tokenizer.encode(args.prompt)]
        if not prompt:  # a tokenizer without BOS: nothing to run (a traceback before)
            raise ConfigError("--prompt: empty, and the tokenizer has no BOS to start from")
    else:
        prompt = _parse_ids(args.prompt_ids)
    _check_prompt(prompt, args.max_new_tokens, m)
    if m.moe and m.moe_capacity > 0:
        print(f"note: {DROPLESS.format(m.moe_capacity)}", file=sys.stderr)
        m = dataclasses.replace(m, moe_capacity=0.0)
    params = checkpoint_lib.load_params(args.checkpoint, m, warn=lambda s: None)
    new = generate(
        m,
        params,
        prompt,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        eos=_stops(args.checkpoint, cfg, tokenizer),
    )
    if args.ids:
        print(",".join(map(str, new)))
    else:
        sys.stdout.write(_continued(tokenizer, prompt, new, args.prompt) + "\n")
    return 0


def _check_prompt(prompt: list[int], max_new: int, m: ModelConfig) -> None:
    bad = [i for i in prompt if not 0 <= i < m.vocab_size]
    if bad:
        raise ConfigError(f"prompt token {bad[0]} is not in the vocabulary (0..{m.vocab_size - 1})")
    if len(prompt) + max_new - 1 > m.seq_len:  # the last new token is never fed back
        raise ConfigError(
            f"the prompt ({len(prompt)} tokens) + --max-new-tokens ({max_new}) need "
            f"{len(prompt) + max_new - 1} positions: they exceed model.seq_len ({m.seq_len}), "
            "the length the model was trained for"
        )


def _stops(checkpoint: str, cfg, tokenizer) -> set[int]:
    """The ids that end a generation: the tokenizer's end-of-text, and the model's own
    eos_token_id from a generation_config.json kept beside the checkpoint (hf-to-orbax
    copies it: Llama-3-Instruct stops at <|eot_id|>, which the tokenizer's name does not
    say; without it, generation ran on to --max-new-tokens)."""
    stops = {tokenizer.EOS} if tokenizer is not None and tokenizer.EOS is not None else set()
    path = checkpoint_lib.beside(checkpoint, cfg, GENERATION_CONFIG)
    if path is not None:
        stops.update(eos_ids(path))
    return stops


def _continued(tokenizer, prompt: list[int], new: list[int], text: str | None) -> str:
    """The prompt's text and the continuation, decoded together: decoded apart, a
    SentencePiece-style tokenizer drops the space where the two meet."""
    head = tokenizer.decode(prompt)
    whole = tokenizer.decode(prompt + new)
    tail = whole[len(head) :] if whole.startswith(head) else tokenizer.decode(new)
    return (head if text is None else text) + tail
