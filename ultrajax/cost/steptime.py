"""How long one train step takes on a cluster, predicted from the config alone.

The planner (tools/plan.py) ranks layouts by this; docs/planner.md derives it and reports
its measured accuracy against the Ultra-Scale Playbook's sweep.

A step, per device, is the slowest pipeline stage's micro-batches, the pipeline's
bubble, and what communication the playbook says cannot hide:

  micro-batch  max(compute, host floor) + tensor-parallel collectives + pipeline sends
    compute: the hardware FLOPs of one micro-batch on the slowest stage (the last: its
      layers and the LM head; or, for a framework that balances its stages by compute,
      the larger of an even share and the head alone) / (peak x efficiency), the
      efficiency a fitted curve in the per-device matmul size (tokens x d_model / tensor);
    host floor: a fitted time per layer a framework needs to launch a layer's work
      (eager PyTorch's Python; zero for ultrajax's one compiled program), longer by
      `stage_sync` per TP rank where neighbouring pipeline stages sit on different nodes;
    TP collectives: on the critical path (the playbook: unless overlapped, and ours
      are not); context parallelism's K/V ring: hidden behind the attention but for
      what exceeds it.
  pipeline     m micro-batches of the slowest stage / (1 - bubble), the bubble the
    schedule's own (parallel/pipeline/schedules.py `formula`: (p-1)/(m+p-1) for 1F1B).
  data         the gradient reduction overlaps the last micro-batch's backward (a
    fitted share of it); ZeRO-3's layer gathers overlap the previous layer's compute
    (parallel.prefetch, on by default: model/prefetch.py, as a prefetching framework's
    do); without it they are exposed (a layer gathered in its own iteration) unless
    parallel.pipeline_collectives lets XLA's collective pipeliner move them early;
    ZeRO-1/2's gather of the updated weights and everything once per step outside the
    layers are exposed.
  optimizer    the AdamW update reads and writes ~36 bytes per stored parameter at the
    HBM bandwidth.

Bytes per collective come from comms.expected (the analyzer's playbook formulas,
checked against compiled HLO); each term is placed on its mesh axis, and an axis is
inside a node or across nodes by the mesh's order (tensor fastest) and the node size:
a ring that crosses nodes runs at min(NVLink, k x NIC) per GPU, k = the group's
members per node. Link figures are cost/hardware.py's, times a fitted efficiency.
"""

from __future__ import annotations

import copy
import functools
import math
from dataclasses import dataclass, field, replace

import numpy as np

from ultrajax.config.schema import Config
from ultrajax.cost import activations, comms, flops, hardware
from ultrajax.model import llama
from ultrajax.parallel.axes import AXES
from ultrajax.parallel.pipeline import schedules as schedule

# mesh axes slowest to fastest (GUIDE section 3): tensor wants the fastest links
ULTRAJAX_ORDER = AXES  # the mesh order: slowest links outermost
ADAM_BYTES = 36  # per stored parameter: read master, m, v, grad (16); write master, m, v (12);
# write the compute copy (2) and read-modify temporaries (~6)


@dataclass(frozen=True)
class Fit:
    """The model's fitted constants (docs/planner.md says on what).

    efficiency = e_max / (1 + w0 / w), w = tokens per micro-batch per device x d_model /
    tensor (the size of one device's matmuls); a ring reaches eta_intra of NVLink and
    eta_inter of the NICs; the DP reduction hides behind `overlap` of the last
    micro-batch's backward; host_layer (+ host_layer_tp with tensor > 1) seconds per
    layer and micro-batch (forward and backward) is the floor a framework's launch puts
    under a layer's compute; where neighbouring pipeline stages sit on different nodes
    that floor is longer by stage_sync per TP rank (a floor like the rest of the host's
    time: a layer with more GPU work than that hides it; `host_floor`)."""

    e_max: float = 0.6
    w0: float = 2.0e6
    eta_intra: float = 0.5
    eta_inter: float = 0.5
    overlap: float = 0.8
    host_layer: float = 1e-3
    host_layer_tp: float = 3e-3
    # what a cluster does as it grows (SCALE_TERMS; zero: the term is off):
    congestion: float = 0.0  # a ring across N nodes gets 1 / N**congestion of its NICs
    jitter: float = 0.0  # per-node spread of a step's compute: waits for the slowest node
    step_overhead: float = 0.0  # seconds per step the framework spends outside the layers
    node_latency: float = 0.0  # seconds per node crossed, per gradient bucket reduced
    stage_sync: float = 0.0  # host floor per layer, micro-batch and TP rank, stages apart

    def params(self) -> tuple[float, ...]:
        return tuple(getattr(self, f) for f in self.__dataclass_fields__)


