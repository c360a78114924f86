"""`python -m ultrajax.data prepare|bench ...`: tokenize a corpus once, or time the
feed."""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence

from tqdm import tqdm

from ultrajax import cli
from ultrajax.config.schema import ConfigError
from ultrajax.config.validate import resolve_mesh
from ultrajax.data import prepare
from ultrajax.data import streams as streams_lib
from ultrajax.data.loader import build
from ultrajax.train.ramp import Ramp

# --------------------------------------------------------------------------- command line


def bench(argv: list[str]) -> int:
    """Time the data pipeline alone (no model, no devices), as one of P data-parallel processes.

    `python -m ultrajax.data bench --config FILE [--steps N] [--processes P] [--devices N]
    [overrides]`."""

    p = cli.parser("python -m ultrajax.data bench", bench.__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="timed batches (default 20)")
    p.add_argument(
        "--processes", type=int, default=1, help="pack the rows of 1 of P processes (default 1)"
    )
    p.add_argument(
        "--devices",
        type=int,
        default=None,
        metavar="N",
        help="the run's devices (GPUs), to fill a mesh size of -1: the global batch depends on it",
    )
    args = p.parse_args(argv)
    if args.steps < 1 or args.processes < 1 or (args.devices is not None and args.devices < 1):
        p.error("--steps, --processes and --devices must be >= 1")
    cfg = cli.load_config(args)
    fill = [k for k, v in cfg.mesh.sizes().items() if v == -1]
    if fill and args.devices is None:
        cli.fail(
            f"mesh.{fill[0]}=-1 is filled from the run's device count, which the global batch "
            f"depends on: give --devices N (e.g. --devices {8 * args.processes} for "
            f"{args.processes} process(es) of 8 GPUs) or mesh.{fill[0]}=N"
        )
    if args.devices is not None:
        resolve_mesh(cfg, args.devices)
    devices = math.prod(cfg.mesh.sizes().values())
    if devices % args.processes:  # each process holds the same number of devices
        cli.fail(
            f"--processes {args.processes} does not divide the mesh's {devices} device(s) "
            f"({' x '.join(f'{k}={v}' for k, v in cfg.mesh.sizes().items() if v > 1) or '1'})"
        )
    b, t = cfg.global_batch, cfg.train
    rows = streams_lib.data_parallel_rows(0, args.processes, b, t.grad_accum)
    t0 = time.perf_counter()
    d = build(cfg.data, seq_len=cfg.model.seq_len, batch_size=b, seed=t.seed,
              vocab_size=cfg.model.vocab_size, grad_accum=t.grad_accum, rows=rows,
              batch_sizes=Ramp(cfg).batches())  # as training: the same stream count  # fmt: skip
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
        return prepare_main(argv[1:])
    if argv[0] == "bench":
        return bench(argv[1:])
    print(f"error: unknown command {argv[0]!r} ({usage})", file=sys.stderr)
    return 2


def prepare_parser() -> argparse.ArgumentParser:
    """`prepare`'s options."""
    p = cli.ArgumentParser(  # argparse errors as one line, exit status 2, like every ultrajax tool
        prog="python -m ultrajax.data prepare",
        description="Tokenize a corpus once into token shards (a prepared directory).",
    )
    p.add_argument(
        "--input",
        action="append",
        required=True,
        metavar="GLOB",
        help="a file, a directory or a glob (** recursive); repeat for more. *.jsonl: one "
        'document a line, field "text"; any other file: one document',
    )
    p.add_argument(
        "--tokenizer",
        required=True,
        metavar="bytes|PATH",
        help="bytes (UTF-8 bytes, no file), or the path of a Hugging Face tokenizer.json",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="the prepared directory")
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        metavar="N",
        help="processes (default: the CPU count, at most one a shard)",
    )
    p.add_argument("--strict", action="store_true", help="the first bad line is an error")
    p.add_argument(
        "--shard-mib",
        type=float,
        default=256,
        metavar="M",
        help="about this many MiB of input per shard (default 256)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing DIR")
    return p


def prepare_main(argv: Sequence[str] | None = None) -> int:
    """`prepare`'s command line: argv is what follows `prepare`. Errors: one line, exit
    status 2. The work is data/prepare.py's, which imports no JAX (its workers are
    spawned processes); this command module may."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = prepare_parser().parse_args(argv)
    start = time.perf_counter()
    try:
        manifest, workers = prepare.tokenize_corpus(
            args.input,
            args.tokenizer,
            args.out,
            args.workers,
            args.strict,
            args.shard_mib,
            args.overwrite,
            argv,
        )
    except ConfigError as e:
        cli.fail(str(e))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    print(prepare.summary(manifest, args.out, time.perf_counter() - start, workers), flush=True)
    return 0
