"""`python -m ultrajax.train --config FILE [--cpu-devices N] [--print-config] [section.key=value]`

The loop: build the mesh, the data and the sharded state (inside jit, so no
replicated copy ever exists), compile the step once ahead of time, then run it
with no host synchronisation except at log steps.
"""

from __future__ import annotations

import math
import signal
import sys
import time
from pathlib import Path

import jax
import numpy as np
from tqdm import tqdm

from ultrajax import cli
from ultrajax.config.parse import dump
from ultrajax.config.schema import Config
from ultrajax.config.validate import no_effect
from ultrajax.cost import flops, units
from ultrajax.cost import memory as memory_lib
from ultrajax.model.llama import param_count
from ultrajax.parallel import mesh as mesh_lib
from ultrajax.train import batch as batch_lib
from ultrajax.train import checkpoint as checkpoint_lib
from ultrajax.train import metrics as metrics_lib
from ultrajax.train import optim, peaks, preemption
from ultrajax.train import resume as resume_lib
from ultrajax.train.noise import NoiseScale
from ultrajax.train.ramp import Ramp
from ultrajax.train.setup import compile_steps, prepare, rows_to_global, to_global
from ultrajax.train.step import (
    jit_grad_norm,
)


def train(cfg: Config) -> int:
    lead = jax.process_index() == 0
    say = print if lead else (lambda *a, **k: None)
    resume = resume_lib.resume_source(cfg)  # checked first: a refused resume fails fast
    mesh, rules, data, state, step_fn, eval_fn, batch_sh = prepare(cfg, fresh=resume is None)
    run_dir = Path(cfg.train.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if lead:  # one writer per file, also when the run directory is shared by all hosts
        (run_dir / "config.yaml").write_text(dump(cfg))

    m, t = cfg.model, cfg.train
    say(dump(cfg).rstrip())
    say(mesh_lib.describe(mesh, rules))
    say(mesh_lib.describe_hosts(mesh))
    for line in no_effect(cfg) if lead else ():
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
    say(data.summary)
    # resume (state, data position) or init_from (parameters) before the first batch is read
    ckpt, state, start = resume_lib.start(cfg, state, data, say, resume)
    ramp = Ramp(cfg)
    ramp.load((data.progress or {}).get("ramp"), start)
    if ramp.done:
        ckpt.close()
        say(
            f"{ckpt.dir} is at step {start}: train.steps={t.steps} is reached, nothing to "
            "train. To train longer, raise train.steps (with train.reschedule=true, or "
            f"optim.schedule_steps={optim.schedule_steps(cfg)} to keep the schedule); to "
            f"start over, give train.run_dir=... or delete {run_dir}"
        )
        return 0

    # batches are read, packed and placed on a background thread, data.prefetch ahead
    data.train.grad_accum = ramp.grad_accum
    feed = data.feed(
        lambda p, rows, ga: rows_to_global(p, rows, ga, batch_sh, cfg), cfg.data.prefetch
    )
    with jax.set_mesh(mesh):
        steps = compile_steps(step_fn, state, ramp, batch_sh, cfg, say)
        eval_batches = [to_global(b, batch_sh, cfg) for b in data.eval_batches(t.eval_batches)]
        probe = None
        if t.noise_every:
            params_sh = {"params": jax.tree.map(lambda a: a.sharding, state["params"])}
            grad_norm = jit_grad_norm(cfg, mesh, rules, params_sh, batch_sh)
            one = batch_lib.abstract(1, t.micro_batch_size * cfg.dp, m.seq_len, batch_sh)
            probe = grad_norm.lower(state["params"], one).compile()
        first = next(feed)

    peak, peak_source = peaks.host_peak(cfg)
    say(f"peak: {units.human(peak)}FLOP/s ({peak_source})")
    fpt, hfpt = flops.flops_per_token(m), flops.hardware_flops_per_token(m)
    writer = metrics_lib.MetricsWriter(run_dir, fresh=start == 0) if lead else None

    def evaluate():
        total, count = 0.0, 0
        for b in eval_batches:
            s, n = eval_fn(state["params"], b)
            total, count = total + float(s), count + int(n)
        return total / max(count, 1) if count else None

    history, eval_loss, last = [], None, None
    tokens_per_s_all = []
    base = ramp.base
    bar = tqdm(total=t.steps, initial=round(ramp.tokens / base), disable=not lead,
               dynamic_ncols=True, desc="train")  # fmt: skip
    t_last, tokens_last = time.perf_counter(), ramp.tokens
    noise = NoiseScale()
    if data.progress and data.progress.get("noise"):
        noise.load(data.progress["noise"])
    pending = []  # noise measurements waiting for the next host sync
    take = jax.jit(
        lambda b, i: batch_lib.Batch(*(jax.lax.dynamic_index_in_dim(a, i, 0) for a in b)),
        out_shardings=batch_sh,
    )
    batch = first
    profile = t.profile_steps
    step = start
    # Preemption: SIGTERM or Ctrl-C -> save this step and stop; on the way out, wait for
    # pending saves (a second Ctrl-C exits at once) and put the previous handlers back
    with jax.set_mesh(mesh), preemption.Preemption(ckpt) as preempted:
        while not ramp.done:
            if profile and step == profile[0]:
                jax.profiler.start_trace(str(run_dir / "profile"))
            if probe is not None and ramp.grad_accum > 1 and step % t.noise_every == 0:
                # each micro-batch's gradient alone, at the parameters the step is about to use
                small = [probe(state["params"], take(batch, i)) for i in range(ramp.grad_accum)]
            else:
                small = None
            state, out = steps[ramp.grad_accum](state, batch, np.float32(ramp.position))
            if small is not None:
                pending.append((small, out["grad_norm"], out["n_targets"]))
            if profile and step == profile[1]:
                jax.block_until_ready(state)
                jax.profiler.stop_trace()
                jax.profiler.save_device_memory_profile(str(run_dir / "memory.prof"))
                say(f"profile of steps {profile[0]}..{profile[1]} written to {run_dir}/profile")
            step_tokens = ramp.tokens_per_step
            switched = ramp.step_done()
            step = done = step + 1
            stop = preempted(done)
            bar.update(step_tokens // base if step_tokens % base == 0 else step_tokens / base)
            is_log = done == 1 or done % t.log_every == 0 or ramp.done or stop or switched
            is_eval = eval_batches and (done % t.eval_every == 0 or ramp.done)
            record = None
            if is_log or is_eval:
                out = jax.device_get(out)  # the only host sync: at log steps
                switched |= ramp.observe(float(out["loss"]))  # a loss threshold reached
                for parts, big, b_big in jax.device_get(pending):
                    small_sq = float(np.mean([float(n) ** 2 for n, _ in parts]))
                    b_small = float(np.mean([float(c) for _, c in parts]))
                    noise.update(small_sq, b_small, float(big) ** 2, float(b_big))
                pending.clear()
                now = time.perf_counter()
                tokens_per_s = (ramp.tokens - tokens_last) / (now - t_last)
                step_time = step_tokens / tokens_per_s
                t_last, tokens_last = now, ramp.tokens
                tokens_per_s_all.append(tokens_per_s)
                record = {
                    "step": done,
                    "time": time.time(),  # wall clock, to line runs and restarts up
                    "tokens": ramp.tokens,  # trained so far: exact across resume and ramps
                    "tokens_per_step": step_tokens,
                    "loss": float(out["loss"]),
                    "loss_ema": ramp.loss_ema,
                    "grad_norm": float(out["grad_norm"]),
                    "lr": float(out["lr"]),
                    "tokens_per_s": tokens_per_s,
                    "step_time_s": step_time,
                    "mfu": tokens_per_s * fpt / peak,
                    "hfu": tokens_per_s * hfpt / peak,
                }
                if noise.b_simple is not None:
                    record["b_simple"] = noise.b_simple  # the critical batch, in tokens
            if stop or ckpt.due(done) or ramp.done:
                # async; the data state is taken before the next step's batch is pulled
                data.progress = {"ramp": ramp.state(), "noise": noise.state()}
                ckpt.save(done, state, data.state())
            if switched and not ramp.done:
                feed = data.regroup(ramp.grad_accum)  # drops batches made at the old size
                if lead:
                    tqdm.write(
                        f"batch: {ramp.tokens_per_step:,} tokens per step from here "
                        f"({ramp.grad_accum} x {ramp.unit:,}; stage {ramp.stage} of the "
                        f"schedule, at {ramp.tokens:,} tokens)"
                    )
            if not ramp.done and not stop:
                batch = next(feed)
            if record is None:
                continue
            if stop and preempted.signum == signal.SIGINT and lead:
                tqdm.write(f"Ctrl-C: saving step {done}, then stopping (Ctrl-C again: quit now)")
            if not math.isfinite(record["loss"]):
                bar.close()
                cli.fail(f"loss is {record['loss']} at step {done}; lower optim.lr", code=1)
            if is_eval:
                eval_loss = evaluate()
                record["eval_loss"] = eval_loss
                t_last = time.perf_counter()  # evaluation time is not step time
            history.append(record)
            last = record
            if writer:
                writer.write(record)
            bar.set_postfix(loss=f"{record['loss']:.3f}", refresh=False)
            if lead:
                ev = f" eval {eval_loss:.4f}" if is_eval and eval_loss is not None else ""
                crit = record.get("b_simple")
                bc = f" bcrit {units.human(crit)}tok" if crit is not None else ""
                tqdm.write(
                    f"step {done:>6} loss {record['loss']:.4f}{ev} gnorm {record['grad_norm']:.3f}"
                    f" lr {record['lr']:.2e} {tokens_per_s:,.0f} tok/s"
                    f" {step_time * 1e3:.0f} ms/step mfu {record['mfu']:.1%}{bc}"
                )
            if stop:
                break
    bar.close()
    data.close()
    if writer:
        writer.close()

    steady = tokens_per_s_all[1:] or tokens_per_s_all
    tps = float(np.median(steady))
    mem = peaks.peak_memory_bytes()
    say("summary:")
    say(f"  tokens/s     {tps:,.0f} (median of logged intervals)")
    say(f"  MFU / HFU    {tps * fpt / peak:.1%} / {tps * hfpt / peak:.1%}  (peak: {peak_source})")
    say(f"  peak memory  {mem / 2**30:.2f} GiB" if mem else "  peak memory  not reported (CPU)")
    for line in memory_lib.summary_lines(cfg, mem):  # predicted breakdown (cost/memory.py)
        say(line)
    if history:
        first_loss = history[0]["loss"]
        say(f"  train loss   {first_loss:.4f} at step {history[0]['step']} -> {last['loss']:.4f}")
    if eval_loss is not None:
        say(f"  eval loss    {eval_loss:.4f}")
    if noise.b_simple is not None:
        ratio = ramp.tokens_per_step / noise.b_simple
        say(
            f"  batch        {ramp.tokens_per_step:,} tokens per step, {ratio:.2g}x the measured "
            f"critical batch B_simple = {noise.b_simple:,.0f} tokens ("
            + ("above it: larger batches would waste compute)" if ratio > 2 else
               "below it: larger batches would train faster per step)" if ratio < 0.5 else
               "near it)")
        )  # fmt: skip
    say(f"  metrics      {run_dir / 'metrics.jsonl'}")
    ckpt.close()
    if preempted.requested:
        say(
            f"stopped by {preempted.reason} after step {done}: saved in {ckpt.dir / str(done)};"
            " run the same command again to resume"
        )
        return preempted.code  # 143 (SIGTERM) or 130 (Ctrl-C): the run did not finish
    return 0