# The terms that model a cluster's growth, each zero in the defaults above (the model of
# one node): their start values for a fit (scripts/validate_planner.py), docs/planner.md.
BASE_TERMS = ("e_max", "w0", "eta_intra", "eta_inter", "overlap", "host_layer", "host_layer_tp")
SCALE_TERMS = {"congestion": 0.1, "jitter": 0.02, "step_overhead": 0.02, "node_latency": 1e-4,
               "stage_sync": 2e-3}  # fmt: skip
# the ones NANOTRON fits: node_latency (which rests on the 25 MiB bucket, an assumption)
# and jitter made the leave-node-count-out figures no better or worse (docs/planner.md)
FITTED_TERMS = ("congestion", "step_overhead", "stage_sync")
BUCKET_BYTES = 25 * 2**20  # PyTorch DDP's default gradient bucket (nanotron reduces by it)


# Fitted on the playbook sweep's calibration file (../shared/playbook_runs/calibration.csv:
# nanotron, H100, 1, 4 and 16 nodes of 8; the 666 runs that ran and it builds) by
# `scripts/validate_planner.py FILE --fit`, which starts from the defaults above and fits
# FITTED_TERMS of the scale terms (jitter and node_latency stay off: 10 constants).
NANOTRON = Fit(
    e_max=0.4831, w0=1.804e6, eta_intra=0.7452, eta_inter=0.5167, overlap=0.8069,
    host_layer=0.7839e-3, host_layer_tp=2.736e-3, congestion=0.06099,
    step_overhead=0.1202, stage_sync=2.246e-3,
)  # fmt: skip
# ultrajax: the same GPU, link and cluster terms (the only multi-GPU measurements we have
# are nanotron's), no host floor and no stage_sync (nanotron's eager per-layer launches
# and blocking sends): XLA runs the whole step as one program (an assumption, not yet
# measured on a GPU cluster).
ULTRAJAX = replace(NANOTRON, host_layer=0.0, host_layer_tp=0.0, stage_sync=0.0)


@dataclass(frozen=True)
class Link:
    """Where one mesh axis's ring runs: its bandwidth (peak, per GPU) and start-up latency."""

    size: int
    bw: float
    latency: float
    inter: bool  # crosses nodes (the NICs bind)
    nodes: int = 1  # nodes the group spans

    def seconds(self, nbytes: float, fit: Fit, hops: float = 0.0) -> float:
        """Bytes at the link's fitted efficiency, plus one latency per ring step. A ring
        over N nodes shares the fabric's spine with the job's other rings (oversubscribed
        uplinks, flows hashed unevenly onto them): its bandwidth / N**congestion."""
        if nbytes <= 0:
            return 0.0
        eta = fit.eta_inter if self.inter else fit.eta_intra
        if self.inter:
            eta /= self.nodes**fit.congestion
        return nbytes / (self.bw * eta) + hops * self.latency

    def bucket_latency(self, nbytes: float, fit: Fit) -> float:
        """A gradient reduction issued in buckets: each bucket's ring pays a start-up per
        node it crosses, out and back (2 (N - 1) node hops)."""
        if nbytes <= 0 or self.nodes <= 1:
            return 0.0
        return math.ceil(nbytes / BUCKET_BYTES) * 2 * (self.nodes - 1) * fit.node_latency


