"""Checkpoints that survive pre-emption: Orbax, asynchronous, exact resume, any layout.

A checkpoint is one numbered directory (the step) under `checkpoint.dir`
(default `<train.run_dir>/checkpoints`) holding five Orbax items:

  params     the parameters, one array per leaf, each shard written by its owner
  optimizer  {"step", "opt_state"}: everything the next update reads. Absent in
             parameter-only checkpoints (`ultrajax.convert hf-to-orbax`)
  data       the grain iterator's state at exactly this step (JSON; every process
             reads the same global stream, so one state serves any process count)
  config     the resolved config of the run (JSON)
  meta       {"step", "seed", "kind"}: the run's only randomness is its seed

Why resume is exact: the state, the data position and the seed are all there is.
The train loop pulls the batch of step n+1 right after dispatching step n, so
the data state saved with step n is captured *before* that pull.

Why a layout change is free: arrays are stored whole (Orbax/tensorstore writes
each shard into one logical array), and a restore is told where every leaf
should live by an abstract target whose `ShapeDtypeStruct`s carry the shardings
of the new mesh (`step.state_shardings`), so each device reads only its slice.

Safety: Orbax writes a step into `<step>.orbax-checkpoint-tmp` and renames it
only when every item is complete, so a save killed half-way leaves the last
good checkpoint as the latest. An unfinished temporary directory is ignored, and
the next run removes it at start (saying so); no finished checkpoint is ever
deleted except by the `keep` policy.
Stopping: SIGTERM and Ctrl-C both finish the step, save it and stop (`Preemption`);
a second Ctrl-C exits at once, which at worst leaves such a temporary directory.
Everything a restore can trip on (a missing or corrupt directory, a config whose
shapes differ) is a ConfigError naming what differs: one line, exit status 2.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import signal
import sys
import threading
import typing
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from ultrajax import config as config_lib
from ultrajax import optim
from ultrajax.config import Config, ConfigError, ModelConfig
from ultrajax.model import init_params

FORMAT = 1
# model keys that decide the parameter shapes: a difference is an error
SHAPE_KEYS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff")
# keys that change the function the weights compute: a difference is reported
NUMERIC_KEYS = (
    "rope_theta",
    "rope_scaling",
    "rope_factor",
    "rope_low_freq_factor",
    "rope_high_freq_factor",
    "rope_original_max_len",
    "norm_eps",
)


# --------------------------------------------------------------------------- locating


def checkpoint_dir(cfg: Config) -> Path:
    """checkpoint.dir, or `<train.run_dir>/checkpoints` when it is null."""
    d = cfg.checkpoint.dir or str(Path(cfg.train.run_dir) / "checkpoints")
    return Path(d).absolute()


def _steps(root: Path) -> list[int]:
    """Finished steps only: Orbax's temporary directories are not digits."""
    if not root.is_dir():
        return []
    return sorted(int(p.name) for p in root.iterdir() if p.is_dir() and p.name.isdigit())


# what Orbax names a step (or item) it is still writing: `<step>.orbax-checkpoint-tmp-<time>`
TMP_PATTERN = "*.orbax-checkpoint-tmp*"


def remove_tmp(root: Path, say=print) -> list[str]:
    """Remove the temporary directories of saves that were killed, saying which.

    They are never a checkpoint (Orbax renames a step only once it is complete), but
    they hold a whole step's arrays, and nothing else would ever delete them."""
    if not root.is_dir():
        return []
    removed = sorted(p.name for p in root.glob(TMP_PATTERN))
    for name in removed:
        path = root / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    if removed:
        say(
            f"removed {len(removed)} unfinished save(s) left by a killed run in {root}: "
            f"{', '.join(removed)}"
        )
    return removed


def locate(path: str | Path) -> tuple[Path, int]:
    """A step directory (runs/x/checkpoints/100), a directory of steps (-> the latest), or
    a run directory (runs/x -> the latest in runs/x/checkpoints)."""
    p = Path(path).absolute()
    if not p.exists():
        raise ConfigError(f"checkpoint {str(path)!r} does not exist")
    if p.is_dir() and p.name.isdigit() and (p / "meta").exists():
        return p.parent, int(p.name)
    if not _steps(p) and (p / "checkpoints").is_dir():
        p = p / "checkpoints"
    steps = _steps(p)
    if not steps:
        raise ConfigError(
            f"checkpoint {str(path)!r} holds no finished checkpoint "
            "(expected numbered step directories, or one of them)"
        )
    return p, steps[-1]


