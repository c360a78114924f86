"""The record of a logged step: the numbers metrics.jsonl, TensorBoard and the log line
show, and the throughput clock they are measured with.

Throughput is measured on the host between two host syncs (the log steps), so it is the
rate the run really got, input pipeline and dispatch included; MFU and HFU divide it by
the device's peak (train/peaks.py) with the FLOPs per token of cost/flops.py. MFU is given
both ways: `mfu` counts the whole attention score square (PaLM's convention), `mfu_causal`
half of it, as the causal mask leaves (what trainers that halve it report).
"""

from __future__ import annotations

import time

import jax
import numpy as np

from ultrajax.config.schema import Config
from ultrajax.cost import activations, flops, units
from ultrajax.train import peaks
from ultrajax.train.ramp import Ramp


class Throughput:
    """Tokens per second between logged steps, and MFU / HFU against the device's peak.

    Evaluation restarts the clock (`pause`): its time is not step time."""

    def __init__(self, cfg: Config):
        self.peak, self.peak_source = peaks.host_peak(cfg)  # on CPU: measured once, cached
        self.fpt = flops.flops_per_token(cfg.model)  # what the model needs: MFU
        self.cfpt = flops.flops_per_token(cfg.model, causal=True)  # attention halved
        # what ran, recompute too: HFU
        saved = activations.keeps_residuals(cfg)
        self.hfpt = flops.hardware_flops_per_token(cfg.model, attention_saved=saved)
        self.rates: list[float] = []  # one per logged interval, for the summary's median
        self._since, self._tokens = time.perf_counter(), 0

    def start(self, tokens: int) -> None:
        """The clock starts here, at `tokens` trained (not 0 after a resume)."""
        self._since, self._tokens = time.perf_counter(), tokens

    def lap(self, tokens: int) -> float:
        """Tokens per second since the last lap (or start or pause), now at `tokens`."""
        now = time.perf_counter()
        rate = (tokens - self._tokens) / (now - self._since)
        self._since, self._tokens = now, tokens
        self.rates.append(rate)
        return rate

    def pause(self) -> None:
        """Restart the clock without counting tokens: what ran since was not training."""
        self._since = time.perf_counter()

    def mfu(self, rate: float) -> float:
        return rate * self.fpt / self.peak

    def mfu_causal(self, rate: float) -> float:
        return rate * self.cfpt / self.peak

    def hfu(self, rate: float) -> float:
        return rate * self.hfpt / self.peak

    def median(self) -> float:
        """The steady rate: the median of the logged intervals, leaving out the first
        (compilation and warm-up) when there are others."""
        steady = self.rates[1:] or self.rates
        return float(np.median(steady))


def step_record(
    step: int,
    out: dict,
    ramp: Ramp,
    step_tokens: int,
    rate: float,
    speed: Throughput,
    b_simple: float | None,
) -> dict:
    """One line of metrics.jsonl, from the step's outputs on the host. The key order is
    the file's; eval_loss is added after evaluation (train/loop.py)."""
    record = {
        "step": step,
        "time": time.time(),  # wall clock, to line runs and restarts up
        "tokens": ramp.tokens,  # trained so far: exact across resume and ramps
        "tokens_per_step": step_tokens,
        "loss": scalar(out["loss"]),
        "loss_ema": ramp.loss_ema,
        "grad_norm": scalar(out["grad_norm"]),
        "lr": float(out["lr"]),
        "tokens_per_s": rate,
        "step_time_s": step_tokens / rate,
        "mfu": speed.mfu(rate),
        "mfu_causal": speed.mfu_causal(rate),
        "hfu": speed.hfu(rate),
    }
    if b_simple is not None:
        record["b_simple"] = b_simple  # the critical batch, in tokens
    if "moe" in out:
        record.update(moe_record(out["moe"]))
    return record


def fetch(out):
    """A step's metrics on the host. DiLoCo's come one per replica, split over `data`, and
    across hosts no process holds them all: they are gathered then (every process calls
    this at the same steps), not inside the step, where a collective over `data` would
    run at every step."""
    if all(getattr(a, "is_fully_addressable", True) for a in jax.tree.leaves(out)):
        return jax.device_get(out)
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(out, tiled=True)


def scalar(value) -> float:
    """A step's metric as one number: DiLoCo's steps give one per replica (their mean)."""
    return float(np.mean(value))


def replicas_summed(stats: dict) -> dict:
    """MoE statistics with DiLoCo's replica axis (a leading one beyond the layers') folded:
    the counts summed, the losses averaged."""
    if np.ndim(stats["aux"]) < 2:
        return stats
    return {
        **stats,
        "load": np.sum(stats["load"], 0),
        "dropped": np.sum(stats["dropped"], 0),
        "aux": np.mean(stats["aux"], 0),
        "z": np.mean(stats["z"], 0),
    }


def moe_record(stats: dict) -> dict:
    """An MoE step's statistics (model/moe.py; loads and drops summed over its
    micro-batches and ranks, the losses their mean over micro-batches) as metrics: each
    MoE layer's expert load max/mean (1: balanced), the share of the assignments dropped
    (capacity mode), and the balance losses (mean over layers)."""
    stats = replicas_summed(stats)
    load = np.asarray(stats["load"], np.float64)  # (MoE layers, experts)
    assigned = np.maximum(load.sum(-1), 1.0)
    imbalance = load.max(-1) / np.maximum(load.mean(-1), 1e-9)
    dropped = np.asarray(stats["dropped"], np.float64) / assigned
    # named by their index among all the layers (model.moe_every interleaves dense ones)
    names = [f"layer{int(i)}" for i in stats.get("layer", range(len(load)))]
    return {
        "moe_load_max_mean": dict(zip(names, imbalance.tolist(), strict=True)),
        "moe_dropped": dict(zip(names, dropped.tolist(), strict=True)),
        "moe_aux": float(np.mean(stats["aux"])),
        "moe_z": float(np.mean(stats["z"])),
    }


def log_line(record: dict) -> str:
    """The record as the one line the run prints for it."""
    loss = record.get("eval_loss")
    ev = f" eval {loss:.4f}" if loss is not None else ""
    crit = record.get("b_simple")
    bc = f" bcrit {units.human(crit)}tok" if crit is not None else ""
    return (
        f"step {record['step']:>6} loss {record['loss']:.4f}{ev} gnorm {record['grad_norm']:.3f}"
        f" lr {record['lr']:.2e} {record['tokens_per_s']:,.0f} tok/s"
        f" {record['step_time_s'] * 1e3:.0f} ms/step mfu {record['mfu']:.1%}{bc}"
    )
