"""Every consistency rule a run depends on, checked before anything compiles, each
failure one line saying what to change."""

from __future__ import annotations

import dataclasses
import math

from ultrajax.config.schema import Config, ConfigError
from ultrajax.model import fp8, llama, remat
from ultrajax.model.attention import backends as attention
from ultrajax.parallel.pipeline import schedules as schedule

# model.loss_chunk=null (auto) chunks the LM head and loss only where the fp32 logits of one
# micro-batch on one device (b x s/cp x v/tp x 4 bytes; the loss's working set holds about
# two such arrays, cost/memory.py) pass LOSS_CHUNK_AUTO_BYTES. Chunks recompute nothing
# (model/loss.py makes their gradients in the forward pass; the 1B step on an H200 is as
# fast chunked as whole), but they hold the head's whole fp32 gradient from the forward
# pass on and run smaller matmuls: worth it where the logits are large. tiny.yaml's
# logits are 3 MiB; the 1B shape's (v = 128256, s = 2048, b = 8) 7.8 GiB.
LOSS_CHUNK_AUTO_BYTES = 2**30
# The chunk: the largest divisor of the tokens per device up to LOSS_CHUNK_MAX whose own
# logits fit LOSS_CHUNK_AUTO_BYTES too (the 1B shape: 256 tokens, 1 GiB; halves of 1024
# would leave 4 GiB a chunk, and the head's backward the step's peak); b x 128 rows or more
# keep the head's matmul large enough for a GPU's full rate. Below LOSS_CHUNK_MIN the trips
# would cost more than the memory saves: the smallest divisor from there, or whole.
LOSS_CHUNK_MAX, LOSS_CHUNK_MIN = 1024, 128

# --------------------------------------------------------------------------- validation


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


SEEDS = 2**32  # seeds JAX's default key tells apart (it keeps 32 bits)


def validate(cfg: Config) -> None:
    """Every consistency rule a run depends on, each with a message saying what to change."""
    _validate_names(cfg)
    _validate_model(cfg.model)
    _validate_data(cfg.data)
    _validate_training(cfg.train, cfg.optim)
    _validate_mesh(cfg)
    _validate_checkpoint(cfg)
    validate_layout(cfg)


def _one_of(key: str, value, choices) -> None:
    _check(value in choices, f"{key}: {value!r} is not one of {', '.join(choices)}")


def _validate_names(cfg: Config) -> None:
    """Names the layers' own tables define: attention backends, pipeline schedules."""
    _one_of("model.attention", cfg.model.attention, attention.CHOICES)
    _one_of("parallel.pipeline_schedule", cfg.parallel.pipeline_schedule, schedule.NAMES)


def _validate_fp8(m) -> None:
    """model.fp8's companions: each applies to a recipe, so none is set for nothing."""
    _check(m.fp8_history >= 1, f"model.fp8_history must be >= 1, got {m.fp8_history}")
    _check(
        m.fp8 == "delayed" or m.fp8_history == 16,
        f"model.fp8_history={m.fp8_history} applies to model.fp8=delayed (got "
        f"model.fp8={m.fp8}): set model.fp8=delayed or drop model.fp8_history",
    )
    if m.fp8_layers is None:
        return
    _check(
        m.fp8 != "none",
        "model.fp8_layers chooses which matmuls take FP8 operands, but model.fp8=none: "
        "set model.fp8 (tensorwise, rowwise or delayed) or drop model.fp8_layers",
    )
    unknown = [k for k in m.fp8_layers if k not in fp8.WEIGHTS]
    _check(
        bool(m.fp8_layers) and not unknown,
        f"model.fp8_layers: {unknown or 'an empty list'} is not a list of weights from "
        f"{', '.join(fp8.WEIGHTS)} (for none, set model.fp8=none)",
    )
    has = {p.key for p in llama.params_of(m)}
    absent = [k for k in m.fp8_layers if k not in has]
    _check(  # they ran in bf16 without a word
        not absent,
        f"model.fp8_layers: {', '.join(absent)} {'is' if len(absent) == 1 else 'are'} not in "
        "this model (an MoE layer in every layer has no dense MLP; its experts' matmuls do "
        "not take FP8): drop them",
    )


