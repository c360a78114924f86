"""Typed run configuration: dataclasses, YAML plus dotted overrides, validation.

Everything a run needs is checked here before JAX compiles anything, so a typo
costs a one-line error instead of a minute of tracing and a traceback.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A user-facing configuration problem: printed as one line, exit status 2."""


@dataclass
class ModelConfig:
    vocab_size: int = 384
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    d_ff: int = 384
    seq_len: int = 256
    head_dim: int | None = None  # None: d_model // n_heads (HF's head_dim)
    rope_theta: float = 10000.0
    # rotary frequency scaling, as transformers' rope_type: none, linear (every frequency
    # / rope_factor) or llama3 (Llama 3.1: low frequencies / rope_factor, high ones kept,
    # a smooth band between, set by the other three fields)
    rope_scaling: Literal["none", "linear", "llama3"] = "none"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0  # llama3: wavelengths > original / low are scaled
    rope_high_freq_factor: float = 4.0  # llama3: wavelengths < original / high are kept
    rope_original_max_len: int = 8192  # llama3: the pretraining context length
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    dtype: Literal["bfloat16", "float32", "float16"] = "bfloat16"
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    # none | full | selective | offload, or a list of checkpoint_name tags to keep
    remat: str | list[str] = "none"
    # auto: cuDNN (causal) or our Pallas kernel (packed documents) on a GPU; elsewhere tiled
    # up to 512 tokens and blocked beyond
    attention: Literal["auto", "xla", "cudnn", "pallas", "blocked", "tiled"] = "auto"
    # the Pallas flash kernel's tiles [q, k, q_bwd, k_bwd] (powers of two, >= 16; the
    # sequence is padded to their least common multiple); null: kernels/flash_attention.py's
    # BlockSizes defaults. Used where the kernel runs: pallas, auto on a GPU with packed
    # documents, and the ring's pairs under context parallelism
    attention_blocks: list[int] | None = None
    # LM head and loss over this many tokens of the sequence at a time (0: all at once)
    loss_chunk: int = 0
    # layers per iteration of the layer loop (lax.scan's unroll): 1 keeps one compiled
    # layer; more lets XLA slice the stacked weights statically (faster on a CPU)
    scan_unroll: int = 1

    @property
    def hd(self) -> int:
        return self.head_dim or self.d_model // self.n_heads


@dataclass
class MixtureSource:
    path: str = ""  # like data.path: files, or a prepared directory
    weight: float = 1.0  # share of rows (so of tokens), relative to the others


@dataclass
class DataConfig:
    source: Literal["stdlib", "files", "prepared"] = "stdlib"
    path: str | None = None  # files: a file, directory or glob; prepared: a directory
    tokenizer: str = "bytes"  # "bytes" or a path to a Hugging Face tokenizer.json
    cross_doc_mask: bool = False
    eval_fraction: float = 0.02
    mixture: list[MixtureSource] | None = None  # several paths with weights, instead of path
    streams: int | None = None  # logical streams; null: gcd(micro-batch rows, 64)
    shuffle_window: int = 16  # rows shuffled together after packing, per stream
    prefetch: int = 2  # batches made ahead on a background thread (0: on the step's thread)


@dataclass
class BatchStage:
    tokens_per_step: int = 0  # the global batch from this stage on, in tokens
    from_tokens: int | None = None  # switch once this many tokens are trained
    from_loss: float | None = None  # or once the smoothed training loss falls below this


@dataclass
class TrainConfig:
    steps: int = 300
    micro_batch_size: int = 8
    grad_accum: int = 1
    seed: int = 0
    log_every: int = 10
    eval_every: int = 100
    eval_batches: int = 4
    run_dir: str | None = None  # null: runs/<config name>-<hash of what defines the run>
    reschedule: bool = False  # resume with a changed train.steps: rebuild the lr schedule
    profile_steps: list[int] | None = None
    batch_schedule: list[BatchStage] | None = None  # a batch ramp: later, larger batches
    noise_every: int = 0  # measure the gradient noise scale every this many steps (0: off)


