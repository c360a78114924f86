"""`python -m ultrajax.train --config FILE [--cpu-devices N] [--print-config] [section.key=value]`

The loop: build the mesh, the data and the sharded state (inside jit, so no
replicated copy ever exists), compile the step once ahead of time, then run it
with no host synchronisation except at log steps.

`train` reads as the run goes: build, announce, find the start point, then step until
done or pre-empted, then the summary. `Training` carries what passes from one step to
the next, with one method for each thing that may fall due after a step.
"""

from __future__ import annotations

import math
import signal
import sys
from pathlib import Path

import jax
import numpy as np
from tqdm import tqdm

from ultrajax.config.parse import dump
from ultrajax.config.schema import Config, ConfigError
from ultrajax.cost import units
from ultrajax.train import metrics as metrics_lib
from ultrajax.train import preemption, report
from ultrajax.train import resume as resume_lib
from ultrajax.train.checkpoint import Checkpoints
from ultrajax.train.noise_probe import NoiseProbe
from ultrajax.train.ramp import Ramp
from ultrajax.train.record import Throughput, fetch, log_line, scalar, step_record
from ultrajax.train.setup import RunParts, build_run, compile_steps, rows_to_global, to_global


class Diverged(RuntimeError):
    """The loss is not finite: nothing after it counts (the command exits with status 1)."""


def train(cfg: Config) -> int:
    """Train to train.steps, or until SIGTERM / Ctrl-C stops the run at a saved step.

    Returns the exit status: 0, or 143 (SIGTERM) / 130 (Ctrl-C) when the run was stopped
    before it finished (the same command resumes it). A Ctrl-C before the first step ends
    the process at once, with status 130: nothing is trained, nothing is saved. What the
    run prints never fails it: a pipe closed by the same Ctrl-C (`| tee`) costs the log
    lines, never the save (report.Unbroken)."""
    lead = jax.process_index() == 0
    say = print if lead else _quiet
    with report.unbroken_output():
        with preemption.until_first_step():
            run = begin(cfg, say)
        if run is None:
            return 0
        # Preemption: SIGTERM or Ctrl-C -> save this step and stop; on the way out, wait for
        # pending saves (a second Ctrl-C exits at once) and put the previous handlers back
        try:
            with jax.set_mesh(run.mesh), preemption.Preemption(run.ckpt) as preempted:
                while not run.ramp.done:
                    if run.one_step(preempted):
                        break
        finally:  # also when the run fails: its error is then the last line shown
            run.close()

        for line in run.summary():
            say(line)
        run.ckpt.close()
        if not preempted.requested:
            return 0
        if lead:  # on stderr, with the other messages: stdout may be gone (`| tee`)
            print(
                f"stopped by {preempted.reason} after step {run.step}: saved in "
                f"{run.ckpt.dir / str(run.step)}; run the same command again to resume",
                file=sys.stderr,
            )
        return preempted.code  # 143 (SIGTERM) or 130 (Ctrl-C): the run did not finish


def begin(cfg: Config, say) -> Training | None:
    """Check the resume, build, announce and find the start point: the run in progress, or
    None when the run has already trained its budget. That is said in one line, before
    anything is built or written (config.yaml, metrics, checkpoints stay as they were)."""
    _make_dirs(cfg)  # a run directory that cannot be made fails before anything is built
    resume = resume_lib.resume_source(cfg)  # checked first: a refused resume fails fast
    ramp = None
    if resume is not None:  # refused here (one line) when the batch changed mid-run
        ramp = resume_lib.check_resume(cfg, resume, say)
        if ramp.done:
            saved = resume_lib.saved_config(*resume)
            say(report.nothing_to_train(cfg, saved, *resume, Path(cfg.train.run_dir)))
            return None
    parts = build_run(cfg, fresh=resume is None)  # resolves a -1 mesh size
    if ramp is None:
        ramp = Ramp(cfg)
    run_dir = open_run_dir(cfg, fresh=resume is None, say=say)
    report.announce(cfg, parts, run_dir, say)
    # resume (state, data position) or init_from (parameters) before the first batch is read
    ckpt, state, start = resume_lib.start(
        cfg, parts.state, parts.data, say, resume, checked=resume is not None
    )
    return Training(cfg, parts, ckpt, state, start, ramp, run_dir, say)


