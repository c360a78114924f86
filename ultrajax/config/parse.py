"""YAML plus dotted overrides -> a typed, validated Config, and back; the run's
identity and default directory."""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from ultrajax.config.schema import Config, ConfigError
from ultrajax.config.validate import validate

# --------------------------------------------------------------------------- parsing


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Convert a YAML/override value to the annotated type, or raise ConfigError."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arm in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arm, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[-1])
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(str, args))}")
        return value
    if origin is list:
        if isinstance(value, str):
            raise ConfigError(f"{key}: expected a list like [a, b], got {value!r}")
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)  # YAML reads 3e-4 as a string
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    if dataclasses.is_dataclass(tp):  # a nested section, e.g. mesh.dcn
        if isinstance(value, tp):
            return value
        hints = typing.get_type_hints(tp)
        if not isinstance(value, dict):
            keys = ", ".join(f"{key}.{k}" for k in hints)
            raise ConfigError(f"{key} is a section; set its keys: {keys}")
        obj = tp()
        for k, v in value.items():
            if k not in hints:
                raise _unknown(f"{key}.{k}", list(hints))
            setattr(obj, k, _coerce(v, hints[k], f"{key}.{k}"))
        return obj
    raise ConfigError(f"{key}: unsupported type {tp}")  # pragma: no cover


def _unknown(key: str, choices: list[str]) -> ConfigError:
    close = difflib.get_close_matches(key.rsplit(".", 1)[-1], choices, n=1)
    prefix = key.rsplit(".", 1)[0] + "." if "." in key else ""
    hint = f"; did you mean {prefix}{close[0]}?" if close else f"; known: {', '.join(choices)}"
    name = key.rsplit(".", 1)[-1]
    if ":" in name and name.split(":", 1)[0] in choices:  # YAML's `{path:x}` is one key
        hint = f"; YAML reads {name!r} as one key: write {name.replace(':', ': ', 1)!r}"
    return ConfigError(f"unknown config key {key!r}{hint}")


def _set(cfg: Config, key: str, value: Any) -> None:
    """Set `section.name`, or `section.sub.name` in a nested section such as mesh.dcn."""
    parts = key.split(".")
    if len(parts) < 2:
        raise ConfigError(f"config key {key!r} must look like section.name, e.g. train.steps")
    obj = cfg
    for i, part in enumerate(parts):
        here = ".".join(parts[: i + 1])
        hints = typing.get_type_hints(type(obj))
        if part not in hints:
            raise _unknown(here, list(hints))
        if i == len(parts) - 1:
            setattr(obj, part, _coerce(value, hints[part], key))
        elif not dataclasses.is_dataclass(hints[part]):
            raise ConfigError(f"config key {key!r}: {here} is a value, not a section")
        else:
            obj = getattr(obj, part)


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):  # sections, and nested sections like mesh.dcn
            out.update(flatten(v, f"{key}."))
        else:
            out[key] = v
    return out


