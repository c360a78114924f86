"""Where a run starts: a fresh state, a resumed checkpoint (state, data position,
schedule checked), or parameters only (checkpoint.init_from)."""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from ultrajax.config import parse
from ultrajax.config.schema import Config, ConfigError
from ultrajax.config.validate import resolve_mesh
from ultrajax.model import llama
from ultrajax.parallel import diloco
from ultrajax.train import distributed, optim
from ultrajax.train.checkpoint import (
    NUMERIC_KEYS,
    Checkpoints,
    _check_tree,
    _item_metadata,
    _read_json_item,
    _reader,
    _steps,
    _unreadable,
    _where,
    check_model,
    checkpoint_dir,
    config_from_dict,
    load_params,
    locate,
    remove_tmp,
    training_state,
)
from ultrajax.train.ramp import Ramp


def check_config(root: Path, step: int, cfg: Config, warn=print) -> Config:
    """The checkpoint's kind, model, settings and schedule against `cfg` (its small JSON
    items only): its config, or a one-line refusal naming the way out."""
    saved = _saved(root, step, cfg, warn)
    check_changes(saved, cfg, _where(root, step), warn)
    check_schedule(saved, cfg, _where(root, step), step, warn)
    return saved


def saved_config(root: Path, step: int) -> Config:
    """The config a training checkpoint was saved with."""
    return config_from_dict(_read_json_item(root, step, "config"), _where(root, step))


def _saved(root: Path, step: int, cfg: Config, warn=print) -> Config:
    """The checkpoint's config, if it is a training checkpoint of the model `cfg` has."""
    where = _where(root, step)
    meta = _read_json_item(root, step, "meta")
    if meta.get("kind") != "train":
        raise ConfigError(
            f"checkpoint {where} holds parameters only (no optimizer state); "
            "start from it with checkpoint.init_from instead of checkpoint.resume"
        )
    saved = saved_config(root, step)
    try:
        check_model(saved.model, cfg.model, where, warn)
    except ConfigError as e:  # most often: the shape changed, the run directory did not
        own = (
            f"its own checkpoint.dir=... (every run naming {root} shares it)"
            if cfg.checkpoint.dir
            else "its own run directory (train.run_dir=..., or leave train.run_dir unset: "
            "each config then gets its own)"
        )
        raise ConfigError(
            f"{e}. To train the new shape, give it {own}, or delete {root} to start over; "
            "to continue that run, use its config"
        ) from None
    return saved


def check_changes(saved: Config, cfg: Config, where: str, warn=print) -> None:
    """A resume must not change what the run is behind the user's back: its data, its
    optimizer, its seed, its dtypes (the run identity's settings). Refused, naming each,
    unless asked for with checkpoint.resume_changed=true; then each is named as it starts.
    The model's shape is check_model's (refused); its numeric keys are noted there."""
    reported = {f"model.{k}" for k in (*llama.SHAPE_KEYS, *NUMERIC_KEYS)}
    changes = [c for c in parse.identity_changes(saved, cfg) if c[0] not in reported]
    if not changes:
        return
    said = ", ".join(f"{k} {old} -> {new}" for k, old, new in changes)
    if cfg.checkpoint.resume_changed:
        warn(f"note: resuming {where} with changed settings: {said}")
        return
    raise ConfigError(
        f"resuming {where} would change the run mid-way: {said}. Add "
        "checkpoint.resume_changed=true to continue it with them; or train them as a run of "
        "their own (another train.run_dir, or none: each config then gets its own); or "
        "resume with the run's values"
    )


def restore_train(
    path: str | Path, cfg: Config, target: dict, data, warn=print, checked: bool = False
) -> tuple[dict, int]:
    """Restore a training checkpoint onto `target`'s shardings (any layout).

    `target` is a tree of ShapeDtypeStructs carrying shardings, shaped like the
    train state. Returns (state, step) and sets `data` to the saved position.
    checked: `check_resume` already checked the config (its notes are not said twice)."""
    root, step = locate(path)
    where = _where(root, step)
    if not checked:
        check_config(root, step, cfg, warn)
    opt_target = training_state(target)
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
            " (the optim.* settings or model.fp8=delayed's history changed its structure)",
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
    return dict(out["optimizer"], params=out["params"]), step


def check_resume(cfg: Config, source: tuple[Path, int], warn=print) -> Ramp:
    """Before anything is built: may the run continue from `source`, and where.

    Reads only the checkpoint's small JSON items, the same on every process (so every host
    decides alike). Returns the batch ramp at the checkpoint: `done` when the run already
    trained its token budget, whatever the batch now (the caller then writes nothing).
    Resolves a -1 mesh size from the devices, as build_run would."""
    root, step = source
    saved = _saved(root, step, cfg, warn)
    distributed.check_local_devices()
    resolve_mesh(cfg, jax.device_count())
    progress = _read_json_item(root, step, "data").get("progress") or {}
    ramp = check_batch(saved, cfg, progress.get("ramp"), step, _where(root, step))
    if not ramp.done:  # a finished run trains nothing: what would have changed does not matter
        check_changes(saved, cfg, _where(root, step), warn)
        check_schedule(saved, cfg, _where(root, step), step, warn, ramp.position)
    return ramp


