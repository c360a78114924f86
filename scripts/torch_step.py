"""The same train step in PyTorch, for side-by-side benchmarks (`bench_step.py --compare-torch`,
and alone as the baseline of `scripts/bench_gpu.sh`):

    python scripts/torch_step.py --size 1b [--compile] [--steps 10] [overrides]   # one JSON line

transformers' LlamaForCausalLM built from an ultrajax config's shape (vocabulary, width,
layers, heads, KV heads, d_ff, tied or not, rope theta, RMSNorm epsilon), SDPA attention,
causal only, torch.optim.AdamW with the config's betas, epsilon and weight decay,
gradient clipping at `optim.clip_norm`, fp32 on a CPU (bf16 autocast on a GPU), eager
unless `compile`; fused AdamW on a GPU. Random tokens; nothing is asserted. Needs torch
and transformers (the [test] extra installs both).
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def tokens_per_s(cfg, steps: int = 3, warmup: int = 1, compile: bool = False) -> dict:
    """{tokens_per_s, step_ms, threads, torch} of the torch step at cfg's shape and batch."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    m, t, o = cfg.model, cfg.train, cfg.optim
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    shape = LlamaConfig(
        vocab_size=m.vocab_size,
        hidden_size=m.d_model,
        intermediate_size=m.d_ff,
        num_hidden_layers=m.n_layers,
        num_attention_heads=m.n_heads,
        num_key_value_heads=m.n_kv_heads,
        head_dim=m.hd,
        max_position_embeddings=m.seq_len,
        rms_norm_eps=m.norm_eps,
        rope_theta=m.rope_theta,
        tie_word_embeddings=m.tie_embeddings,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(shape).to(dev)
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=o.lr,
        betas=(o.b1, o.b2),
        eps=o.eps,
        weight_decay=o.weight_decay,
        fused=dev == "cuda",
    )
    fwd = torch.compile(model) if compile else model
    rows = t.micro_batch_size * t.grad_accum * cfg.dp
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, m.vocab_size, (rows, m.seq_len + 1), generator=gen).to(dev)

    def step():
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
            # transformers shifts the labels itself: seq_len inputs, seq_len - 1 targets
            loss = fwd(input_ids=x[:, :-1], labels=x[:, :-1]).loss
        loss.backward()
        if o.clip_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(warmup):
        step()
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        if dev == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step().item()
        times.append(time.perf_counter() - start)
    times.sort()
    ms = 1e3 * times[len(times) // 2]
    return {
        "tokens_per_s": rows * m.seq_len / (ms / 1e3),
        "step_ms": ms,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if dev == "cuda" else None,
    }


def main(argv=None) -> int:
    """One size of bench_step.py's table, timed in torch; prints one JSON line."""
    import torch
    from bench_step import SIZES, size_overrides

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="1b", choices=sorted(SIZES), help="bench_step.py's sizes")
    p.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--label", default=None, help="a name for the JSON line")
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. train.micro_batch_size=8")
    args = p.parse_args(argv)

    from ultrajax.config.parse import load

    platform = "gpu" if torch.cuda.is_available() else "cpu"
    cfg = load(None, size_overrides(args.size, platform, [*args.overrides, "mesh.data=1"]))
    out = tokens_per_s(cfg, args.steps, args.warmup, compile=args.compile)
    label = args.label or ("compiled" if args.compile else "eager")
    print(json.dumps({"label": label, "size": args.size, **out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