def _validate_model(m) -> None:
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
        m.loss_chunk is None
        or (m.loss_chunk >= 0 and (m.loss_chunk == 0 or m.seq_len % m.loss_chunk == 0)),
        f"model.loss_chunk ({m.loss_chunk}) must be 0 (off), null (auto) or divide "
        f"model.seq_len ({m.seq_len})",
    )
    _check(m.norm_eps > 0, "model.norm_eps must be positive")
    _check(m.scan_unroll >= 1, f"model.scan_unroll must be >= 1, got {m.scan_unroll}")
    _check(
        not (m.remat == "offload" and not m.scan_layers),
        "model.remat=offload with model.scan_layers=false: compiled for an H200, XLA then "
        "moves 1.75 of the 11.5 GiB the 1B step offloads under the scan and keeps the rest "
        "on the device (a 30.6 GiB peak against the scan's 22.7, docs/memory.md); keep "
        "model.scan_layers=true, or use selective",
    )
    _validate_fp8(m)
    if m.attention_blocks is not None:
        _check(
            len(m.attention_blocks) == 4
            and all(b >= 16 and b & (b - 1) == 0 for b in m.attention_blocks),
            f"model.attention_blocks must be four powers of two >= 16 [q, k, q_bwd, k_bwd], "
            f"got {m.attention_blocks}",
        )
    if m.moe_experts:
        _validate_moe(m)
    if isinstance(m.remat, str):
        _check(
            m.remat in remat.POLICIES,
            f"model.remat: {m.remat!r} is not one of {', '.join(remat.POLICIES)} "
            f"or a list of names from {', '.join(remat.TAGS)}",
        )
    else:
        for name in m.remat:
            _check(
                name in remat.TAGS,
                f"model.remat: {name!r} is not a checkpoint name; use {', '.join(remat.TAGS)}",
            )


def _validate_moe(m) -> None:
    _check(m.moe_experts >= 2, f"model.moe_experts must be 0 (dense) or >= 2, got {m.moe_experts}")
    _check(
        1 <= m.moe_top_k <= m.moe_experts,
        f"model.moe_top_k must be between 1 and model.moe_experts ({m.moe_experts}), "
        f"got {m.moe_top_k}",
    )
    _check(m.moe_d_ff is None or m.moe_d_ff > 0, "model.moe_d_ff must be positive or null")
    _check(m.moe_shared_experts >= 0, "model.moe_shared_experts must be >= 0")
    _check(
        m.moe_every >= 1 and m.n_layers % m.moe_every == 0,
        f"model.moe_every ({m.moe_every}) must be >= 1 and divide model.n_layers "
        f"({m.n_layers}): every moe_every-th layer is an MoE layer, the others dense",
    )
    _check(m.moe_aux_coef >= 0, "model.moe_aux_coef must be >= 0")
    _check(m.moe_bias_rate >= 0, "model.moe_bias_rate must be >= 0")
    _check(m.moe_z_coef >= 0, "model.moe_z_coef must be >= 0")
    _check(
        m.moe_capacity == 0 or m.moe_capacity >= 1,
        f"model.moe_capacity must be 0 (dropless) or a factor >= 1, got {m.moe_capacity}",
    )


def _validate_data(d) -> None:
    _check(
        d.path is None or d.source != "stdlib",
        f"data.path ({d.path}) is set but data.source is {d.source}, which ignores it: add "
        "data.source=files (text) or data.source=prepared (a directory made by "
        "`python -m ultrajax.data prepare`) to train on it, or drop it (data.path=)",
    )
    _check(0.0 <= d.eval_fraction < 1.0, "data.eval_fraction must be in [0, 1)")
    if d.mixture:
        _check(
            d.source in ("files", "prepared") and d.path is None,
            "data.mixture replaces data.path and needs data.source=files or prepared",
        )
        for i, m in enumerate(d.mixture):
            _check(bool(m.path), f"data.mixture[{i}].path is empty")
            _check(
                0 < m.weight < math.inf,
                f"data.mixture[{i}].weight must be positive and finite, got {m.weight}",
            )
    else:
        _check(
            d.source == "stdlib" or bool(d.path),
            f"data.path is required when data.source is {d.source} "
            + ("(a file, directory or glob)" if d.source == "files" else "(a prepared directory)"),
        )
    _check(d.streams is None or d.streams >= 1, "data.streams must be >= 1 or null")
    _check(d.shuffle_window >= 0, "data.shuffle_window must be >= 0 (0 or 1: off)")
    _check(d.prefetch >= 0, "data.prefetch must be >= 0 (0: no background thread)")