@dataclass
class OptimConfig:
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 30
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    decay_fraction: float = 0.2  # wsd: share of steps spent decaying at the end
    schedule_steps: int | None = None  # the steps the schedule spans; null: train.steps
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_norm: float = 1.0


@dataclass
class DcnConfig:
    """How many hosts (processes) each outer mesh axis spans: its factor over the slow
    data-centre network (DCN). The rest of the axis stays inside a host (ICI/NVLink)."""

    data: int = 1
    fsdp: int = 1
    pipeline: int = 1


@dataclass
class MeshConfig:
    data: int = 1
    fsdp: int = 1
    pipeline: int = 1
    sequence: int = 1
    tensor: int = 1
    dcn: DcnConfig = field(default_factory=DcnConfig)

    def sizes(self) -> dict[str, int]:
        """The five axis sizes (without the dcn factors)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "dcn"}


@dataclass
class ParallelConfig:
    zero: int = 0
    sequence_parallel: bool = False
    # who places the DP/ZeRO/TP collectives: XLA's partitioner or the explicit step
    collectives: Literal["explicit", "gspmd"] = "explicit"
    grad_reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    # context parallelism over mesh.sequence (parallel/context.py, docs/context.md)
    context: Literal["ring", "allgather"] = "ring"
    context_zigzag: bool = True  # balance causal attention work across the sequence axis
    # pipeline parallelism over mesh.pipeline (parallel/pipeline.py, docs/pipeline.md)
    pipeline_schedule: Literal["afab", "1f1b", "interleaved", "zb-h1"] = "1f1b"
    virtual_stages: int = 1  # model chunks per device (interleaved only)
    # GPU: overlap collectives with compute, bucket them up to these sizes (overlap.py)
    overlap: bool = True
    # GPU: let XLA pipeline a layer loop's collectives across iterations (overlap.py).
    # Off by default: not yet measured on several GPUs (see docs/parallelism.md).
    pipeline_collectives: bool = False
    all_reduce_bucket_mib: int = 64
    all_gather_bucket_mib: int = 64
    reduce_scatter_bucket_mib: int = 64


@dataclass
class CheckpointConfig:
    dir: str | None = None
    every: int = 0
    keep: int = 3
    resume: str = "auto"  # auto | never | must | a checkpoint path
    init_from: str | None = None  # a checkpoint to load parameters only from (fine-tuning)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    @property
    def dp(self) -> int:
        """Data-parallel degree: the batch is split over data x fsdp."""
        return self.mesh.data * self.mesh.fsdp

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step: mbs x grad_accum x dp."""
        return self.train.micro_batch_size * self.train.grad_accum * self.dp

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.model.seq_len


REMAT_POLICIES = ("none", "full", "selective", "offload")
REMAT_NAMES = ("query", "key", "value", "attn_out", "mlp_in", "mlp_out")


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


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):  # sections, and nested sections like mesh.dcn
            out.update(_flatten(v, f"{key}."))
        else:
            out[key] = v
    return out