def _handlers() -> dict:
    return {
        "params": ocp.StandardCheckpointHandler(),
        "optimizer": ocp.StandardCheckpointHandler(),
        "data": ocp.JsonCheckpointHandler(),
        "config": ocp.JsonCheckpointHandler(),
        "meta": ocp.JsonCheckpointHandler(),
    }


def _reader(root: Path) -> ocp.CheckpointManager:
    """For restoring only: it never saves, so it never deletes (no keep policy)."""
    options = ocp.CheckpointManagerOptions(create=False, enable_async_checkpointing=False)
    return ocp.CheckpointManager(root, options=options, item_handlers=_handlers())


def _where(root: Path, step: int) -> str:
    return str(root / str(step))


def _unreadable(root: Path, step: int, e: Exception) -> ConfigError:
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return ConfigError(
        f"checkpoint {_where(root, step)} cannot be read ({type(e).__name__}: {first[:300]})"
    )


def _read_json_item(root: Path, step: int, item: str) -> dict:
    mngr = _reader(root)
    try:
        out = mngr.restore(step, args=ocp.args.Composite(**{item: ocp.args.JsonRestore()}))
        value = out[item]
    except Exception as e:
        if not (root / str(step) / item).exists():
            raise ConfigError(f"checkpoint {_where(root, step)} has no {item!r} item") from None
        raise _unreadable(root, step, e) from None
    finally:
        mngr.close()
    if not isinstance(value, dict):
        raise ConfigError(f"checkpoint {_where(root, step)}: item {item!r} is not a JSON object")
    return value


def config_from_dict(tree: dict, where: str = "checkpoint") -> Config:
    """A Config from `config.to_dict` output; unknown keys (from newer versions) are ignored."""
    cfg = Config()
    for section in dataclasses.fields(Config):
        values = tree.get(section.name) or {}
        obj = getattr(cfg, section.name)
        hints = typing.get_type_hints(type(obj))
        for key, value in values.items():
            if key in hints:
                setattr(obj, key, config_lib._coerce(value, hints[key], f"{section.name}.{key}"))
    try:
        config_lib.validate(cfg)
    except ConfigError as e:
        raise ConfigError(f"{where}: its config is invalid: {e}") from None
    return cfg


def read_config(path: str | Path) -> Config:
    root, step = locate(path)
    return config_from_dict(_read_json_item(root, step, "config"), _where(root, step))


def read_meta(path: str | Path) -> dict:
    root, step = locate(path)
    return _read_json_item(root, step, "meta")


# --------------------------------------------------------------------------- checks


def check_model(saved: ModelConfig, want: ModelConfig, where: str, warn=print) -> None:
    """Architecture keys must agree; numeric ones that differ are reported, not refused."""
    diffs = [
        f"model.{k}={getattr(saved, k)} in the checkpoint, {getattr(want, k)} in the config"
        for k in SHAPE_KEYS + ("tie_embeddings",)
        if getattr(saved, k) != getattr(want, k)
    ]
    if saved.hd != want.hd:
        diffs.append(f"head dimension {saved.hd} in the checkpoint, {want.hd} in the config")
    if diffs:
        raise ConfigError(f"checkpoint {where} does not match the config: {'; '.join(diffs)}")
    for k in NUMERIC_KEYS:
        if getattr(saved, k) != getattr(want, k):
            warn(
                f"note: model.{k} is {getattr(saved, k)} in checkpoint {where} "
                f"and {getattr(want, k)} in the config (using the config's)"
            )