def links(sizes: dict[str, int], acc, gpus_per_node: int, order=ULTRAJAX_ORDER) -> dict:
    """axis -> Link: an axis's devices are `stride` apart (the product of the faster
    axes); a group that stays inside a node rides NVLink, one that crosses nodes gets
    min(NVLink, k x NIC) per GPU with k of its members per node (NCCL's rings through
    every NIC of the node)."""
    out, stride = {}, 1
    for axis in reversed(order):
        n = sizes.get(axis, 1)
        inter = n > 1 and stride * n > gpus_per_node
        if inter:
            k = max(1, min(n, gpus_per_node // stride)) if stride < gpus_per_node else 1
            bw = min(acc.intra_bw, k * acc.inter_bw)
            lat = acc.inter_latency
        else:
            bw, lat, k = acc.intra_bw, acc.intra_latency, n
        out[axis] = Link(n, bw, lat, inter and bw < acc.intra_bw, max(1, n // max(k, 1)))
        stride *= n
    return out


@dataclass
class Features:
    """What the step time is made of for one layout, before the fitted constants."""

    tokens_per_device: float  # tokens per step / devices
    m: int  # micro-batches per step
    bubble: float  # the schedule's idle fraction
    flops_mb: float  # hardware FLOPs of one micro-batch on the slowest stage, per device
    work: float  # matmul size per device: tokens per micro-batch x d_model / tensor
    layers: float  # layers on the slowest stage (the host floor's count)
    tensor: int
    tp: list = field(default_factory=list)  # (Link, bytes, collectives) per micro-batch
    p2p: list = field(default_factory=list)  # (Link, bytes) per micro-batch
    context: list = field(default_factory=list)  # (Link, bytes) per micro-batch
    attention_share: float = 0.0  # of a micro-batch's compute: what the K/V ring hides behind
    hidden: list = field(default_factory=list)  # (Link, bytes) per step, behind the backward
    gathers: list = field(default_factory=list)  # (Link, bytes) per micro-batch, ZeRO-3's
    # whether a layer's gather can run during the previous layer's compute: ultrajax's
    # layer scan gathers a layer one iteration ahead (parallel.prefetch); without it, in
    # its own iteration, before its compute needs it (exposed), unless XLA's collective
    # pipeliner moves it early (parallel.pipeline_collectives); a framework that
    # prefetches (`balanced`) hides it
    gathers_overlap: bool = True
    exposed: list = field(default_factory=list)  # (Link, bytes) per step, on the critical path
    optimizer_bytes: float = 0.0
    peak: float = 0.0
    hbm_bw: float = 0.0
    nodes: int = 1  # nodes the job spans: the synchronous step waits for the slowest
    stages_apart: bool = False  # neighbouring pipeline stages sit on different nodes


def _axis_of(term: comms.Term) -> tuple[str, str]:
    """(mesh axis, when) of one of comms.expected's terms (typed there): per micro-batch on
    the critical path (tensor), the pipeline's sends, the K/V ring, the gradient reduction
    (hidden behind the backward), ZeRO-3's per-layer gathers, or exposed once per step."""
    return term.axis, term.when


def _scaled_terms(
    cfg: Config, cache: dict | None = None, split_vocab: bool = True
) -> list[tuple[comms.Term, float]]:
    """comms.expected's terms, each with the factor that brings it to cfg.

    Under a pipeline the terms are read at one micro-batch of one row per stage (m = p,
    b = 1) and the per-micro-batch ones (tensor parallelism's, the pipeline's sends: b
    x m bytes exactly, cost/comms.py) scaled to cfg's: building a schedule of hundreds of
    micro-batches costs a tenth of a second, and a planner asks thousands of layouts.
    `cache` (a dict the caller keeps) shares the terms between layouts that differ only
    in what does not change them."""
    p = cfg.mesh.pipeline
    t = cfg.train
    full = cfg.model.remat == "full"  # the only policy that changes the bytes (TP's count)
    model = replace(cfg.model, remat="full" if full else "none")
    p2p = 1.0
    if p == 1:
        key = (repr(cfg.mesh), repr(cfg.parallel), repr(model), t.micro_batch_size, t.grad_accum)
        key = (*key, split_vocab)
        probe, per_micro = cfg, 1.0
    else:
        # every schedule's sends are 1F1B's times (v p - 1) / (p - 1): each micro-batch
        # crosses the v p - 1 stage boundaries once each way (cost/comms.py's 2 m (v p - 1) / p)
        v = cfg.parallel.virtual_stages
        par = replace(cfg.parallel, pipeline_schedule=schedule.PLAIN, virtual_stages=1)
        key = (repr(cfg.mesh), repr(par), repr(model), split_vocab)
        probe = copy.copy(cfg)
        probe.parallel = par
        probe.train = replace(t, micro_batch_size=1, grad_accum=p)
        per_micro = t.micro_batch_size * t.grad_accum / p
        p2p = per_micro * (v * p - 1) / (p - 1)
    if cache is None or key not in cache:
        terms = [(term, _axis_of(term)) for term in comms.expected(probe, split_vocab)]
        if cache is None:
            cache = {}
        cache[key] = terms
    scale = {"tp": per_micro, "p2p": p2p}
    return [(term, scale.get(when, 1.0)) for term, (_, when) in cache[key]]


def features(
    cfg: Config,
    acc: hardware.Accelerator,
    gpus_per_node: int,
    order=ULTRAJAX_ORDER,
    cache: dict | None = None,
    balanced: bool = False,
    lockstep: bool | None = None,
) -> Features:
    """The step's pieces for a layout with concrete mesh sizes (no -1).

    The slowest pipeline stage is the last: its n_layers / p layers and the LM head
    (parallel/pipeline/executor.py), or, `balanced`, the stages' compute evened out with the LM
    head as one block (nanotron assigns its blocks to stages by their compute cost).
    `lockstep` (default: not `balanced`) prices the schedule as ultrajax's executor runs
    it (`lockstep_bubble`); otherwise its textbook bubble, as nanotron's 1F1B runs."""
    m, mesh, t = cfg.model, cfg.mesh, cfg.train
    sizes = mesh.sizes()
    n = math.prod(sizes.values())
    p, tp, cp = mesh.pipeline, mesh.tensor, mesh.sequence
    v = cfg.parallel.virtual_stages
    accum = t.grad_accum
    tokens_mb = t.micro_batch_size * m.seq_len / cp  # one device's tokens per micro-batch
    tokens = tokens_mb * accum * cfg.dp * cp  # per step, all devices
    head = 6.0 * _head_size(m)  # LM head, forward and backward, per token
    per_token = flops.hardware_flops_per_token(m, "gpu", activations.keeps_residuals(cfg, "gpu"))
    layers = math.ceil(m.n_layers / p)  # the slowest stage's (nanotron splits unevenly)
    kind = cfg.parallel.pipeline_schedule
    if balanced:
        stage = max(per_token / p, head, (per_token - head) / m.n_layers)
    else:
        stage = (per_token - head) * layers / m.n_layers + head
    if lockstep is None:
        lockstep = not balanced
    if lockstep and p > 1 and accum >= p:  # the LM head against the stage's layers
        plain = flops.flops_per_token(m, causal=True) - head  # flash skips the masked half
        redo = remat_share(m, activations.keeps_residuals(cfg, "gpu"))
        bubble = lockstep_bubble(kind, p, accum, v, head / plain * m.n_layers / layers, redo)
    else:
        bubble = _bubble(kind, p, accum, v)
    attn = 3.0 * flops.attention_flops_per_token(m) / per_token
    f = Features(
        tokens_per_device=tokens / n,
        m=accum,
        bubble=bubble,
        flops_mb=tokens_mb * stage / tp,
        work=tokens_mb * m.d_model / tp,
        layers=layers,
        tensor=tp,
        attention_share=attn,
        peak=flops.model_peak(m, acc.flops),
        hbm_bw=acc.hbm_bw or 2e12,
        nodes=max(1, -(-n // gpus_per_node)),
        gathers_overlap=balanced or cfg.parallel.prefetch or cfg.parallel.pipeline_collectives,
    )
    link = links(sizes, acc, gpus_per_node, order)
    if "data+pipeline" not in link:
        dl, pl = link["data"], link["pipeline"]
        slow = dl if dl.bw <= pl.bw else pl
        spans = min(dl.nodes * pl.nodes, f.nodes)
        link["data+pipeline"] = Link(dl.size * pl.size, slow.bw, slow.latency, slow.inter, spans)
    f.stages_apart = p > 1 and link["pipeline"].inter
    kinds = ("all-gather", "reduce-scatter") if cfg.parallel.sequence_parallel else ("all-reduce",)
    # per micro-batch, as comms.expected counts them
    tp_ops = sum(comms.tp_collectives_per_block(m, kind) * layers + 2 for kind in kinds)
    for term, scale in _scaled_terms(cfg, cache, split_vocab=not balanced):
        axis, when = _axis_of(term)
        nbytes = term.traffic * scale
        if nbytes <= 0:
            continue
        if when == "tp":
            f.tp.append((link[axis], nbytes / accum, tp_ops))
        elif when in ("p2p", "context", "gathers"):
            getattr(f, when).append((link[axis], nbytes / accum))
        else:
            getattr(f, when).append((link[axis], nbytes))
    stored = _stored_params(cfg)
    f.optimizer_bytes = ADAM_BYTES * stored
    return f


def _stored_params(cfg: Config) -> float:
    """Parameters whose optimizer state one device updates (its pipeline stage's, its
    tensor shard, its ZeRO shard)."""

    m, mesh = cfg.model, cfg.mesh
    total = sum(p.size(m) for p in llama.params_of(m) if not p.norm)
    shard = mesh.tensor * mesh.pipeline
    if cfg.parallel.zero >= 1:
        shard *= mesh.fsdp
    return total / shard


def _head_size(m) -> int:
    """The LM head's weights: its matmul runs whether or not it is tied to the embedding."""
    return sum(p.size(m) for p in llama.PARAMS if p.part == llama.HEAD)


def _bubble(kind: str, p: int, m: int, v: int) -> float:
    """The schedule's idle share of the step (schedule.formula); with fewer micro-batches
    than stages (which other frameworks run) each still crosses all p: (p-1)/(m+p-1)."""
    if p == 1:
        return 0.0
    if m < p:
        return (p - 1) / (m + p - 1)
    return schedule.formula(kind, p, m, v)


# A stage forward's cost is 1; a backward 2 (B and W of zero bubble 1 each), as in
# schedules.COSTS, plus what remat recomputes (`remat_share`: ~1 for full remat, a
# backward of 3; it lands on B, which needs the activations, not on W); the last stage's
# forward tick also runs the LM head's forward and its backward (the loss gradient is
# made there: parallel/pipeline/executor.py), 3 x head.
HEAD_IN_FORWARD = 3.0


def remat_share(m, attention_saved: bool = False) -> float:
    """The forward FLOPs a backward recomputes (flops.recompute_flops_per_token, the remat
    policy's, `attention_saved` as there), in units of the layers' forward: 0 without
    remat, ~0.9 for full (w_down is never recomputed), counted as flops counts them (the
    whole score square)."""
    forward = (flops.flops_per_token(m) - 6.0 * _head_size(m)) / 3.0
    return flops.recompute_flops_per_token(m, attention_saved) / forward


def lockstep_time(kind: str, p: int, m: int, v: int, head: float, redo: float = 0.0) -> float:
    """Ticks x their slowest op, in stage forwards, of schedule `kind` as ultrajax's
    executor runs it: one SPMD program whose devices exchange every tick, so a tick lasts
    as long as its most expensive op, and the last stage's forward tick carries the LM
    head (`head`: the head's forward over the stage's layers' forward) and a backward
    recomputes `redo` of a forward (remat_share). Beyond its fill the
    table repeats every p micro-batches, so it is built at most for 2p + m mod p of them
    and the rest added by that period's time (building hundreds costs a tenth of a second)."""
    base = p + m % p if m >= 2 * p else m
    head, redo = round(head, 6), round(redo, 6)
    if m == base:
        return _lockstep_table(kind, p, m, v, head, redo)
    t1 = _lockstep_table(kind, p, base, v, head, redo)
    t2 = _lockstep_table(kind, p, base + p, v, head, redo)
    return t1 + (m - base) // p * (t2 - t1)


@functools.lru_cache(maxsize=4096)
def _lockstep_table(kind: str, p: int, m: int, v: int, head: float, redo: float = 0.0) -> float:
    table = schedule.build(kind, p, m, v)
    ops, chunk = table[..., 0], table[..., 2]
    costs = dict(schedule.COSTS)
    costs[schedule.BACKWARD] += redo
    costs[schedule.BACKWARD_INPUT] += redo
    cost = np.vectorize(lambda o: costs[int(o)])(ops) / v
    last = (np.arange(p) == p - 1)[None, :] & (chunk == v - 1) & (ops == schedule.FORWARD)
    cost = cost + last * HEAD_IN_FORWARD * head
    return float(cost.max(axis=1).sum())


def lockstep_bubble(kind: str, p: int, m: int, v: int, head: float, redo: float = 0.0) -> float:
    """The share of the lockstep time the last (busiest) stage does not work: its m
    micro-batches cost 3 + redo + 3 head stage forwards each."""
    work = m * (3.0 + redo + HEAD_IN_FORWARD * head)
    return max(0.0, 1.0 - work / lockstep_time(kind, p, m, v, head, redo))


@dataclass
class StepTime:
    """Seconds per step by where they go, and the throughput they imply."""

    compute: float
    host: float  # the host floor's excess over the compute
    tensor: float
    pipeline_sends: float
    context: float
    bubble: float
    data: float  # exposed DP / ZeRO communication
    optimizer: float
    tokens_per_device: float
    overhead: float = 0.0  # the framework's per-step time and the wait for the slowest node

    @property
    def total(self) -> float:
        return (
            self.compute + self.host + self.tensor + self.pipeline_sends + self.context
            + self.bubble + self.data + self.optimizer + self.overhead
        )  # fmt: skip

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_device / self.total

    def parts(self) -> dict[str, float]:
        names = ("compute", "host", "tensor", "pipeline_sends", "context", "bubble", "data")
        return {k: getattr(self, k) for k in (*names, "optimizer", "overhead")}

    def where(self) -> str:
        """The largest parts other than compute, for a one-line explanation."""
        parts = {k: v for k, v in self.parts().items() if k != "compute" and v > 0}
        top = sorted(parts.items(), key=lambda kv: -kv[1])[:2]
        tail = ", ".join(f"{k} {v / self.total:.0%}" for k, v in top)
        return f"compute {self.compute / self.total:.0%}" + (f", {tail}" if tail else "")


def efficiency(work: float, fit: Fit) -> float:
    return fit.e_max / (1.0 + fit.w0 / work)


def host_floor(f: Features, fit: Fit) -> float:
    """Seconds under which one micro-batch of the slowest stage cannot run, however little
    GPU work it has: the host's time to launch its layers (an eager framework launches
    each kernel from Python: `host_layer` a layer, plus `host_layer_tp` for the
    collectives of t > 1). Where neighbouring pipeline stages sit on different nodes a
    layer's floor is longer by `stage_sync` x t. Read off the sweep (docs/planner.md): a
    layer of nanotron's pipelines across nodes takes the same time a micro-batch from 1
    to 4 or 8 sequences (~15-18 ms at t = 4, ~20-28 ms at t = 8, whatever the model), and
    the GPU work alone once that is longer: a floor, not a cost added to the compute (added,
    it predicted micro-batches of 8-32 sequences at t = 4 and 8 1.3-1.7x too slow). Its
    cause is a guess: the sends across nodes are driven by host threads beside the
    launching one, and each of a layer's TP collectives waits for the slowest of its t
    ranks' hosts, so it grows with t."""
    per_layer = fit.host_layer + (fit.host_layer_tp if f.tensor > 1 else 0.0)
    per_layer += f.stages_apart * fit.stage_sync * f.tensor
    return f.layers * per_layer


def step_time(f: Features, fit: Fit) -> StepTime:
    compute_mb = f.flops_mb / (f.peak * efficiency(f.work, fit))
    busy_mb = max(compute_mb, host_floor(f, fit))
    tp_mb = sum(lk.seconds(b, fit, ops * (lk.size - 1)) for lk, b, ops in f.tp)
    p2p_mb = sum(lk.seconds(b, fit, 2) for lk, b in f.p2p)
    ring_mb = sum(lk.seconds(b, fit, lk.size - 1) for lk, b in f.context)
    cp_mb = max(0.0, ring_mb - f.attention_share * compute_mb)
    gather_mb = sum(lk.seconds(b, fit, lk.size - 1) for lk, b in f.gathers)
    if f.gathers_overlap:
        gather_mb = max(0.0, gather_mb - compute_mb)
    mb = busy_mb + tp_mb + p2p_mb + cp_mb + gather_mb
    stretch = 1.0 / (1.0 - f.bubble)  # the schedule's idle share of the step
    # the last micro-batch's backward, that the reduction hides in; under a pipeline the
    # gradients are reduced after the last tick (parallel/pipeline/executor.py; nanotron's too)
    backward = (2.0 / 3.0) * compute_mb if f.bubble == 0 else 0.0
    hidden = sum(
        lk.seconds(b, fit, 2 * (lk.size - 1)) + lk.bucket_latency(b, fit) for lk, b in f.hidden
    )
    exposed = sum(lk.seconds(b, fit, lk.size - 1) for lk, b in f.exposed)
    data = max(0.0, hidden - fit.overlap * backward) + exposed
    m = f.m
    return StepTime(
        compute=m * compute_mb,
        host=m * (busy_mb - compute_mb),
        tensor=m * tp_mb,
        pipeline_sends=m * p2p_mb,
        context=m * (cp_mb + gather_mb),
        bubble=m * mb * (stretch - 1.0),
        data=data,
        optimizer=f.optimizer_bytes / f.hbm_bw,
        tokens_per_device=f.tokens_per_device,
        overhead=fit.step_overhead + straggler(f.nodes, fit) * m * busy_mb * stretch,
    )


def straggler(nodes: int, fit: Fit) -> float:
    """The share of a step lost waiting for the slowest node: each node's time spreads by
    `jitter` (relative standard deviation), and the expected maximum of N such draws is
    about sigma sqrt(2 ln N) above their mean; one node waits for nobody."""
    return fit.jitter * math.sqrt(2.0 * math.log(nodes)) if nodes > 1 else 0.0


def predict(
    cfg: Config,
    acc: hardware.Accelerator,
    gpus_per_node: int = 8,
    fit: Fit = ULTRAJAX,
    order=ULTRAJAX_ORDER,
    cache: dict | None = None,
) -> StepTime:
    """The step time of `cfg` (concrete mesh sizes) on `acc` GPUs, `gpus_per_node` a node."""
    return step_time(features(cfg, acc, gpus_per_node, order, cache), fit)