def load(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """Read YAML (or start from defaults), apply `section.key=value` overrides, validate."""
    cfg = Config()
    if path is not None:
        path = Path(path)
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
        for key, value in _flatten(tree).items():
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
HOW = ("attention", "attention_blocks", "remat", "loss_chunk", "scan_unroll")


def run_identity(cfg: Config) -> str:
    """Six hex digits naming what a run is: the model, the data, the optimizer, the seed.

    Not the layout, the batch split, train.steps or logging: those may change on resume
    (a checkpoint restores onto any layout; more steps are asked for on purpose). Nor how
    the step computes the same model (attention backend, recomputation, loss chunks, layer
    loop unrolling): a run may resume with another."""
    tree = {k: dataclasses.asdict(getattr(cfg, k)) for k in IDENTITY}
    for how in HOW:
        tree["model"].pop(how)
    tree["seed"] = cfg.train.seed
    tree["optim"].pop("schedule_steps")  # checked on resume, like train.steps
    tree["data"].pop("prefetch")  # how far ahead batches are made, not which
    text = json.dumps(tree, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:6]


def default_run_dir(cfg: Config, path: str | Path | None) -> str:
    """runs/<config file name>-<run_identity>: the same command finds its own run again
    (a requeued job resumes), a changed shape gets a directory of its own."""
    name = Path(path).stem if path is not None else "default"
    return f"runs/{name}-{run_identity(cfg)}"


# --------------------------------------------------------------------------- validation


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


def validate(cfg: Config) -> None:
    """Every consistency rule a run depends on, each with a message saying what to change."""
    m, t, o, d = cfg.model, cfg.train, cfg.optim, cfg.data
    for key in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "seq_len"):
        _check(getattr(m, key) > 0, f"model.{key} must be positive, got {getattr(m, key)}")
    _check(
        m.head_dim is not None or m.d_model % m.n_heads == 0,
        f"model.d_model ({m.d_model}) must be divisible by model.n_heads ({m.n_heads}),"
        " or set model.head_dim",
    )
    _check(m.head_dim is None or m.head_dim > 0, "model.head_dim must be positive")
    _check(
        m.hd % 2 == 0,
        f"head dimension {m.hd} (model.d_model / model.n_heads) must be even for rotary "
        "embeddings: change model.d_model or model.n_heads, or set an even model.head_dim",
    )
    _check(
        m.n_heads % m.n_kv_heads == 0,
        f"model.n_heads ({m.n_heads}) must be divisible by model.n_kv_heads ({m.n_kv_heads})",
    )
    _check(m.rope_theta > 0, "model.rope_theta must be positive")
    if m.rope_scaling != "none":
        _check(m.rope_factor > 0, f"model.rope_factor must be positive, got {m.rope_factor}")
    if m.rope_scaling == "llama3":
        _check(
            0 < m.rope_low_freq_factor < m.rope_high_freq_factor,
            "model.rope_low_freq_factor must be positive and smaller than "
            f"model.rope_high_freq_factor (got {m.rope_low_freq_factor} and "
            f"{m.rope_high_freq_factor})",
        )
        _check(
            m.rope_original_max_len > 0,
            f"model.rope_original_max_len must be positive, got {m.rope_original_max_len}",
        )
    _check(
        m.loss_chunk >= 0 and (m.loss_chunk == 0 or m.seq_len % m.loss_chunk == 0),
        f"model.loss_chunk ({m.loss_chunk}) must be 0 (off) or divide model.seq_len ({m.seq_len})",
    )
    _check(m.norm_eps > 0, "model.norm_eps must be positive")
    _check(m.scan_unroll >= 1, f"model.scan_unroll must be >= 1, got {m.scan_unroll}")
    if m.attention_blocks is not None:
        _check(
            len(m.attention_blocks) == 4
            and all(b >= 16 and b & (b - 1) == 0 for b in m.attention_blocks),
            f"model.attention_blocks must be four powers of two >= 16 [q, k, q_bwd, k_bwd], "
            f"got {m.attention_blocks}",
        )
    remat = [m.remat] if isinstance(m.remat, str) else m.remat
    if isinstance(m.remat, str):
        _check(
            m.remat in REMAT_POLICIES,
            f"model.remat: {m.remat!r} is not one of {', '.join(REMAT_POLICIES)} "
            f"or a list of names from {', '.join(REMAT_NAMES)}",
        )
    else:
        for name in remat:
            _check(
                name in REMAT_NAMES,
                f"model.remat: {name!r} is not a checkpoint name; use {', '.join(REMAT_NAMES)}",
            )
    _check(
        d.path is None or d.source != "stdlib",
        f"data.path ({d.path}) is set but data.source is {d.source}, which ignores it: add "
        "data.source=files (text) or data.source=prepared (a directory made by "
        "`python -m ultrajax.data prepare`) to train on it, or drop it (data.path=)",
    )
    for key in ("steps", "micro_batch_size", "grad_accum", "log_every", "eval_every"):
        _check(getattr(t, key) > 0, f"train.{key} must be positive, got {getattr(t, key)}")
    _check(t.eval_batches >= 0, "train.eval_batches must be >= 0")
    if t.profile_steps is not None:
        _check(
            len(t.profile_steps) == 2 and 0 <= t.profile_steps[0] <= t.profile_steps[1],
            "train.profile_steps must be [first, last] with 0 <= first <= last",
        )
    _check(0.0 <= d.eval_fraction < 1.0, "data.eval_fraction must be in [0, 1)")
    if d.mixture:
        _check(
            d.source in ("files", "prepared") and d.path is None,
            "data.mixture replaces data.path and needs data.source=files or prepared",
        )
        for i, m in enumerate(d.mixture):
            _check(bool(m.path), f"data.mixture[{i}].path is empty")
            _check(m.weight > 0, f"data.mixture[{i}].weight must be positive, got {m.weight}")
    else:
        _check(
            d.source == "stdlib" or bool(d.path),
            f"data.path is required when data.source is {d.source} "
            + ("(a file, directory or glob)" if d.source == "files" else "(a prepared directory)"),
        )
    _check(d.streams is None or d.streams >= 1, "data.streams must be >= 1 or null")
    _check(d.shuffle_window >= 0, "data.shuffle_window must be >= 0 (0 or 1: off)")
    _check(d.prefetch >= 0, "data.prefetch must be >= 0 (0: no background thread)")
    _check(o.lr > 0, "optim.lr must be positive")
    _check(0 <= o.min_lr <= o.lr, "optim.min_lr must be between 0 and optim.lr")
    _check(o.warmup_steps >= 0, "optim.warmup_steps must be >= 0")
    _check(
        o.warmup_steps < t.steps,
        f"optim.warmup_steps ({o.warmup_steps}) must be smaller than train.steps ({t.steps})",
    )
    _check(0.0 < o.decay_fraction <= 1.0, "optim.decay_fraction must be in (0, 1]")
    _check(
        o.schedule_steps is None or o.schedule_steps > o.warmup_steps,
        f"optim.schedule_steps ({o.schedule_steps}) must be larger than optim.warmup_steps "
        f"({o.warmup_steps}), or null (the schedule spans train.steps)",
    )
    _check(o.weight_decay >= 0, "optim.weight_decay must be >= 0")
    _check(0 <= o.b1 < 1 and 0 <= o.b2 < 1, "optim.b1 and optim.b2 must be in [0, 1)")
    _check(o.clip_norm >= 0, "optim.clip_norm must be >= 0 (0 disables clipping)")
    sizes = cfg.mesh.sizes()
    fills = [k for k, v in sizes.items() if v == -1]
    _check(len(fills) <= 1, f"only one mesh size may be -1 (fill); got {', '.join(fills)}")
    for k, v in sizes.items():
        _check(v == -1 or v >= 1, f"mesh.{k} must be >= 1 or -1 (fill), got {v}")
    for k, v in dataclasses.asdict(cfg.mesh.dcn).items():
        _check(v >= 1, f"mesh.dcn.{k} must be >= 1 (the number of hosts mesh.{k} spans), got {v}")
    _check(cfg.parallel.zero in (0, 1, 2, 3), "parallel.zero must be 0, 1, 2 or 3")
    for key in ("all_reduce_bucket_mib", "all_gather_bucket_mib", "reduce_scatter_bucket_mib"):
        _check(getattr(cfg.parallel, key) >= 0, f"parallel.{key} must be >= 0")
    if cfg.checkpoint.resume == "none":  # the name before `never`
        cfg.checkpoint.resume = "never"
    _check(bool(cfg.checkpoint.resume), "checkpoint.resume must be auto, never, must or a path")
    _check(cfg.checkpoint.keep >= 1, "checkpoint.keep must be >= 1")
    _check(cfg.checkpoint.every >= 0, "checkpoint.every must be >= 0 (0: only at the end)")
    validate_layout(cfg)