def _keyname(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def _check_tree(saved_meta, target, where: str, item: str, hint: str = "") -> None:
    """Same leaves, same shapes: otherwise name the first leaf that differs."""
    saved = {_keyname(p): m for p, m in jax.tree_util.tree_leaves_with_path(saved_meta)}
    want = {_keyname(p): t for p, t in jax.tree_util.tree_leaves_with_path(target)}
    missing = [k for k in want if k not in saved]
    extra = [k for k in saved if k not in want]
    if missing or extra:
        what = (
            f"lacks {item}/{missing[0]}"
            if missing
            else f"has {item}/{extra[0]}, which the config does not"
        )
        raise ConfigError(f"checkpoint {where} {what}{hint}")
    for k, t in want.items():
        shape = tuple(getattr(saved[k], "shape", ()) or ())
        if shape != tuple(t.shape):
            raise ConfigError(
                f"checkpoint {where}: {item}/{k} has shape {shape}, the config needs "
                f"{tuple(t.shape)}"
            )


def _item_metadata(mngr: ocp.CheckpointManager, step: int, item: str, root: Path):
    try:
        meta = mngr.item_metadata(step)
        return meta[item] if meta is not None and item in meta else None
    except Exception as e:
        raise _unreadable(root, step, e) from None


# --------------------------------------------------------------------------- writing


class Checkpoints:
    """The run's CheckpointManager: asynchronous saves, the last `keep` kept."""

    def __init__(self, cfg: Config):
        self.dir = checkpoint_dir(cfg)
        self.every = cfg.checkpoint.every
        self._config = config_lib.to_dict(cfg)
        self._seed = cfg.train.seed
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.checkpoint.keep, enable_async_checkpointing=True, create=True
        )
        self._mngr = ocp.CheckpointManager(self.dir, options=options)

    def steps(self) -> list[int]:
        return list(self._mngr.all_steps())

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def save(self, step: int, state: dict, data_state: dict) -> None:
        """Start an asynchronous save. Returns once the arrays are copied off the
        devices (so the caller may donate `state` to the next step); the writing
        goes on in a background thread."""
        args = ocp.args.Composite(
            params=ocp.args.StandardSave(state["params"]),
            optimizer=ocp.args.StandardSave(
                {"step": state["step"], "opt_state": state["opt_state"]}
            ),
            data=ocp.args.JsonSave(data_state),
            config=ocp.args.JsonSave(self._config),
            meta=ocp.args.JsonSave({"step": step, "seed": self._seed, "kind": "train"}),
        )
        self._mngr.save(step, args=args, force=True)

    def reached_preemption(self, step: int) -> bool:
        """Multi-process runs: JAX's pre-emption notice, agreed on by every process."""
        return self._mngr.reached_preemption(step)

    def wait(self) -> None:
        self._mngr.wait_until_finished()

    def close(self) -> None:
        self._mngr.wait_until_finished()
        self._mngr.close()


def write_params(directory: str | Path, params: dict, cfg: Config, step: int = 0) -> Path:
    """A parameter-only checkpoint (what `convert hf-to-orbax` writes), synchronously.

    `params` may hold numpy arrays: they are written as they are, never copied."""
    root = Path(directory).absolute()
    if _steps(root):
        raise ConfigError(f"{root} already holds checkpoints; choose an empty directory")
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False, create=True)
    mngr = ocp.CheckpointManager(root, options=options)
    args = ocp.args.Composite(
        params=ocp.args.StandardSave(params),
        config=ocp.args.JsonSave(config_lib.to_dict(cfg)),
        meta=ocp.args.JsonSave({"step": step, "seed": cfg.train.seed, "kind": "params"}),
    )
    mngr.save(step, args=args, force=True)
    mngr.wait_until_finished()
    mngr.close()
    return root / str(step)


# --------------------------------------------------------------------------- reading


def abstract_params(cfg: ModelConfig) -> dict:
    """ShapeDtypeStructs of the parameters (nothing allocated)."""
    return jax.eval_shape(functools.partial(init_params, cfg), jax.random.key(0))


def _with_shardings(abstract, shardings):
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
    )


def load_params(path: str | Path, cfg: ModelConfig, shardings=None, warn=print) -> dict:
    """Parameters only (fine-tuning, generation, conversion), cast to cfg.param_dtype.

    `shardings`: a tree of shardings like the parameters (any mesh), or one sharding
    for every leaf; default: the first device."""
    root, step = locate(path)
    where = _where(root, step)
    saved = config_from_dict(_read_json_item(root, step, "config"), where)
    check_model(saved.model, cfg, where, warn)
    abstract = abstract_params(cfg)
    if shardings is None:
        shardings = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    if isinstance(shardings, jax.sharding.Sharding):
        shardings = jax.tree.map(lambda _: shardings, abstract)
    target = _with_shardings(abstract, shardings)
    mngr = _reader(root)
    try:
        meta = _item_metadata(mngr, step, "params", root)
        if meta is None:
            raise ConfigError(f"checkpoint {where} has no parameters")
        _check_tree(meta, target, where, "params")
        try:
            out = mngr.restore(
                step, args=ocp.args.Composite(params=ocp.args.StandardRestore(target))
            )
        except Exception as e:
            raise _unreadable(root, step, e) from None
    finally:
        mngr.close()
    return out["params"]