def _validate_training(t, o) -> None:
    for key in ("steps", "micro_batch_size", "grad_accum", "log_every", "eval_every"):
        _check(getattr(t, key) > 0, f"train.{key} must be positive, got {getattr(t, key)}")
    _check(t.eval_batches >= 0, "train.eval_batches must be >= 0")
    _check(
        0 <= t.seed < SEEDS,
        f"train.seed must be in 0..{SEEDS - 1} (JAX's key keeps 32 bits: {t.seed} would be "
        f"seed {t.seed % SEEDS}'s initialisation)",
    )
    if t.profile_steps is not None:
        _check(
            len(t.profile_steps) == 2 and 0 <= t.profile_steps[0] <= t.profile_steps[1],
            "train.profile_steps must be [first, last] with 0 <= first <= last",
        )
        _check(
            t.profile_steps[1] < t.steps,
            f"train.profile_steps {list(t.profile_steps)} ends after the run's last step "
            f"(steps are numbered from 0: train.steps={t.steps} ends at {t.steps - 1}), so "
            "the trace would never be written",
        )
    _check(0 < o.lr < math.inf, f"optim.lr must be positive and finite, got {o.lr}")
    _check(
        o.schedule == "constant" or 0 <= o.min_lr <= o.lr,
        "optim.min_lr must be between 0 and optim.lr",
    )
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


def _validate_mesh(cfg: Config) -> None:
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


def _validate_checkpoint(cfg: Config) -> None:
    if cfg.checkpoint.resume == "none":  # the name before `never`
        cfg.checkpoint.resume = "never"
    _check(bool(cfg.checkpoint.resume), "checkpoint.resume must be auto, never, must or a path")
    _check(cfg.checkpoint.keep >= 1, "checkpoint.keep must be >= 1")
    _check(cfg.checkpoint.every >= 0, "checkpoint.every must be >= 0 (0: only at the end)")


def validate_layout(cfg: Config, *, build_schedule: bool = True) -> None:
    """Divisibility rules of the mesh; needs concrete mesh sizes (no -1 left). Resolves
    model.loss_chunk=null (auto) to an int here, the first point that knows the mesh.

    build_schedule=False leaves out the one slow rule, the pipeline schedule's own
    (validate_schedule builds its table, seconds for thousands of micro-batches): the
    planner asks it once per schedule instead of once per layout."""
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
    if m.loss_chunk is None:
        m.loss_chunk = auto_loss_chunk(cfg)
    tp = mesh.tensor
    keys = ("n_heads", "n_kv_heads", "d_ff", "vocab_size") + (
        ("moe_d_ff",) if m.moe and m.moe_d_ff else ()
    )
    for key in keys:  # an expert's hidden size is split over tensor too (mesh.rules moe_mlp)
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
    if m.moe_experts or mesh.expert > 1:
        _validate_expert_layout(cfg)
    _check(
        not cfg.parallel.fp8_gather or m.fp8 == "tensorwise",
        f"parallel.fp8_gather needs model.fp8=tensorwise, got model.fp8={m.fp8}: the gather "
        "quantises each weight with the one scale its matmul uses; rowwise scales the weight "
        "per column in the forward and per row in the backward, delayed from a history",
    )
    _validate_pipeline(cfg, build_schedule)
    _validate_ramp(cfg)
    _validate_diloco(cfg)


def _validate_expert_layout(cfg: Config) -> None:
    """mesh.expert and what an MoE model composes with so far."""
    m, mesh = cfg.model, cfg.mesh
    _check(
        mesh.expert == 1 or m.moe_experts,
        f"mesh.expert={mesh.expert} needs an MoE model (model.moe_experts > 0): expert "
        "parallelism splits an MoE layer's experts; for a dense model use mesh.data",
    )
    _check(
        m.moe_experts % mesh.expert == 0,
        f"model.moe_experts ({m.moe_experts}) must be divisible by mesh.expert ({mesh.expert})",
    )
    _check(
        not (m.moe_capacity and mesh.sequence > 1),
        "model.moe_capacity with mesh.sequence > 1: capacity keeps each expert's first "
        "assignments in the micro-batch's token order, and context parallelism puts a "
        "row's tokens on several devices (not counted in that order yet); use dropless "
        "(model.moe_capacity=0) or mesh.sequence=1",
    )