def load(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """Read YAML (or start from defaults), apply `section.key=value` overrides, validate."""
    cfg = Config()
    if path is not None:
        given, path = str(path), Path(path)
        if path.is_dir():
            found = sorted(str(p) for p in path.iterdir() if p.suffix in (".yaml", ".yml"))
            shown = ", ".join(found[:8]) + (", ..." if len(found) > 8 else "")
            raise ConfigError(
                f"config file {given!r} is a directory; give one of its YAML files: {shown}"
                if found
                else f"config file {given!r} is a directory, and holds no .yaml files"
            )
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        try:
            tree = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            reason = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise ConfigError(
                f"config file {str(path)!r}{where}: not valid YAML ({reason})"
            ) from None
        if not isinstance(tree, dict):
            raise ConfigError(f"config file {str(path)!r}: expected sections like 'model:'")
        for key, value in flatten(tree).items():
            if "." not in key:
                raise ConfigError(f"config file {str(path)!r}: {key!r} must be a section")
            _set(cfg, key, value)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw != "" else None
        except yaml.YAMLError:
            value = raw
        _set(cfg, key.strip(), value)
    validate(cfg)
    if cfg.train.run_dir is None:
        cfg.train.run_dir = default_run_dir(cfg, path)
    return cfg


IDENTITY = ("model", "data", "optim")  # with train.seed: what makes two runs the same run


# model keys outside the identity
HOW = (
    "attention",
    "attention_blocks",
    "attention_backward",
    "remat",
    "loss_chunk",
    "scan_unroll",
    "scan_layers",
    "moe_grouped",
)


def run_identity(cfg: Config) -> str:
    """Six hex digits naming what a run is: the model, the data, the optimizer, the seed
    (and DiLoCo's settings, which change what is trained).

    Not the layout, the batch split, train.steps or logging: those may change on resume
    (a checkpoint restores onto any layout; more steps are asked for on purpose). Nor how
    the step computes the same model (attention backend, recomputation, loss chunks, the
    layer loop and its unrolling): a run may resume with another."""
    text = json.dumps(_identity(cfg), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:6]


def identity_changes(old: Config, new: Config) -> list[tuple[str, Any, Any]]:
    """(key, old value, new value) of each setting of the run's identity that differs: what
    a resume would change about the run (train/resume.py)."""
    a, b = flatten(_identity(old)), flatten(_identity(new))
    named = {"seed": "train.seed", "diloco.replicas": "mesh.data"}
    out = []
    for key in sorted(a.keys() | b.keys()):
        if a.get(key) != b.get(key):
            name = named.get(key, key.replace("diloco.", "parallel.", 1))
            out.append((name, _get(old, name), _get(new, name)))
    return out


def _get(cfg: Config, key: str) -> Any:
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _identity(cfg: Config) -> dict:
    """The settings `run_identity` hashes, as a tree of sections."""
    tree = {k: dataclasses.asdict(getattr(cfg, k)) for k in IDENTITY}
    for how in HOW:
        tree["model"].pop(how)
    # keys added since runs existed, at the value that means the model they had, stay
    # out: a run from before keeps its identity (and its directory)
    if not cfg.model.moe_experts:  # a dense model: the MoE keys mean nothing
        for key in [k for k in tree["model"] if k.startswith("moe_")]:
            tree["model"].pop(key)
    if not cfg.model.qk_norm:
        tree["model"].pop("qk_norm")
    if cfg.model.fp8 == "none":
        tree["model"].pop("fp8")
    if cfg.model.fp8 != "delayed":
        tree["model"].pop("fp8_history")
    if cfg.model.fp8_layers is None:
        tree["model"].pop("fp8_layers")
    if cfg.optim.name == "adamw":
        tree["optim"].pop("name")
    par = cfg.parallel
    if par.diloco_steps:  # DiLoCo trains another way: its replicas (mesh.data) and outer step
        keys = ("diloco_steps", "diloco_outer_lr", "diloco_outer_momentum", "diloco_dtype")
        keys += ("diloco_fragments",)
        tree["diloco"] = {k: getattr(par, k) for k in keys} | {"replicas": cfg.mesh.data}
    tree["seed"] = cfg.train.seed
    tree["optim"].pop("schedule_steps")  # checked on resume, like train.steps
    tree["data"].pop("prefetch")  # how far ahead batches are made, not which
    tree["data"].pop("strict")  # the same documents, or no run at all
    return tree


def default_run_dir(cfg: Config, path: str | Path | None) -> str:
    """runs/<config file name>-<run_identity>: the same command finds its own run again
    (a requeued job resumes), a changed shape gets a directory of its own."""
    name = Path(path).stem if path is not None else "default"
    return f"runs/{name}-{run_identity(cfg)}"


def keys_help() -> str:
    """Every config key with its default, a section per line group (the commands' --help;
    the README's configuration reference says what each one means)."""
    lines = []

    def walk(obj, prefix):
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                walk(value, f"{prefix}{f.name}.")
            else:
                shown = yaml.safe_dump(value).strip().removesuffix("...").strip()
                lines.append(f"  {prefix}{f.name}={shown}")

    for section in dataclasses.fields(Config):
        walk(getattr(Config(), section.name), f"{section.name}.")
    return "config keys and their defaults (set any as section.key=value):\n" + "\n".join(lines)


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def dump(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