def restore_train(
    path: str | Path, cfg: Config, target: dict, data, warn=print
) -> tuple[dict, int]:
    """Restore a training checkpoint onto `target`'s shardings (any layout).

    `target` is a tree of ShapeDtypeStructs carrying shardings, shaped like the
    train state. Returns (state, step) and sets `data` to the saved position."""
    root, step = locate(path)
    where = _where(root, step)
    meta = _read_json_item(root, step, "meta")
    if meta.get("kind") != "train":
        raise ConfigError(
            f"checkpoint {where} holds parameters only (no optimizer state); "
            "start from it with checkpoint.init_from instead of checkpoint.resume"
        )
    saved = config_from_dict(_read_json_item(root, step, "config"), where)
    try:
        check_model(saved.model, cfg.model, where, warn)
    except ConfigError as e:  # most often: the shape changed, the run directory did not
        raise ConfigError(
            f"{e}. To train the new shape, give it its own run directory "
            f"(train.run_dir=..., or leave train.run_dir unset: each config then gets its "
            f"own), or delete {root} to start over; to continue that run, use its config"
        ) from None
    check_schedule(saved, cfg, where, step, warn)
    if saved.global_batch != cfg.global_batch:
        warn(
            f"note: the global batch was {saved.global_batch} samples in {where} and is "
            f"{cfg.global_batch} now: the data continues, but batches differ from the old run's"
        )
    opt_target = {"step": target["step"], "opt_state": target["opt_state"]}
    mngr = _reader(root)
    try:
        params_meta = _item_metadata(mngr, step, "params", root)
        opt_meta = _item_metadata(mngr, step, "optimizer", root)
        if params_meta is None or opt_meta is None:
            raise ConfigError(f"checkpoint {where} lacks its params or optimizer item")
        _check_tree(params_meta, target["params"], where, "params")
        _check_tree(
            opt_meta,
            opt_target,
            where,
            "optimizer",
            " (the optim.* settings changed the optimizer state's structure)",
        )
        try:
            out = mngr.restore(
                step,
                args=ocp.args.Composite(
                    params=ocp.args.StandardRestore(target["params"]),
                    optimizer=ocp.args.StandardRestore(opt_target),
                    data=ocp.args.JsonRestore(),
                ),
            )
        except Exception as e:
            raise _unreadable(root, step, e) from None
    finally:
        mngr.close()
    data.restore(out["data"])
    state = {
        "step": out["optimizer"]["step"],
        "params": out["params"],
        "opt_state": out["optimizer"]["opt_state"],
    }
    return state, step


def _free(tree) -> None:
    """Free device buffers now (the caller drops its references right after)."""
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array) and not leaf.is_deleted():
            leaf.delete()


def resume_source(cfg: Config) -> tuple[Path, int] | None:
    """The checkpoint `checkpoint.resume` picks, or None to start fresh.

    auto: the latest in checkpoint.dir, or a fresh start when there is none (a requeued
    job continues by itself). must: the latest, and an error when there is none (a job
    that must never start over by accident). never: a fresh start, refused when
    checkpoint.dir already holds checkpoints (the keep policy would delete them). A path:
    that checkpoint, refused when checkpoint.dir holds later steps (they would be
    overwritten).
    """
    root = checkpoint_dir(cfg)
    steps = _steps(root)
    mode = cfg.checkpoint.resume
    if mode == "auto":
        return (root, steps[-1]) if steps else None
    if mode == "must":
        if not steps:
            raise ConfigError(
                f"checkpoint.resume=must, but {root} holds no checkpoint: check train.run_dir "
                "(or checkpoint.dir), or use checkpoint.resume=auto to start fresh when "
                "there is none"
            )
        return root, steps[-1]
    if mode == "never":
        if steps:
            raise ConfigError(
                f"checkpoint.resume=never starts from step 0, but {root} already holds "
                f"checkpoints (steps {', '.join(map(str, steps))}) that it would delete: give "
                "this run its own train.run_dir=..., delete that folder, or use "
                "checkpoint.resume=auto to continue it"
            )
        return None
    source = locate(mode)
    newer = [s for s in steps if s > source[1]]
    if newer:
        raise ConfigError(
            f"checkpoint.dir {root} already holds steps after {source[1]} "
            f"({', '.join(map(str, newer))}); resume into another checkpoint.dir"
        )
    return source


def check_schedule(saved: Config, cfg: Config, where: str, step: int, warn=print) -> None:
    """A resume must not change the learning-rate schedule behind the user's back.

    Changing train.steps (or optim.schedule_steps) moves the end of a cosine or WSD
    schedule, so the learning rate jumps at the next step. Refused unless asked for with
    train.reschedule=true; the other way is to keep the old schedule's length."""
    old, new = optim.schedule_steps(saved), optim.schedule_steps(cfg)
    if old == new or cfg.optim.schedule == "constant":
        return
    before = float(optim.schedule(saved)(step))
    after = float(optim.schedule(cfg)(step))
    change = f"the learning rate at step {step} goes from {before:.2e} to {after:.2e}"
    if cfg.train.reschedule:
        warn(
            f"rescheduled: the {cfg.optim.schedule} schedule spanned {old} steps in {where} "
            f"and spans {new} now; {change}"
        )
        return
    raise ConfigError(
        f"{where} was trained on a {cfg.optim.schedule} schedule over {old} steps; spanning "
        f"{new} would change it mid-run ({change}). Add train.reschedule=true to accept "
        f"that, or optim.schedule_steps={old} to keep the old schedule (it stays at its "
        "last value past its end)"
    )