def validate_layout(cfg: Config) -> None:
    """Divisibility rules of the mesh; needs concrete mesh sizes (no -1 left)."""
    mesh = cfg.mesh
    if -1 in mesh.sizes().values():
        return  # checked again once the device count has resolved the fill
    for k, f in dataclasses.asdict(mesh.dcn).items():
        _check(
            getattr(mesh, k) % f == 0,
            f"mesh.dcn.{k} ({f}) must divide mesh.{k} ({getattr(mesh, k)}): it is the part "
            f"of mesh.{k} that spans hosts",
        )
    m = cfg.model
    tp = mesh.tensor
    for key in ("n_heads", "n_kv_heads", "d_ff", "vocab_size"):
        value = getattr(m, key)
        _check(
            value % tp == 0,
            f"model.{key} ({value}) must be divisible by mesh.tensor ({tp})",
        )
    if cfg.parallel.zero > 0:
        _check(
            m.d_model % mesh.fsdp == 0,
            f"model.d_model ({m.d_model}) must be divisible by mesh.fsdp ({mesh.fsdp}) for ZeRO",
        )
    if cfg.parallel.sequence_parallel:
        _check(
            m.seq_len % (tp * mesh.sequence) == 0,
            f"model.seq_len ({m.seq_len}) must be divisible by mesh.tensor x mesh.sequence "
            f"({tp * mesh.sequence}) for sequence parallelism",
        )
    cp = mesh.sequence
    if cp > 1:
        _check(
            m.seq_len % (2 * cp) == 0,
            f"model.seq_len ({m.seq_len}) must be divisible by 2 x mesh.sequence ({2 * cp}): "
            "context parallelism cuts each sequence into 2 chunks per device",
        )
        _check(
            m.loss_chunk == 0 or (m.seq_len // cp) % m.loss_chunk == 0,
            f"model.loss_chunk ({m.loss_chunk}) must divide the tokens per device along the "
            f"sequence (model.seq_len / mesh.sequence = {m.seq_len // cp})",
        )
    _validate_pipeline(cfg)
    _validate_ramp(cfg)


def _validate_ramp(cfg: Config) -> None:
    """Each stage's batch in whole micro-batches (the micro-batch and the mesh stay, so
    memory does not change); triggers in an order that can happen."""
    t = cfg.train
    _check(t.noise_every >= 0, "train.noise_every must be >= 0 (0: off)")
    if t.noise_every and cfg.mesh.pipeline > 1:
        raise ConfigError(
            "train.noise_every needs mesh.pipeline=1 (it measures micro-batches alone)"
        )
    if not t.batch_schedule:
        return
    _check(
        cfg.mesh.pipeline == 1,
        "train.batch_schedule needs mesh.pipeline=1 (a pipeline schedule is built for one "
        "number of micro-batches)",
    )
    unit = t.micro_batch_size * cfg.dp * cfg.model.seq_len
    last_tokens, last_loss = 0, math.inf
    for i, stage in enumerate(t.batch_schedule):
        where = f"train.batch_schedule[{i}]"
        _check(
            stage.tokens_per_step > 0 and stage.tokens_per_step % unit == 0,
            f"{where}.tokens_per_step ({stage.tokens_per_step}) must be a positive multiple of "
            f"micro_batch_size x dp x seq_len = {t.micro_batch_size} x {cfg.dp} x "
            f"{cfg.model.seq_len} = {unit} tokens (the batch grows by gradient accumulation)",
        )
        _check(
            (stage.from_tokens is None) != (stage.from_loss is None),
            f"{where} needs exactly one of from_tokens or from_loss",
        )
        if stage.from_tokens is not None:
            _check(
                stage.from_tokens > last_tokens,
                f"{where}.from_tokens ({stage.from_tokens}) must be after the previous "
                f"stage's ({last_tokens})",
            )
            last_tokens = stage.from_tokens
        else:
            _check(
                0 < stage.from_loss < last_loss,
                f"{where}.from_loss ({stage.from_loss}) must be positive and below the "
                "previous stage's",
            )
            last_loss = stage.from_loss


def _validate_pipeline(cfg: Config) -> None:
    """mesh.pipeline > 1: the stages, the schedule and what composes with them."""
    from ultrajax.parallel import schedule

    p, par = cfg.mesh.pipeline, cfg.parallel
    v = par.virtual_stages
    _check(v >= 1, f"parallel.virtual_stages must be >= 1, got {v}")
    _check(
        v == 1 or par.pipeline_schedule == "interleaved",
        f"parallel.virtual_stages={v} needs parallel.pipeline_schedule=interleaved "
        f"(got {par.pipeline_schedule})",
    )
    if p == 1:
        return
    n = cfg.model.n_layers
    _check(
        n % (p * v) == 0,
        f"model.n_layers ({n}) must be divisible by mesh.pipeline x parallel.virtual_stages "
        f"({p} x {v}): every stage holds the same number of layers",
    )
    _check(
        cfg.mesh.sequence == 1,
        "mesh.pipeline > 1 with mesh.sequence > 1: pipeline and context parallelism do not "
        "compose yet; use one of them",
    )
    _check(
        not (par.zero == 3 and cfg.mesh.fsdp > 1),
        "parallel.zero=3 with mesh.pipeline > 1: ZeRO-3 would all-gather every stage's "
        "weights again at every micro-batch tick; use parallel.zero=1 or 2 (docs/pipeline.md)",
    )
    try:
        schedule.build(par.pipeline_schedule, p, cfg.train.grad_accum, v)
    except ValueError as e:
        raise ConfigError(f"parallel.pipeline_schedule={par.pipeline_schedule}: {e}") from None


def no_effect(cfg: Config) -> list[str]:
    """Settings that do nothing in this layout, one line each saying what to change:
    valid, so not errors (a recipe may be meant for a larger mesh), but worth a warning."""
    mesh, par = cfg.mesh, cfg.parallel
    out = []
    if par.zero > 0 and mesh.fsdp == 1:
        out.append(
            f"parallel.zero={par.zero} has no effect with mesh.fsdp=1 (ZeRO shards over "
            "fsdp): set mesh.fsdp > 1, or parallel.zero=0"
        )
    if par.sequence_parallel and mesh.tensor == 1:
        out.append(
            "parallel.sequence_parallel=true has no effect with mesh.tensor=1 (it splits "
            "the sequence over tensor): set mesh.tensor > 1, or drop it"
        )
    if cfg.data.source == "prepared" and cfg.data.tokenizer != "bytes":
        out.append(
            f"data.tokenizer={cfg.data.tokenizer} has no effect with data.source=prepared (the "
            "directory's manifest names its tokenizer): drop it"
        )
    t = cfg.train
    if t.noise_every and t.grad_accum == 1 and not t.batch_schedule:
        out.append(
            f"train.noise_every={t.noise_every} has no effect with train.grad_accum=1 (the noise "
            "scale compares one micro-batch's gradient with the step's): set "
            "train.grad_accum >= 2, or drop it"
        )
    m = cfg.model
    if m.attention_blocks is not None and m.attention in ("xla", "blocked", "tiled"):
        out.append(
            f"model.attention_blocks has no effect with model.attention={m.attention} (they "
            "are the Pallas kernel's tiles): use model.attention=pallas, or drop them"
        )
    default = ParallelConfig()
    axis_keys = {
        "pipeline": ("pipeline_schedule", "virtual_stages"),
        "sequence": ("context", "context_zigzag"),
    }
    for axis, keys in axis_keys.items():
        if getattr(mesh, axis) != 1:
            continue
        for key in keys:
            if getattr(par, key) != getattr(default, key):
                out.append(
                    f"parallel.{key}={getattr(par, key)} has no effect with mesh.{axis}=1: "
                    f"set mesh.{axis} > 1, or drop it"
                )
    return out


def resolve_mesh(cfg: Config, n_devices: int) -> None:
    """Fill a -1 mesh size from the device count and check the product."""
    sizes = cfg.mesh.sizes()
    known = 1
    for v in sizes.values():
        if v != -1:
            known *= v
    for k, v in sizes.items():
        if v == -1:
            _check(
                n_devices % known == 0,
                f"mesh.{k}=-1: {n_devices} device(s) are not divisible by the other mesh sizes "
                f"({known}); run on {known} x N devices (on a CPU: --cpu-devices {known}), or "
                "change the mesh sizes",
            )
            setattr(cfg.mesh, k, n_devices // known)
    product = 1
    for v in cfg.mesh.sizes().values():
        product *= v
    _check(
        product == n_devices,
        f"mesh sizes {cfg.mesh.sizes()} multiply to {product}, but there are "
        f"{n_devices} devices; change the sizes or set one to -1",
    )
    validate_layout(cfg)


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