def auto_loss_chunk(cfg: Config) -> int:
    """What model.loss_chunk=null means for this config on a concrete mesh: 0 (the whole
    sequence) while one micro-batch's fp32 logits per device fit LOSS_CHUNK_AUTO_BYTES,
    else the largest divisor of the tokens per device in [LOSS_CHUNK_MIN, LOSS_CHUNK_MAX]
    short of all of them whose chunk's logits fit it too (none fits: the smallest; no
    divisor: 0)."""
    m, mesh = cfg.model, cfg.mesh
    tokens = m.seq_len // mesh.sequence
    logits = 4 * cfg.train.micro_batch_size * tokens * (m.vocab_size // mesh.tensor)
    if logits <= LOSS_CHUNK_AUTO_BYTES:
        return 0
    # from the largest down (the planner asks once per candidate layout): the first
    # divisor whose chunk fits, else the smallest divisor seen
    smallest = 0
    for c in range(min(LOSS_CHUNK_MAX, tokens - 1), LOSS_CHUNK_MIN - 1, -1):
        if tokens % c == 0:
            if logits * c // tokens <= LOSS_CHUNK_AUTO_BYTES:
                return c
            smallest = c
    return smallest


def _validate_diloco(cfg: Config) -> None:
    """DiLoCo (parallel/diloco.py): replicas over `data`, what runs with them so far."""
    par = cfg.parallel
    _check(
        par.diloco_steps >= 0,
        f"parallel.diloco_steps must be >= 0 (0: off), got {par.diloco_steps}",
    )
    if not par.diloco_steps:
        return
    _check(
        cfg.mesh.data != 1,
        "parallel.diloco_steps needs mesh.data > 1: DiLoCo's replicas are the ranks of "
        "`data` (the axis across hosts or sites); split the devices with mesh.data=N",
    )
    _check(
        par.diloco_outer_lr > 0,
        f"parallel.diloco_outer_lr must be positive, got {par.diloco_outer_lr}",
    )
    _check(
        0 <= par.diloco_outer_momentum < 1,
        f"parallel.diloco_outer_momentum must be in [0, 1), got {par.diloco_outer_momentum}",
    )
    h, f, m = par.diloco_steps, par.diloco_fragments, cfg.model
    units = m.n_layers // (m.moe_every if m.moe else 1)
    of = f"the layers ({units})" if units == m.n_layers else f"the units of moe_every ({units})"
    _check(
        f >= 1 and h % f == 0 and units % f == 0,
        f"parallel.diloco_fragments ({f}) must be >= 1 and divide parallel.diloco_steps ({h}) "
        f"and {of}: a fragment of whole layers synchronises every diloco_steps / "
        "diloco_fragments steps",
    )
    _check(
        par.collectives == "explicit",
        "parallel.diloco_steps with parallel.collectives=gspmd: DiLoCo runs in the explicit "
        "step only (each rank reads its own replica inside it); use parallel.collectives=explicit",
    )
    _check(
        cfg.mesh.pipeline == 1,
        "parallel.diloco_steps with mesh.pipeline > 1: not supported yet; use mesh.pipeline=1",
    )
    _check(
        not cfg.train.batch_schedule,
        "parallel.diloco_steps with train.batch_schedule: a batch ramp would change the "
        "replicas' batch between synchronisations; not supported, drop one of them",
    )
    _check(
        not cfg.train.noise_every,
        "parallel.diloco_steps with train.noise_every: the noise scale compares the step's "
        "gradient with its micro-batches', and a DiLoCo step has one per replica; set "
        "train.noise_every=0",
    )


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
    unit = cfg.micro_tokens
    last_tokens, last_loss = 0, math.inf
    batch = ("the config's", cfg.tokens_per_step)
    for i, stage in enumerate(t.batch_schedule):
        where = f"train.batch_schedule[{i}]"
        _check(
            stage.tokens_per_step > 0 and stage.tokens_per_step % unit == 0,
            f"{where}.tokens_per_step ({stage.tokens_per_step}) must be a positive multiple of "
            f"micro_batch_size x dp x seq_len = {t.micro_batch_size} x {cfg.dp} x "
            f"{cfg.model.seq_len} = {unit} tokens (the batch grows by gradient accumulation)",
        )
        _check(  # a ramp grows the batch; a smaller one also leaves noise_every unmeasured
            stage.tokens_per_step > batch[1],
            f"{where}.tokens_per_step ({stage.tokens_per_step}) must be larger than "
            f"{batch[0]} batch ({batch[1]} tokens): a ramp's stages grow the batch",
        )
        batch = ("the previous stage's", stage.tokens_per_step)
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


def _validate_pipeline(cfg: Config, build_schedule: bool = True) -> None:
    """mesh.pipeline > 1: the stages, the schedule and what composes with them."""
    p, par = cfg.mesh.pipeline, cfg.parallel
    v = par.virtual_stages
    _check(v >= 1, f"parallel.virtual_stages must be >= 1, got {v}")
    _check(
        v == 1 or schedule.SCHEDULES[par.pipeline_schedule].chunks,
        f"parallel.virtual_stages={v} needs parallel.pipeline_schedule="
        + " or ".join(n for n, s in schedule.SCHEDULES.items() if s.chunks)
        + f" (got {par.pipeline_schedule})",
    )
    if p == 1:
        return
    _check(
        v > 1 or not schedule.SCHEDULES[par.pipeline_schedule].chunks,
        f"parallel.pipeline_schedule={par.pipeline_schedule} with parallel.virtual_stages=1 "
        "is 1F1B (one chunk a device), not what was asked: set parallel.virtual_stages >= 2, "
        "or parallel.pipeline_schedule=1f1b",
    )
    n = cfg.model.n_layers
    _check(
        n % (p * v) == 0,
        f"model.n_layers ({n}) must be divisible by mesh.pipeline x parallel.virtual_stages "
        f"({p} x {v}): every stage holds the same number of layers",
    )
    every = cfg.model.moe_every if cfg.model.moe else 1
    _check(
        (n // every) % (p * v) == 0,
        f"model.n_layers / model.moe_every ({n} / {every}) must be divisible by "
        f"mesh.pipeline x parallel.virtual_stages ({p} x {v}): every stage holds whole "
        "units of moe_every layers (the dense ones and their MoE layer)",
    )
    _check(
        every == 1 or not schedule.SCHEDULES[par.pipeline_schedule].splits_backward,
        f"model.moe_every={every} with parallel.pipeline_schedule={par.pipeline_schedule}: "
        "zero bubble's weight step keeps one (input, cotangent) pair per weight of a layer, "
        "not of a unit of dense and MoE layers; use afab, 1f1b or interleaved, or "
        "model.moe_every=1",
    )
    _check(
        cfg.mesh.sequence == 1,
        "mesh.pipeline > 1 with mesh.sequence > 1: pipeline and context parallelism do not "
        "compose yet; use one of them",
    )
    _check(
        cfg.model.remat != "offload",
        "model.remat=offload with mesh.pipeline > 1: the schedule keeps each micro-batch's "
        "saved activations in one device buffer of its loop, which host memory cannot join; "
        "use selective or full",
    )
    _check(
        not (par.zero == 3 and cfg.mesh.fsdp > 1),
        "parallel.zero=3 with mesh.pipeline > 1: ZeRO-3 would all-gather every stage's "
        "weights again at every micro-batch tick; use parallel.zero=1 or 2 (docs/pipeline.md)",
    )
    if build_schedule:
        validate_schedule(par.pipeline_schedule, p, cfg.train.grad_accum, v)


def validate_schedule(kind: str, p: int, m: int, v: int) -> None:
    """The schedule's own rules on stages, micro-batches and chunks, as building its
    table checks them."""
    try:
        schedule.build(kind, p, m, v)
    except ValueError as e:
        raise ConfigError(f"parallel.pipeline_schedule={kind}: {e}") from None


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