_PICK = object()


def start(cfg: Config, state: dict, data, say=print, source=_PICK):
    """Open the run's checkpoints and pick where training starts: (Checkpoints, state, step).

    `source` is `resume_source(cfg)` (computed here if not given). `state` gives the
    target layout: ShapeDtypeStructs with shardings, or a freshly initialised state
    whose buffers are freed once a checkpoint replaces them. Without a checkpoint to
    resume, checkpoint.init_from loads parameters only (the optimizer starts fresh).
    """
    if source is _PICK:
        source = resume_source(cfg)
    if jax.process_index() == 0:  # one remover, also when the directory is shared
        remove_tmp(checkpoint_dir(cfg), say)
    ck = Checkpoints(cfg)
    if source is not None:
        target = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state
        )
        _free(state)
        state, step = restore_train(source[0] / str(source[1]), cfg, target, data, warn=say)
        say(f"resumed from {source[0] / str(source[1])} at step {step}")
        return ck, state, step
    if cfg.checkpoint.init_from:
        shardings = jax.tree.map(lambda a: a.sharding, state["params"])
        _free(state["params"])
        state = dict(state, params=load_params(cfg.checkpoint.init_from, cfg.model, shardings, say))
        say(
            f"no checkpoint in {ck.dir}: parameters loaded from {cfg.checkpoint.init_from} "
            "(optimizer state fresh)"
        )
    elif cfg.checkpoint.resume == "never":
        say(f"starting fresh at step 0 (checkpoint.resume=never); saving to {ck.dir}")
    else:
        say(f"starting fresh at step 0: no checkpoint found in {ck.dir}")
    return ck, state, 0


class Preemption:
    """SIGTERM (a scheduler's pre-emption notice) or Ctrl-C: finish the step, save it, stop.

    A context manager around the step loop: it installs the handlers (which only
    set a flag, checked once per step: no host sync) and, on the way out, by any
    path, waits for the saves still being written, then puts the previous handlers
    back. A Ctrl-C while a stop is already under way exits at once (status 130):
    whoever presses it twice will not wait for the save, and a save cut short never
    replaces the last complete checkpoint. In a multi-process run both are left
    alone: JAX's pre-emption service makes every process agree on the step to stop
    at after a SIGTERM (`CheckpointManager.reached_preemption`), and a Ctrl-C seen
    by some processes only would have them save different steps.
    """

    NAMES = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "Ctrl-C"}

    def __init__(self, ckpt: Checkpoints):
        self.ckpt = ckpt
        self.requested = False
        self.signum = signal.SIGTERM  # what stopped the run, once `requested`
        self._old = {}
        self._multi = jax.process_count() > 1

    @property
    def reason(self) -> str:
        return self.NAMES[self.signum]

    @property
    def code(self) -> int:
        """The exit status of a stopped run: 128 + the signal (143 SIGTERM, 130 Ctrl-C)."""
        return 128 + int(self.signum)

    def _handle(self, signum, frame):
        if signum == signal.SIGINT and self.requested:
            _exit_now(self.ckpt.dir)
        if not self.requested:
            self.signum = signal.Signals(signum)
        self.requested = True

    def __enter__(self):
        if not self._multi and threading.current_thread() is threading.main_thread():
            for signum in self.NAMES:
                self._old[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc):
        try:
            self.ckpt.wait()  # the handlers stay: a second Ctrl-C here exits at once
        finally:
            for signum, old in self._old.items():
                signal.signal(signum, old)
            self._old = {}
        return False

    def __call__(self, step: int) -> bool:
        """Stop after `step`? (the state of `step` is then saved by the caller)"""
        if self._multi:
            self.requested = self.requested or self.ckpt.reached_preemption(step)
        return self.requested


def _exit_now(where: Path) -> None:
    """The second Ctrl-C: leave without waiting for the save thread (which an ordinary
    exit would join). os.write, not print: the main thread may be inside a print."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a flush interrupted in the middle: what is lost is lost
            pass
    message = (
        f"\nCtrl-C again: exiting without waiting for the save in progress; the last "
        f"complete checkpoint in {where} is kept\n"
    )
    os.write(2, message.encode())
    os._exit(130)
