"""The metrics writer: metrics.jsonl, TensorBoard scalars, and Weights & Biases when
WANDB_PROJECT is set. The FLOPs behind MFU and HFU are cost/flops.py's; the peak they
divide by is train/peaks.py's.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import jax

from ultrajax.config.schema import ConfigError


def scalars(record: dict) -> dict[str, float]:
    """The numeric fields of a record as scalar names: eval_* under eval/, the rest under
    train/, a nested dict (memory) one level down. The step is the x axis and the wall
    clock `time` the event's own time: as a float32 scalar it would be off by minutes."""
    out = {}
    for key, value in record.items():
        if key in ("step", "time"):
            continue
        items = value.items() if isinstance(value, dict) else [(None, value)]
        for sub, v in items:
            if isinstance(v, bool) or not isinstance(v, int | float):
                continue
            if key.startswith("eval_"):
                name = f"eval/{key[5:]}"
            else:
                name = f"train/{key}"
            out[name if sub is None else f"{name}/{sub}"] = float(v)
    return out


def _wandb_run(run_dir: Path):
    """A wandb run when WANDB_PROJECT is set and wandb is installed (never required)."""
    project = os.environ.get("WANDB_PROJECT")
    if not project:
        return None
    try:
        import wandb
    except ImportError:
        print(
            "warning: WANDB_PROJECT is set but wandb is not installed; not logging to W&B",
            file=sys.stderr,
        )
        return None
    return wandb.init(project=project, name=run_dir.absolute().name, dir=str(run_dir))


def keep_earlier(run_dir: str | Path) -> Path | None:
    """A fresh start in a run directory that holds a run's metrics (its checkpoints gone,
    or none made before a crash): that run's metrics.jsonl, TensorBoard events and
    config.yaml move into run_dir/earlier-N, the first N free, instead of being
    overwritten; the only record of a crashed run is kept. Returns that directory."""
    run_dir = Path(run_dir)
    metrics, tb = run_dir / "metrics.jsonl", run_dir / "tensorboard"
    events = sorted(tb.glob("events.out.tfevents.*"))
    if not events and not (metrics.is_file() and metrics.stat().st_size):
        return None
    n = 1
    while (run_dir / f"earlier-{n}").exists():
        n += 1
    kept = run_dir / f"earlier-{n}"
    kept.mkdir()
    for path in (metrics, run_dir / "config.yaml"):
        if path.is_file():
            path.rename(kept / path.name)
    if events:
        (kept / "tensorboard").mkdir()
        for path in events:
            path.rename(kept / "tensorboard" / path.name)
    return kept


def _summary_writer():
    """tensorboardX's SummaryWriter, imported without torch. tensorboardX imports torch
    where it is installed (with transformers, say) only to accept torch tensors as values;
    the writer is handed floats, and the import cost every run's start 1.7 s on 2 cores."""
    hide = "torch" not in sys.modules
    if hide:  # `import torch` raises ImportError, which tensorboardX expects without it
        sys.modules["torch"] = None
    try:  # a base dependency; checked here so a stale install fails before step 1
        from tensorboardX import SummaryWriter
    except ImportError:
        raise ConfigError("TensorBoard logging needs tensorboardX: pip install -e .") from None
    finally:
        if hide:
            del sys.modules["torch"]
    return SummaryWriter


class MetricsWriter:
    """One JSON object per logged step in run_dir/metrics.jsonl, the same numbers as
    TensorBoard scalars in run_dir/tensorboard/, and in W&B when WANDB_PROJECT is set.

    Only process 0 writes (train/loop.py makes the writer there only; the check here keeps
    other hosts from sharing a run directory's event files). A resumed run appends: its
    event file starts with a purge at its first step, so TensorBoard drops what the
    crashed run logged past that point instead of drawing it twice.
    """

    def __init__(self, run_dir: str | Path, fresh: bool):
        run_dir = Path(run_dir)
        self.path = run_dir / "metrics.jsonl"
        self.tb_dir = run_dir / "tensorboard"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "w" if fresh else "a", buffering=1)
        self._fresh = fresh
        self._lead = jax.process_index() == 0
        self._tb = None  # made at the first record, whose step is the purge step
        if self._lead:
            self._summary_writer = _summary_writer()
        self._wandb = _wandb_run(run_dir) if self._lead else None

    def write(self, record: dict) -> None:
        self._f.write(json.dumps(record) + "\n")
        if not self._lead:
            return
        step, values = int(record["step"]), scalars(record)
        if self._tb is None:
            purge = None if self._fresh else step
            self._tb = self._summary_writer(
                str(self.tb_dir),
                purge_step=purge,
                flush_secs=1,  # its writer thread: a killed run loses about a second
                filename_suffix=f".{os.getpid()}.{time.time_ns()}",  # restarts in one second
            )
        for name, value in values.items():
            self._tb.add_scalar(name, value, step, walltime=record.get("time"))
        if self._wandb is not None:
            self._wandb.log(values, step=step)

    def close(self) -> None:
        self._f.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
