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
import shutil
import typing
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from ultrajax.config import parse, validate
from ultrajax.config.schema import Config, ConfigError, ModelConfig
from ultrajax.data import sources
from ultrajax.data import tokenizer as tokenizer_lib
from ultrajax.model import llama

FORMAT = 1
# <checkpoint.dir>/tokenizers/<digest>.json: each tokenizer.json the run was trained with,
# named by the digest its checkpoints' data position carries
TOKENIZERS = "tokenizers"
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
    """A step that cannot be read (a file cut short, a disk error), with the way on: the
    step before it, once this one is moved out of the directory (a resume never skips a
    step on its own, and refuses to start below one that is there)."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    earlier = [s for s in _steps(root) if s < step]
    way = (
        f"; to resume from step {earlier[-1]}, the last before it, move {_where(root, step)} "
        f"out of {root} and run the same command again"
        if earlier
        else ""
    )
    return ConfigError(
        f"checkpoint {_where(root, step)} cannot be read ({type(e).__name__}: {first[:300]}){way}"
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
                setattr(obj, key, parse._coerce(value, hints[key], f"{section.name}.{key}"))
    try:
        validate.validate(cfg)
    except ConfigError as e:
        raise ConfigError(f"{where}: its config is invalid: {e}") from None
    return cfg


def read_config(path: str | Path) -> Config:
    root, step = locate(path)
    return config_from_dict(_read_json_item(root, step, "config"), _where(root, step))


def beside(path: str | Path, cfg: Config, name: str) -> Path | None:
    """A file kept beside a checkpoint's steps (hf-to-orbax's tokenizer.json and
    generation_config.json), or beside the checkpoint its run started from
    (checkpoint.init_from): a fine-tuned model keeps what its base came with."""
    roots = [locate(path)[0]]
    if cfg.checkpoint.init_from:
        try:
            roots.append(locate(cfg.checkpoint.init_from)[0])
        except ConfigError:  # moved or removed since: nothing beside it to read
            pass
    return next((r / name for r in roots if (r / name).is_file()), None)


def read_tokenizer(path: str | Path, cfg: Config):
    """The tokenizer a checkpoint's weights were trained with: the run's copy named by the
    step's data position (Checkpoints.keep_tokenizer); for a parameter-only checkpoint
    (hf-to-orbax), the tokenizer.json `beside` it; else data.tokenizer as the saved
    config names it."""
    root, step = locate(path)
    if (root / str(step) / "data").exists():
        digest = _read_json_item(root, step, "data").get("tokenizer")
        kept = root / TOKENIZERS / f"{digest}.json"
        if digest in (None, tokenizer_lib.ByteTokenizer.digest) or not kept.is_file():
            kept = None
    else:
        kept = beside(path, cfg, "tokenizer.json")
    return tokenizer_lib.HFTokenizer(str(kept)) if kept else sources.make_tokenizer(cfg.data)


# --------------------------------------------------------------------------- checks


def check_model(saved: ModelConfig, want: ModelConfig, where: str, warn=print) -> None:
    """The keys the parameter shapes read (llama.SHAPE_KEYS, and the head dimension) must
    agree; numeric ones that differ are reported, not refused."""
    diffs = [
        f"model.{k}={getattr(saved, k)} in the checkpoint, {getattr(want, k)} in the config"
        for k in llama.SHAPE_KEYS
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


class SaveFailed(Exception):
    """A checkpoint could not be written (a full disk, a lost mount): the run stops with
    one line, status 1. The checkpoints before it are whole; the next start removes the
    unfinished one and resumes from the last of them."""


def _save_failed(directory: Path, e: Exception) -> SaveFailed:
    text = str(e)
    reason = "no space left on device" if "No space left on device" in text else text
    reason = " ".join(reason.split())[:300]  # Orbax's messages run to a page
    return SaveFailed(
        f"could not save a checkpoint in {directory}: {reason}. Free space (or set another "
        "checkpoint.dir) and run the same command again: it resumes from the last whole "
        "checkpoint"
    )


class Checkpoints:
    """The run's CheckpointManager: asynchronous saves, the last `keep` kept."""

    def __init__(self, cfg: Config):
        self.dir = checkpoint_dir(cfg)
        self.every = cfg.checkpoint.every
        self._config = parse.to_dict(cfg)
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
            optimizer=ocp.args.StandardSave(training_state(state)),
            data=ocp.args.JsonSave(data_state),
            config=ocp.args.JsonSave(self._config),
            meta=ocp.args.JsonSave({"step": step, "seed": self._seed, "kind": "train"}),
        )
        try:  # an earlier save's failure shows here too
            self._mngr.save(step, args=args, force=True)
        except Exception as e:
            raise _save_failed(self.dir, e) from None

    def keep_tokenizer(self, tokenizer) -> None:
        """A copy of the run's tokenizer.json beside its checkpoints, named by its digest:
        generate and convert then read the tokenizer the weights were trained with from any
        directory, also once data.tokenizer has moved or been replaced (process 0 only)."""
        if tokenizer.path is None:  # bytes: nothing to keep
            return
        kept = self.dir / TOKENIZERS / f"{tokenizer.digest}.json"
        if kept.is_file():
            return
        data = Path(tokenizer.path).read_bytes()
        if tokenizer_lib.digest_of(data) != tokenizer.digest:  # replaced since it was read
            return
        kept.parent.mkdir(exist_ok=True)
        part = kept.with_suffix(".part")  # a copy cut short is never taken for the tokenizer
        part.write_bytes(data)
        part.replace(kept)

    def reached_preemption(self, step: int) -> bool:
        """Multi-process runs: JAX's pre-emption notice, agreed on by every process."""
        return self._mngr.reached_preemption(step)

    def wait(self) -> None:
        try:
            self._mngr.wait_until_finished()
        except Exception as e:
            raise _save_failed(self.dir, e) from None

    def close(self) -> None:
        self.wait()
        self._mngr.close()


def training_state(state: dict) -> dict:
    """The train state but its parameters: the "optimizer" item (step, optimizer state,
    model.fp8=delayed's amax histories). Hugging Face export reads only the params."""
    return {k: v for k, v in state.items() if k != "params"}


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
        config=ocp.args.JsonSave(parse.to_dict(cfg)),
        meta=ocp.args.JsonSave({"step": step, "seed": cfg.train.seed, "kind": "params"}),
    )
    mngr.save(step, args=args, force=True)
    mngr.wait_until_finished()
    mngr.close()
    return root / str(step)


# --------------------------------------------------------------------------- reading


def abstract_params(cfg: ModelConfig) -> dict:
    """ShapeDtypeStructs of the parameters (nothing allocated)."""
    return jax.eval_shape(functools.partial(llama.init_params, cfg), jax.random.key(0))


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
