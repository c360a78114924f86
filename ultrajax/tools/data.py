"""`python -m ultrajax.data prepare|bench ...`: tokenize a corpus once, or time the
feed."""

from __future__ import annotations

import sys
import time

from tqdm import tqdm

from ultrajax import cli
from ultrajax.data import prepare
from ultrajax.data import streams as streams_lib
from ultrajax.data.loader import build
from ultrajax.data.tokenizer import ByteTokenizer, HFTokenizer, document, padded_vocab  # noqa: F401

# --------------------------------------------------------------------------- command line


def bench(argv: list[str]) -> int:
    """`python -m ultrajax.data bench --config FILE [--steps N] [--processes P] [overrides]`:
    the pipeline alone (no model, no devices), as one process of P data-parallel ones."""

    p = cli.parser("python -m ultrajax.data bench", bench.__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="timed batches (default 20)")
    p.add_argument(
        "--processes", type=int, default=1, help="pack the rows of 1 of P processes (default 1)"
    )
    args = p.parse_args(argv)
    cfg = cli.load_config(args)
    if any(v == -1 for v in cfg.mesh.sizes().values()):
        cli.fail("data bench needs concrete mesh sizes (the global batch depends on them)")
    b, t = cfg.global_batch, cfg.train
    rows = streams_lib.data_parallel_rows(0, args.processes, b, t.grad_accum)
    t0 = time.perf_counter()
    d = build(cfg.data, seq_len=cfg.model.seq_len, batch_size=b, seed=t.seed,
              vocab_size=cfg.model.vocab_size, grad_accum=t.grad_accum, rows=rows)  # fmt: skip
    opened = time.perf_counter() - t0
    print(d.summary)
    for _ in range(2):  # warm-up: first reads, page cache
        next(d.train)
    t0 = time.perf_counter()
    for _ in tqdm(range(args.steps), desc="batches", leave=False):
        next(d.train)
    seconds = time.perf_counter() - t0
    made = len(d.train.rows) * (cfg.model.seq_len + 1) * args.steps
    rate = made / seconds
    need = len(rows) * cfg.model.seq_len
    print("| process | rows packed / needed | tokens/s | ms per batch | opened in |")
    print("|---|---|---|---|---|")
    print(
        f"| 1 of {args.processes} | {len(d.train.rows)} / {len(rows)} of {b} | {rate:,.0f} | "
        f"{1e3 * seconds / args.steps:.1f} | {opened:.1f} s |"
    )
    print(
        f"a step trains on {need:,} tokens of this process's rows: the pipeline makes them in "
        f"{1e3 * need / rate:.1f} ms; a step slower than that never waits for data"
    )
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    usage = "usage: python -m ultrajax.data {prepare,bench} ... (--help after either)"
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        print("  prepare  tokenize a corpus once into shards (data.source=prepared)")
        print("  bench    time the data pipeline of a config alone, tokens/s per process")
        return 0
    if argv[0] == "prepare":
        return prepare.main(argv[1:])
    if argv[0] == "bench":
        return bench(argv[1:])
    print(f"error: unknown command {argv[0]!r} ({usage})", file=sys.stderr)
    return 2
