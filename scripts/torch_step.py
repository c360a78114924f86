"""The same train step in PyTorch, for side-by-side benchmarks (`bench_step.py --compare-torch`).

transformers' LlamaForCausalLM built from an ultrajax config's shape (vocabulary, width,
layers, heads, KV heads, d_ff, tied or not, rope theta, RMSNorm epsilon), SDPA attention,
causal only, torch.optim.AdamW with the config's betas, epsilon and weight decay,
gradient clipping at `optim.clip_norm`, fp32 on a CPU (bf16 autocast on a GPU), eager
unless `compile`. Random tokens; nothing is asserted. Needs torch and transformers (the
[test] extra installs both).
"""

from __future__ import annotations

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
        model.parameters(), lr=o.lr, betas=(o.b1, o.b2), eps=o.eps, weight_decay=o.weight_decay
    )
    fwd = torch.compile(model) if compile else model
    rows = t.micro_batch_size * t.grad_accum * cfg.dp
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, m.vocab_size, (rows, m.seq_len + 1), generator=gen).to(dev)

    def step():
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
            loss = fwd(input_ids=x[:, :-1], labels=x[:, 1:].contiguous()).loss
        loss.backward()
        if o.clip_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(warmup):
        step()
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
    }