def _quiet(*args, **kwargs) -> None:
    """`say` on processes other than 0: one log per run, however many hosts."""


def _make_dirs(cfg: Config) -> None:
    """train.run_dir and checkpoint.dir made (or found), or a one-line error naming the key."""
    for key, path in (("train.run_dir", cfg.train.run_dir), ("checkpoint.dir", cfg.checkpoint.dir)):
        if path is None:
            continue
        if Path(path).exists() and not Path(path).is_dir():
            raise ConfigError(f"{key}: {path} is a file, not a directory")
        try:
            Path(path).mkdir(parents=True, exist_ok=True)
        except OSError as e:  # a file above it, no permission, a read-only or odd filesystem
            raise ConfigError(f"{key}: cannot make the directory {path} ({e.strerror})") from None


def open_run_dir(cfg: Config, fresh: bool = False, say=print) -> Path:
    """The run directory, with the resolved config in it (written by process 0 only: one
    writer per file, also when the run directory is shared by all hosts). A fresh start
    moves an earlier run's metrics aside first (metrics.keep_earlier)."""
    run_dir = Path(cfg.train.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if jax.process_index() == 0:
        kept = metrics_lib.keep_earlier(run_dir) if fresh else None
        if kept is not None:
            say(
                f"metrics: those of the run before in {run_dir} (no checkpoint of it to "
                f"resume from) moved to {kept}; this run starts at step 0"
            )
        (run_dir / "config.yaml").write_text(dump(cfg))
    return run_dir


class Training:
    """One run in progress: what the loop carries from step to step (the state, the batch
    feed, the ramp, the noise probe, the metrics writer, the progress bar).

    Made once the start point is known (fresh, resumed or init_from) and steps are left;
    making it compiles every step the run will need and pulls the first batch."""

    def __init__(
        self,
        cfg: Config,
        parts: RunParts,
        ckpt: Checkpoints,
        state: dict,
        start: int,
        ramp: Ramp,
        run_dir: Path,
        say,
    ):
        t = cfg.train
        self.cfg, self.say, self.run_dir, self.mesh = cfg, say, run_dir, parts.mesh
        self.lead = jax.process_index() == 0
        self.ckpt, self.ramp, self.data, self.eval_fn = ckpt, ramp, parts.data, parts.eval_fn
        self.state, self.step = state, start  # step: the steps done so far
        if self.lead:  # generate and convert read it there, from any directory
            ckpt.keep_tokenizer(parts.data.tokenizer)
        self.profile = t.profile_steps
        self.traced_from: int | None = None  # the step the open trace began at
        if self.profile and start > self.profile[1]:
            say(f"profile: train.profile_steps={self.profile} were trained before step {start}, "
                "where this run resumes: nothing is traced")  # fmt: skip
        # batches are read, packed and placed on a background thread, data.prefetch ahead
        self.data.train.grad_accum = ramp.grad_accum
        sh = parts.batch_sh
        self.feed = self.data.feed(
            lambda p, rows, ga: rows_to_global(p, rows, ga, sh, cfg), cfg.data.prefetch
        )
        with jax.set_mesh(parts.mesh):
            self.compiled = compile_steps(parts.step_fn, state, ramp, sh, cfg, say)  # by accum
            count, note = self.data.eval_count(t.eval_batches)
            if note:
                say(note)
            held_out = self.data.eval_batches(count)
            self.eval_batches = [to_global(b, sh, cfg) for b in held_out]
            self.noise = NoiseProbe(cfg, parts, state, self.data.progress)
            self.batch = next(self.feed)
        self.speed = Throughput(cfg)
        say(f"peak: {units.si(self.speed.peak, 'FLOP/s')} ({self.speed.peak_source})")
        self.writer = metrics_lib.MetricsWriter(run_dir, fresh=start == 0) if self.lead else None
        self.history: list[dict] = []  # the records logged by this process, for the summary
        self.eval_loss = None  # the latest
        done = round(ramp.tokens / ramp.base)  # in config batches, as the bar counts
        self.bar = tqdm(
            total=t.steps, initial=done, disable=not self.lead, dynamic_ncols=True, desc="train"
        )
        self.speed.start(ramp.tokens)

    def one_step(self, preempted: preemption.Preemption) -> bool:
        """Train one step, then what falls due after it, in this order: the record (the
        only host sync), evaluation and the line in metrics.jsonl, the save, a new batch
        size, the next batch, then the log line. A step's line is written before its save
        starts: a run killed once the save is whole but before the line was written lost
        the line for good (a resume starts after it). A stop saves first, then evaluates:
        the save is what the scheduler's grace period is for. True: pre-empted; the step
        is saved and the run stops here."""
        self.profile_start()
        ramp = self.ramp
        small = self.noise.measure(self.state["params"], self.batch, ramp.grad_accum, self.step)
        compiled = self.compiled[ramp.grad_accum]
        self.state, out = compiled(self.state, self.batch, np.float32(ramp.position))
        self.noise.keep(small, out)
        self.profile_stop()
        step_tokens = ramp.tokens_per_step
        switched = ramp.step_done()
        self.step += 1
        stop = preempted(self.step)
        is_log, is_eval = self.due(stop, switched)
        record = None
        if is_log or is_eval:
            out = fetch(out)  # the only host sync: at log steps
            switched |= ramp.observe(scalar(out["loss"]))  # a loss threshold reached
            self.noise.fold()
            rate = self.speed.lap(ramp.tokens)
            b_simple = self.noise.b_simple
            record = step_record(self.step, out, ramp, step_tokens, rate, self.speed, b_simple)
            self.check(record)  # before the save: a diverged state is never saved
            if not stop:
                self.write(record, is_eval)
        if stop or self.ckpt.due(self.step) or ramp.done:
            if record is None:  # a save step that logs nothing: its loss is checked too
                self.check({"loss": scalar(fetch(out)["loss"])})
            self.save()  # before anything is printed: a Ctrl-C's save never waits on a print
        base = ramp.base  # the bar counts config batches: a ramp's steps count more
        self.bar.update(step_tokens // base if step_tokens % base == 0 else step_tokens / base)
        if switched and not ramp.done:
            self.switch_batch_size()
        if not ramp.done and not stop:
            self.batch = next(self.feed)
        if record is not None:
            if stop:
                self.write(record, is_eval)
            self.show(record, stop and preempted.signum == signal.SIGINT)
        return stop

    def due(self, stop: bool, switched: bool) -> tuple[bool, bool]:
        """(log, evaluate) after this step. The first and last steps, a stop and a new
        batch size are always logged, so the log shows where each began and ended."""
        t, done = self.cfg.train, self.step
        is_log = done == 1 or done % t.log_every == 0 or self.ramp.done or stop or switched
        is_eval = bool(self.eval_batches) and (done % t.eval_every == 0 or self.ramp.done)
        return is_log, is_eval

    def save(self) -> None:
        """Save this step, asynchronously. The data position is taken now, before the next
        step's batch is pulled, with the ramp's and the noise scale's state beside it, so a
        resume continues all three exactly."""
        self.data.progress = {"ramp": self.ramp.state(), "noise": self.noise.state()}
        self.ckpt.save(self.step, self.state, self.data.state())

    def switch_batch_size(self) -> None:
        """A ramp stage began: the feed regroups the rows into the new number of
        micro-batches (it drops the batches it made at the old size)."""
        ramp = self.ramp
        self.feed = self.data.regroup(ramp.grad_accum)
        if self.lead:
            tqdm.write(
                f"batch: {ramp.tokens_per_step:,} tokens per step from here "
                f"({ramp.grad_accum} x {ramp.unit:,}; stage {ramp.stage} of the "
                f"schedule, at {ramp.tokens:,} tokens)"
            )

    def check(self, record: dict) -> None:
        """A loss that is not finite ends the run here, with a hint: nothing after it
        counts, and nothing of it is saved."""
        if not math.isfinite(record["loss"]):
            raise Diverged(f"loss is {record['loss']} at step {self.step}; lower optim.lr")

    def write(self, record: dict, is_eval: bool) -> None:
        """A logged step: evaluation if due, then its line in metrics.jsonl."""
        if is_eval:
            self.eval_loss = self.evaluate()
            record["eval_loss"] = self.eval_loss
            self.speed.pause()  # evaluation time is not step time
        self.history.append(record)
        if self.writer:
            self.writer.write(record)

    def show(self, record: dict, ctrl_c: bool) -> None:
        """A logged step on the terminal: the bar and the log line."""
        if ctrl_c and self.lead:  # stderr: seen also when stdout goes to a file or a pipe
            tqdm.write(
                f"Ctrl-C: saving step {self.step}, then stopping (Ctrl-C again: quit now)",
                file=sys.stderr,
            )
        self.bar.set_postfix(loss=f"{record['loss']:.3f}", refresh=False)
        if self.lead:
            tqdm.write(log_line(record))

    def evaluate(self) -> float | None:
        """The mean loss per target over the eval batches: the same batches every time, so
        the numbers compare along the run and across resumes. None without targets."""
        total, count = 0.0, 0
        for b in self.eval_batches:
            s, n = self.eval_fn(self.state["params"], b)
            total, count = total + float(s), count + int(n)
        return total / max(count, 1) if count else None

    def profile_start(self) -> None:
        """train.profile_steps=[first, last], steps numbered from 0: the trace starts just
        before step `first` is dispatched (or the first step of a run resumed inside the
        window: a resume there crashed at the stop of a trace never started)..."""
        if not self.profile or self.traced_from is not None:
            return
        first, last = self.profile
        if first <= self.step <= last:
            jax.profiler.start_trace(str(self.run_dir / "profile"))
            self.traced_from = self.step

    def profile_stop(self, end: bool = False) -> None:
        """...and stops once step `last` has finished on the devices (not merely been
        dispatched), with a device memory profile beside it; or where the run ends inside
        the window (`end`: a ramp's token budget, a stop), which left the trace unwritten."""
        if self.traced_from is None or (self.step != self.profile[1] and not end):
            return
        jax.block_until_ready(self.state)
        jax.profiler.stop_trace()
        jax.profiler.save_device_memory_profile(str(self.run_dir / "memory.prof"))
        first, last = self.traced_from, self.step - 1 if end else self.profile[1]
        cut = f" (train.profile_steps={self.profile}: the run " + (
            "ended inside it)" if end else "resumed inside it)"
        )
        self.say(f"profile of steps {first}..{last} written to {self.run_dir}/profile"
                 + (cut if [first, last] != list(self.profile) else ""))  # fmt: skip
        self.traced_from = None

    def summary(self) -> list[str]:
        """The end of the log (train/report.py), from what this run measured."""
        speed, ramp = self.speed, self.ramp
        b_simple, tokens_per_step = self.noise.b_simple, ramp.tokens_per_step
        return report.summary_lines(
            self.cfg, speed, self.history, self.eval_loss, b_simple, tokens_per_step, self.run_dir
        )

    def close(self) -> None:
        """The bar, the data threads and the metrics files; checkpoints close after the
        summary (their saves may still be being written)."""
        self.profile_stop(end=True)
        self.bar.close()
        self.data.close()
        if self.writer:
            self.writer.close()
