"""Every layout of a model on N GPUs that divides the model and the batch, with its
predicted memory (memory.estimate) and step time (steptime.predict): the planner's
search space (python -m ultrajax.plan, docs/planner.md). What must divide what is the
config's to say (config/validate.py): the planner asks it, never restates it.

A layout is the mesh (data, fsdp, tensor, pipeline, sequence), the ZeRO stage, the
pipeline schedule, the micro-batch, gradient accumulation and the remat policy. The
global batch is fixed (tokens per step), so dp x micro-batch x accumulation is too.
Sequence parallelism is on wherever tensor > 1 (the same bytes as TP's all-reduces,
less memory). Tensor and context parallelism stay inside a node.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

from ultrajax.config import schema as config_lib
from ultrajax.config import validate
from ultrajax.config.schema import Config, ConfigError
from ultrajax.cost import hardware, memory, steptime
from ultrajax.parallel.pipeline import schedules as schedule

REMATS = ("none", "selective", "full")
MICRO_BATCHES = (1, 2, 4, 8, 16, 32)


def _loss_chunk(base: Config, cfg: Config) -> int | None:
    """model.loss_chunk for a candidate: what auto gives on its own mesh where the base's
    is auto (unresolved, or resolved to what auto gives on the base's mesh), so that a
    layout's memory does not depend on the layout the config happens to have; an
    explicit other value stays."""
    chunk = base.model.loss_chunk
    concrete = all(v > 0 for v in base.mesh.sizes().values())
    if chunk is None or (concrete and chunk == validate.auto_loss_chunk(base)):
        return validate.auto_loss_chunk(cfg)
    return chunk


@dataclass(frozen=True)
class Candidate:
    """One layout the planner scores: the config's sections it sets (parallel/layout.py's
    Layout is another thing, the step's placement of a config on a mesh)."""

    data: int
    fsdp: int
    tensor: int
    pipeline: int
    sequence: int
    zero: int
    micro_batch: int
    accum: int
    remat: str
    schedule: str = "1f1b"
    virtual: int = 1
    expert: int = 1  # mesh.expert: a data axis that also splits the experts (MoE only)

    def config(self, base: Config) -> Config:
        """`base` with this layout (sections replaced, the rest shared with `base`)."""
        cfg = copy.copy(base)
        cfg.mesh = config_lib.MeshConfig(
            data=self.data,
            fsdp=self.fsdp,
            pipeline=self.pipeline,
            expert=self.expert,
            sequence=self.sequence,
            tensor=self.tensor,
        )
        cfg.parallel = replace(
            base.parallel,
            zero=self.zero,
            sequence_parallel=self.tensor > 1,
            pipeline_schedule=self.schedule if self.pipeline > 1 else schedule.PLAIN,
            virtual_stages=self.virtual,
        )
        cfg.train = replace(
            base.train,
            micro_batch_size=self.micro_batch,
            grad_accum=self.accum,
            batch_schedule=None,
            noise_every=0,
        )
        cfg.model = replace(base.model, remat=self.remat, loss_chunk=_loss_chunk(base, cfg))
        return cfg

    def overrides(self) -> str:
        """The key=value overrides that give this layout to train or analyze, whatever the
        config file sets (every mesh axis, and a pipeline's schedule whole: a file's
        mesh.expert or virtual stages left in force made another layout, or a refused one)."""
        parts = [
            f"mesh.data={self.data}",
            f"mesh.fsdp={self.fsdp}",
            f"mesh.tensor={self.tensor}",
            f"mesh.pipeline={self.pipeline}",
            f"mesh.sequence={self.sequence}",
            f"mesh.expert={self.expert}",
            f"parallel.zero={self.zero}",
            f"parallel.sequence_parallel={str(self.tensor > 1).lower()}",
            f"train.micro_batch_size={self.micro_batch}",
            f"train.grad_accum={self.accum}",
            f"model.remat={self.remat}",
        ]
        parts.append(f"parallel.pipeline_schedule={self.schedule}")
        parts.append(f"parallel.virtual_stages={self.virtual}")
        return " ".join(parts)

    def short(self) -> str:
        mesh = f"dp{self.data}"
        if self.fsdp > 1:
            mesh += f" fsdp{self.fsdp} z{self.zero}"
        if self.expert > 1:
            mesh += f" ep{self.expert}"
        if self.tensor > 1:
            mesh += f" tp{self.tensor}"
        if self.sequence > 1:
            mesh += f" cp{self.sequence}"
        if self.pipeline > 1:
            v = f"x{self.virtual}" if self.virtual > 1 else ""
            mesh += f" pp{self.pipeline} {self.schedule}{v}"
        return f"{mesh} mbs{self.micro_batch} ga{self.accum} remat={self.remat}"


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_candidates(
    base: Config, gpus: int, gpus_per_node: int, sequences: int
) -> Iterator[Candidate]:
    """Every layout of `sequences` sequences per step on `gpus` devices that the config's
    own checks accept (config.validate_layout: heads, d_ff and vocab divisible by tensor,
    the sequence's chunks, layers by pipeline x virtual stages, ZeRO's d_model, the
    schedule's micro-batch rules, ...)."""
    for candidate, _ in _accepted(base, gpus, gpus_per_node, sequences):
        yield candidate


def _accepted(
    base: Config, gpus: int, gpus_per_node: int, sequences: int
) -> Iterator[tuple[Candidate, Config]]:
    """The candidates the config's validate_layout accepts, each with its config. The
    planner chooses only what it tries (tensor and context parallelism inside a node,
    data ranks that divide the batch); the config decides what must divide what. A mesh
    shape the config refuses with the least it can carry (one fsdp rank, ZeRO-0, the
    plain schedule on one micro-batch a stage) it refuses with every batch split, so
    each shape is asked once before its splits are."""
    schedule_verdicts: dict = {}
    for tp, cp, pp in _mesh_shapes(gpus, gpus_per_node):
        dp = gpus // (tp * cp * pp)
        if sequences % dp:
            continue
        least = Candidate(dp, 1, tp, pp, cp, 0, 1, pp, REMATS[0])
        if not _accepts(least.config(base), schedule_verdicts):
            continue
        experts = _expert_sizes(base, dp, gpus_per_node)
        for candidate in _batch_splits(sequences // dp, dp, tp, cp, pp, gpus_per_node, experts):
            cfg = candidate.config(base)
            if _accepts(cfg, schedule_verdicts):
                yield candidate, cfg


def _mesh_shapes(gpus: int, gpus_per_node: int) -> Iterator[tuple[int, int, int]]:
    """(tensor, context, pipeline) sizes whose product divides `gpus`; tensor and context
    parallelism stay inside a node (their collectives run every layer)."""
    for tp in divisors(gpus):
        if tp > gpus_per_node:
            continue
        for cp in divisors(gpus // tp):
            if cp > gpus_per_node:
                continue
            for pp in divisors(gpus // (tp * cp)):
                yield tp, cp, pp


def _expert_sizes(base: Config, dp: int, gpn: int) -> list[int]:
    """mesh.expert sizes to try: 1, and for an MoE model the divisors of the data ranks
    that hold whole experts and stay inside a node (the all-to-alls run every MoE layer,
    as tensor parallelism's collectives do); validate_layout has the last word."""
    m = base.model
    if not m.moe:
        return [1]
    return [e for e in divisors(dp) if e <= gpn and m.moe_experts % e == 0]


def _batch_splits(
    rows: int, dp: int, tp: int, cp: int, pp: int, gpn: int, experts: list[int] = (1,)
) -> Iterator[Candidate]:
    """The planner's tries for one mesh shape: `rows` sequences per data rank as
    micro-batch x accumulation; the dp ranks split over `expert` (each of `experts`),
    the rest all data, or sharded (ZeRO-1/2/3) over all of them or over those a node
    holds; every planned schedule, one that chunks with 2 chunks a device; each remat
    policy."""
    inner = tp * cp * pp
    shards = []  # (data, fsdp, zero, expert)
    for ep in experts:
        rest = dp // ep
        local = max(1, min(rest, gpn // (inner * ep))) if inner * ep < gpn else 1
        shards.append((rest, 1, 0, ep))
        for z in (1, 2, 3):
            for fsdp in sorted({rest, local}):
                if fsdp > 1 and rest % fsdp == 0:
                    shards.append((rest // fsdp, fsdp, z, ep))
    kinds = [(schedule.PLAIN, 1)]  # the schedule a one-stage layout carries
    if pp > 1:
        kinds = [(n, 2 if s.chunks else 1) for n, s in schedule.SCHEDULES.items() if s.planned]
    for mbs in MICRO_BATCHES:
        if rows % mbs:
            continue
        for (data, fsdp, z, ep), (kind, v), remat in itertools.product(shards, kinds, REMATS):
            yield Candidate(data, fsdp, tp, pp, cp, z, mbs, rows // mbs, remat, kind, v, ep)


def _accepts(cfg: Config, schedule_verdicts: dict) -> bool:
    """config.validate_layout accepts cfg. Its slow rule, the pipeline schedule's own
    (validate_schedule builds the table: seconds for thousands of micro-batches), is
    asked once per schedule, p and v, on the fewest micro-batches with the same answer
    (kept in `schedule_verdicts`): the schedules read the count m only as m >= p and
    m mod p (parallel/pipeline/schedules.py), which min(m, p + m mod p) answers alike."""
    try:
        validate.validate_layout(cfg, build_schedule=False)
    except ConfigError:
        return False
    p, m = cfg.mesh.pipeline, cfg.train.grad_accum
    if p == 1:
        return True
    key = (cfg.parallel.pipeline_schedule, p, min(m, p + m % p), cfg.parallel.virtual_stages)
    if key not in schedule_verdicts:
        try:
            validate.validate_schedule(*key)
            schedule_verdicts[key] = True
        except ConfigError:
            schedule_verdicts[key] = False
    return schedule_verdicts[key]


@dataclass
class Evaluated:
    candidate: Candidate
    time: steptime.StepTime
    memory: float | None = None  # bytes per device; None: not estimated (not needed)


def memory_of(cfg: Config, cache: dict) -> float:
    """memory.estimate(cfg).peak, read at a capped micro-batch count under a pipeline.

    A pipeline's buffers stop growing once the schedule is in its steady state (a few
    times p micro-batches); only the batch's int32 fields (5 x 4 bytes a token) keep
    growing with accumulation, added here. Building a schedule of hundreds of
    micro-batches costs a tenth of a second; a planner asks thousands."""
    p, v = cfg.mesh.pipeline, cfg.parallel.virtual_stages
    m = cfg.train.grad_accum
    cap = 2 * p if p > 1 else m  # 1F1B, ZB-H1: p in flight; interleaved: < 1.5 p
    extra = 0.0
    if m > cap:
        tokens = cfg.train.micro_batch_size * cfg.model.seq_len // cfg.mesh.sequence
        extra = 5 * 4 * (m - cap) * tokens
        cfg = copy.copy(cfg)
        cfg.train = replace(cfg.train, grad_accum=cap)
    key = (repr(cfg.mesh), repr(cfg.parallel), repr(cfg.train), repr(cfg.model), v)
    if key not in cache:
        cache[key] = memory.estimate(cfg, platform="gpu").peak
    return cache[key] + extra


def evaluate(
    base: Config,
    gpus: int,
    acc: hardware.Accelerator,
    gpus_per_node: int,
    tokens_per_step: int,
    fit: steptime.Fit = steptime.ULTRAJAX,
) -> list[Evaluated]:
    """Every layout with its step time, fastest first (memory is estimated by `rank`)."""
    seq = base.model.seq_len
    if tokens_per_step % seq:
        raise ConfigError(
            f"--tokens-per-step ({tokens_per_step}) must be a multiple of model.seq_len ({seq})"
        )
    out, cache = [], {}
    for candidate, cfg in _accepted(base, gpus, gpus_per_node, tokens_per_step // seq):
        time = steptime.predict(cfg, acc, gpus_per_node, fit, cache=cache)
        out.append(Evaluated(candidate, time))
    out.sort(key=lambda e: e.time.total)
    return out


def rank(
    base: Config, evaluated: list[Evaluated], capacity: float, top: int, at_least: int = 0
) -> list[Evaluated]:
    """The `top` fastest layouts that fit in `capacity` bytes, estimating memory in order
    of speed: every layout faster than the last of them has its memory (and so the reason
    it lost), and so do at least the `at_least` fastest (for the plot)."""
    cache: dict = {}
    best = []
    for i, e in enumerate(evaluated):
        if len(best) >= top and i >= at_least:
            break
        e.memory = memory_of(e.candidate.config(base), cache)
        if e.memory <= capacity and len(best) < top:
            best.append(e)
    return best


def slower_reason(e: Evaluated, best: Evaluated) -> str:
    """Where the extra time of `e` over `best` goes, the two largest differences."""
    a, b = e.time.parts(), best.time.parts()
    diff = sorted(((a[k] - b[k], k) for k in a), reverse=True)[:2]
    extra = e.time.total / best.time.total - 1
    where = ", ".join(f"{k} +{d / best.time.total:.0%}" for d, k in diff if d > 0)
    return f"{extra:.0%} slower: {where}" if where else f"{extra:.0%} slower"


def tokens_per_step(base: Config, gpus: int) -> int:
    """The config's own global batch on `gpus` devices (its -1 fill resolved there), or
    its micro-batch x accumulation on each data rank of a plain data-parallel mesh."""
    cfg = copy.deepcopy(base)
    try:
        validate.resolve_mesh(cfg, gpus)
        return cfg.tokens_per_step
    except ConfigError:
        inner = math.prod(v for k, v in base.mesh.sizes().items() if k not in ("data", "fsdp"))
        inner = max(1, inner)
        dp = max(1, gpus // inner)
        return base.train.micro_batch_size * base.train.grad_accum * dp * base.model.seq_len
