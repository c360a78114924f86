"""What a run says about itself: its plan before the first step (enough to reproduce it
and to see what the config resolved to) and its summary after the last step (the rate,
MFU, memory and losses reached, beside what the cost models predicted)."""

from __future__ import annotations

import sys
from pathlib import Path

import jax

from ultrajax.config.parse import dump
from ultrajax.config.schema import Config
from ultrajax.config.validate import no_effect
from ultrajax.cost import flops, units
from ultrajax.cost import memory as memory_lib
from ultrajax.model.llama import param_count
from ultrajax.parallel import mesh as mesh_lib
from ultrajax.train import checkpoint as checkpoint_lib
from ultrajax.train import optim, peaks
from ultrajax.train.record import Throughput
from ultrajax.train.setup import RunParts


def announce(cfg: Config, parts: RunParts, run_dir: Path, say) -> None:
    """The resolved config, the mesh, the batch, the model and the data, before anything
    is trained; warnings for settings that have no effect go to stderr (process 0 only)."""
    m, t = cfg.model, cfg.train
    say(dump(cfg).rstrip())
    say(mesh_lib.describe(parts.mesh, parts.rules))
    say(mesh_lib.describe_hosts(parts.mesh))
    for line in no_effect(cfg) if jax.process_index() == 0 else ():
        print(f"warning: {line}", file=sys.stderr)
    say(f"run directory: {run_dir} (checkpoints in {checkpoint_lib.checkpoint_dir(cfg)})")
    say(
        f"batch: {cfg.global_batch} samples = {t.micro_batch_size} micro x {t.grad_accum} accum"
        f" x {cfg.dp} dp; {cfg.tokens_per_step:,} tokens per step (x {m.seq_len} seq)"
    )
    n_params = param_count(m)
    say(
        f"model: {units.human(n_params)} parameters ({n_params:,}); "
        f"{units.human(flops.flops_per_token(m))} FLOPs per token"
    )
    say(parts.data.summary)


def nothing_to_train(cfg: Config, ckpt_dir: Path, step: int, run_dir: Path) -> str:
    """A resume that finds train.steps already reached: what to change, either way."""
    return (
        f"{ckpt_dir} is at step {step}: train.steps={cfg.train.steps} is reached, nothing to "
        "train. To train longer, raise train.steps (with train.reschedule=true, or "
        f"optim.schedule_steps={optim.schedule_steps(cfg)} to keep the schedule); to "
        f"start over, give train.run_dir=... or delete {run_dir}"
    )


def summary_lines(
    cfg: Config,
    speed: Throughput,
    history: list[dict],
    eval_loss: float | None,
    b_simple: float | None,
    tokens_per_step: int,
    run_dir: Path,
) -> list[str]:
    """The end of the log: the steady rate and MFU, the peak memory (measured, then the
    predicted breakdown of cost/memory.py), the losses, and the batch against the measured
    critical batch when train.noise_every measured one."""
    tps = speed.median()
    mem = peaks.peak_memory_bytes()
    lines = [
        "summary:",
        f"  tokens/s     {tps:,.0f} (median of logged intervals)",
        f"  MFU / HFU    {speed.mfu(tps):.1%} / {speed.hfu(tps):.1%}  (peak: {speed.peak_source})",
        f"  peak memory  {mem / 2**30:.2f} GiB" if mem else "  peak memory  not reported (CPU)",
        *memory_lib.summary_lines(cfg, mem),
    ]
    if history:
        first, last = history[0], history[-1]
        lines.append(
            f"  train loss   {first['loss']:.4f} at step {first['step']} -> {last['loss']:.4f}"
        )
    if eval_loss is not None:
        lines.append(f"  eval loss    {eval_loss:.4f}")
    if b_simple is not None:
        ratio = tokens_per_step / b_simple
        lines.append(
            f"  batch        {tokens_per_step:,} tokens per step, {ratio:.2g}x the measured "
            f"critical batch B_simple = {b_simple:,.0f} tokens ("
            + ("above it: larger batches would waste compute)" if ratio > 2 else
               "below it: larger batches would train faster per step)" if ratio < 0.5 else
               "near it)")
        )  # fmt: skip
    lines.append(f"  metrics      {run_dir / 'metrics.jsonl'}")
    return lines