def check_batch(saved: Config, cfg: Config, ramp_state, step: int, where: str) -> Ramp:
    """The batch of the next step must be the one the run would have used.

    A batch changed mid-run changes the training (and, were the schedule counted in the
    new batch, the learning rate), so it is refused unless a stage of train.batch_schedule
    sets it. The learning-rate position and the token budget stay the run's own either way
    (Ramp.load). A finished run is returned as it is: nothing is trained."""
    now, then = Ramp(cfg), Ramp(saved)
    now.load(ramp_state, step, saved.tokens_per_step)
    then.load(ramp_state, step, saved.tokens_per_step)
    if now.done or now.tokens_per_step == then.tokens_per_step:
        return now
    seq, t, m = cfg.model.seq_len, cfg.train, cfg.mesh
    was, new = then.tokens_per_step // seq, now.tokens_per_step // seq
    keep = "the run's train.batch_schedule"
    if now.stage == 0:
        keep = _same_batch(was, cfg, saved.dp)
    raise ConfigError(
        f"{where} trained with a global batch of {was} sequences; resuming it at step {step} "
        f"would use {new} ({t.micro_batch_size} micro-batch x {now.grad_accum} accum x "
        f"{cfg.dp} dp, dp = mesh.data {m.data} x mesh.fsdp {m.fsdp} x mesh.expert {m.expert} on "
        f"{jax.device_count()} devices): refused, a batch changed mid-run changes the "
        f"training. Keep {was} with {keep}; or train the new batch as a run of its own "
        "(train.run_dir=...)"
    )


def _same_batch(batch: int, cfg: Config, old_dp: int) -> str:
    """Settings outside the run's identity (the run directory stays) that give `batch`
    sequences per step on this mesh: accumulation first (it costs no memory)."""
    t, dp = cfg.train, cfg.dp
    ways = []
    accum, rest = divmod(batch, t.micro_batch_size * dp)
    if not rest:
        ways.append(f"train.grad_accum={accum}")
    mbs, rest = divmod(batch, t.grad_accum * dp)
    if not rest:
        ways.append(f"train.micro_batch_size={mbs}")
    if ways:
        return " or ".join(ways)
    return (
        f"the run's data-parallel size, mesh.data x mesh.fsdp x mesh.expert = {old_dp} "
        "(mesh.data=-1 takes it from the device count)"
    )


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


def check_schedule(
    saved: Config, cfg: Config, where: str, step: int, warn=print, position: float | None = None
) -> None:
    """A resume must not change the learning-rate schedule behind the user's back.

    Changing train.steps (or optim.schedule_steps) moves the end of a cosine or WSD
    schedule, so the learning rate jumps at the next step. Refused unless asked for with
    train.reschedule=true; the other way is to keep the old schedule's length. The
    schedule is read where the next step reads it, `position` (tokens trained / the first
    batch: the step count unless a batch ramp grew the batch)."""
    old, new = optim.schedule_steps(saved), optim.schedule_steps(cfg)
    if old == new or cfg.optim.schedule == "constant":
        return
    at = step if position is None else position
    before = float(optim.lr_schedule(saved)(at))
    after = float(optim.lr_schedule(cfg)(at))
    # the next step's, logged as step + 1 (records count the steps done)
    change = f"the learning rate of step {step + 1} goes from {before:.2e} to {after:.2e}"
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


def start(cfg: Config, state: dict, data, say=print, source=_PICK, checked: bool = False):
    """Open the run's checkpoints and pick where training starts: (Checkpoints, state, step).

    `source` is `resume_source(cfg)` (computed here if not given; checked: `check_resume`
    has checked it). `state` gives the
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
        path = source[0] / str(source[1])
        say(f"restoring {path}")  # a large state takes a while to read
        state, step = restore_train(path, cfg, target, data, warn=say, checked=checked)
        say(f"resumed from {source[0] / str(source[1])} at step {step}")
        return ck, state, step
    if cfg.checkpoint.init_from:
        shardings = jax.tree.map(lambda a: a.sharding, state["params"])
        _free(state["params"])
        state = dict(state, params=load_params(cfg.checkpoint.init_from, cfg.model, shardings, say))
        if diloco.active(cfg):  # every replica starts from the loaded parameters
            where = jax.tree.map(lambda a: a.sharding, state)
            state = jax.jit(functools.partial(diloco.restart, cfg), out_shardings=where)(state)
        say(
            f"no checkpoint in {ck.dir}: parameters loaded from {cfg.checkpoint.init_from} "
            "(optimizer state fresh)"
        )
    elif cfg.checkpoint.resume == "never":
        say(f"starting fresh at step 0 (checkpoint.resume=never); saving to {ck.dir}")
    else:
        say(f"starting fresh at step 0: no checkpoint found in {ck.dir}")
    return ck, state, 0
