"""What a run says about itself: its plan before the first step (enough to reproduce it
and to see what the config resolved to) and its summary after the last step (the rate,
MFU, memory and losses reached, beside what the cost models predicted)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import jax

from ultrajax.config.no_effect import no_effect
from ultrajax.config.parse import dump
from ultrajax.config.schema import Config
from ultrajax.cost import flops, units
from ultrajax.cost import memory as memory_lib
from ultrajax.model.llama import active_param_count, param_count
from ultrajax.parallel import mesh as mesh_lib
from ultrajax.train import checkpoint as checkpoint_lib
from ultrajax.train import optim, peaks
from ultrajax.train.record import Throughput
from ultrajax.train.setup import RunParts


class Unbroken:
    """A text stream (stdout, stderr) whose writes never raise on a closed pipe.

    Under `... | tee log` a Ctrl-C reaches tee too, and the run's next line would raise
    BrokenPipeError in the middle of saving the step. Once the reader is gone, the stream's
    descriptor points at /dev/null (Python's advice for SIGPIPE) and the run goes on,
    saves included. Lines are flushed as written, so that a closed pipe shows at the
    write, not in the interpreter's last flush (exit status 120), and `| tee` shows the
    log as it is written."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> int:
        try:
            n = self.stream.write(text)
            if "\n" in text:
                self.stream.flush()
            return n
        except BrokenPipeError:
            self._reader_gone()
            return len(text)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except BrokenPipeError:
            self._reader_gone()

    def _reader_gone(self) -> None:
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self.stream.fileno())  # what is still buffered goes there too
            os.close(devnull)
        except (OSError, ValueError):  # no descriptor (a test's capture): nothing to point
            pass

    def __getattr__(self, name):  # isatty, fileno, encoding, ...: the stream's own
        return getattr(self.stream, name)


@contextmanager
def unbroken_output() -> Iterator[None]:
    """sys.stdout and sys.stderr as Unbroken streams while the run lasts: every writer
    (print, the progress bar, tqdm.write) is covered, the previous streams come back."""
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = Unbroken(sys.stdout), Unbroken(sys.stderr)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved


def announce(cfg: Config, parts: RunParts, run_dir: Path, say) -> None:
    """The resolved config, the mesh, the batch, the model and the data, before anything
    is trained; warnings for settings that have no effect go to stderr (process 0 only)."""
    m, t = cfg.model, cfg.train
    say(dump(cfg).rstrip())
    say(mesh_lib.describe(parts.mesh, parts.rules))
    say(mesh_lib.describe_hosts(parts.mesh))
    for line in no_effect(cfg, jax.default_backend()) if jax.process_index() == 0 else ():
        print(f"warning: {line}", file=sys.stderr)
    say(f"run directory: {run_dir} (checkpoints in {checkpoint_lib.checkpoint_dir(cfg)})")
    say(
        f"batch: {cfg.global_batch} samples = {t.micro_batch_size} micro x {t.grad_accum} accum"
        f" x {cfg.dp} dp; {cfg.tokens_per_step:,} tokens per step (x {m.seq_len} seq)"
    )
    n_params = param_count(m)
    chunk = m.loss_chunk or 0
    active = active_param_count(m)
    say(
        f"model: {units.human(n_params)} parameters ({n_params:,}"
        + (f"; {units.human(active)} active per token" if m.moe else "")
        + "); "
        f"{units.human(flops.flops_per_token(m))} FLOPs per token"
        + (f"; LM head and loss in chunks of {chunk} tokens, their gradients made in the "
           "forward (model.loss_chunk; 0: whole logits, more memory)"
           if 0 < chunk < m.seq_len else "")
    )  # fmt: skip
    say(parts.data.summary)
    repeat = passes(cfg, parts.data.train_sources)
    if repeat:
        say(repeat)


def passes(cfg: Config, sources) -> str | None:
    """A line when the run reads a corpus more than once (the stream repeats it, each pass
    in a new order, and nothing else says so): the run's tokens, over each corpus's train
    tokens where they are known without reading it (prepared directories)."""
    budget = cfg.train.steps * cfg.tokens_per_step  # a ramp's budget too, in tokens
    weights = sum(s.weight for s in sources)
    over = []
    for s in sources:
        if s.tokens:
            n = budget * s.weight / weights / s.tokens
            if n > 1:
                over.append(f"{n:.1f} passes over the {s.tokens:,} train tokens of {s.name}")
    if not over:
        return None
    return (
        f"data: the run's {budget:,} tokens are about {'; '.join(over)}: the documents "
        "repeat, each pass in a new order"
    )


def nothing_to_train(cfg: Config, saved: Config, ckpt_dir: Path, step: int, run_dir: Path) -> str:
    """A resume that finds train.steps already reached: what to change, either way. The
    schedule to keep is the saved run's (`saved`): with train.steps lowered, this run's
    own would be refused as a change of schedule."""
    return (
        f"{ckpt_dir} is at step {step}: train.steps={cfg.train.steps} is reached, nothing to "
        "train. To train longer, raise train.steps (with train.reschedule=true, or "
        f"optim.schedule_steps={optim.schedule_steps(saved)} to keep the schedule); to "
        f"start over, {start_over(cfg, run_dir)}"
    )


def start_over(cfg: Config, run_dir: Path) -> str:
    """The way to a fresh run beside one whose checkpoints are in the way: a new run
    directory, unless checkpoint.dir is set, which a new run directory then shares."""
    if cfg.checkpoint.dir:
        ckpt_dir = checkpoint_lib.checkpoint_dir(cfg)
        return f"give another checkpoint.dir=... (every run that names {ckpt_dir} shares it)"
    return f"give train.run_dir=... or delete {run_dir}"


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
        f"  MFU causal   {speed.mfu_causal(tps):.1%}  (attention FLOPs halved for the causal mask;"
        " MFU counts the whole square, as PaLM)",
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
