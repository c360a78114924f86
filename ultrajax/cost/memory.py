"""Where a train step's memory goes, per device, predicted from the config alone.

Nothing here traces the model or touches a device: the figures are closed forms in
the shapes (docs/memory.md derives each one), divided the way the mesh rules shard
them. `python -m ultrajax.analyze` prints them beside XLA's compiled figures.

A step's peak is what lives for the whole step (the arguments: master weights,
Adam moments, the batch) plus the largest of its phases' temporaries:
  - layer backward: the activations saved for backward (all layers), the gradient
    buffers, the fp32 running sum (grad_accum > 1), the compute-dtype copy of the
    weights where it is a separate array, and the working set of one layer's
    backward pass (its slice of the saved activations, recomputed ones, their
    gradients, the layer's weights and weight gradients);
  - head backward: the same saved activations, the gradient buffers, and the
    logits' working set (exp(logits), their gradient and its transposed copy);
  - lookup backward (an untied table under ZeRO >= 1, each device's own code): after
    the layers', the lookup's whole fp32 gradient and its copy for the reduce-scatter;
  - layer forward (plain xla attention): the mask's hoisted broadcasts, and under
    recomputation the layer's scores and probabilities live again;
  - optimizer update: the fp32 gradients and the update's temporaries.

`estimate(cfg).parts` is the typed breakdown (`Breakdown`) that analyze's report, the
train summary and the planner read; display labels live where the text is printed.

With mesh.pipeline > 1 the executor's fixed buffers (parallel/pipeline/executor.py) replace the
saved activations: per device, (slots + 1) micro-batch chunks of n_layers / (p v) layers'
residuals, the slots read off the schedule's own plan, and the phases are one tick's
(`_pipelined`).

The saved activations are exact (tested against `print_saved_residuals`); the
working sets are counted in copies of an activation, coefficients measured on
XLA:CPU in fp32 (the `WORK` table), since they depend on the compiler's fusion and
schedule. Bytes per element: compute dtype `c` (model.dtype), fp32 where the model
computes in fp32 (norm statistics, softmax, logits).
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field
from enum import StrEnum

import jax

from ultrajax.config.schema import Config
from ultrajax.cost import tables
from ultrajax.cost.activations import (
    HOISTED_S,
    PIPE_ATTN_S,
    PIPE_WORK,
    SOFTMAX_ROWS_SPLIT,
    _flash,
    _policy,
    concrete,
    invariant_activations,
    layer_work,
    loop_on_gpu,
    offloaded_per_layer,
    pipeline_buffers,
    pipeline_plan,
    pipeline_saved_per_layer,
    saved_per_layer,
    work_features,
)
from ultrajax.cost.sizes import dims, layer_weight_elements, param_elements
from ultrajax.cost.units import dtype_bytes, fmt_bytes
from ultrajax.model import llama
from ultrajax.parallel.axes import FSDP
from ultrajax.parallel.layout import splits_last
from ultrajax.parallel.mesh import vocab_over_pipeline
from ultrajax.parallel.zero import Zero, prefetches

HEAD_WORK_V = 2.0  # exp(logits) and d logits: fp32 b·s·v each
HEAD_WORK_X = 3.0  # final norm input, output and their gradient: b·s·h
OPT_WORK = 1.0  # fp32 parameter-sized temporaries of the AdamW update beyond the gradients


# --------------------------------------------------------------------------- the estimate


class Phase(StrEnum):
    """The phases of a step whose temporaries compete for the peak (docs/memory.md)."""

    LAYER_BACKWARD = "layer backward"
    LAYER_FORWARD = "layer forward"
    HEAD_BACKWARD = "head backward"
    LOOKUP_BACKWARD = "lookup backward"
    PIPELINE_TICK = "pipeline tick"
    GRADIENT_REDUCTION = "gradient reduction"
    OPTIMIZER_UPDATE = "optimizer update"


AFTER_BACKWARD = (Phase.OPTIMIZER_UPDATE, Phase.GRADIENT_REDUCTION)


@dataclass(frozen=True)
class Breakdown:
    """Bytes per device by what they hold: the typed breakdown the report (tools/report.py),
    the train summary and the planner read. Display text lives where it is printed."""

    master: float = 0.0  # master weights, model.param_dtype (an argument)
    # Adam mu, nu (an argument; mu is fp32 whatever param_dtype); DiLoCo's replica and
    # outer momentum (parallel/diloco.py)
    optimizer: float = 0.0
    batch: float = 0.0  # the batch, five int32 fields (an argument)
    compute_copy: float = 0.0  # the model.dtype copy of the weights, where a separate array
    gradients: float = 0.0  # fp32 gradients, reduced (pipeline: after the ticks)
    accumulators: float = 0.0  # the one fp32 running sum over micro-batches (grad_accum > 1)
    embed_grad: float = 0.0  # the whole fp32 embedding gradient beyond its shard (ZeRO >= 1)
    head_copy: float = 0.0  # ZeRO >= 1, one micro-batch: the LM head's gathered copy
    saved: float = 0.0  # activations saved for backward (pipeline: the executor's buffers)
    chunk_residuals: float = 0.0  # pipeline: one chunk's residuals, the tick's own
    head_work: float = 0.0  # the logits' and loss's working set
    work: float = 0.0  # one layer's backward working set


@dataclass(frozen=True)
class Estimate:
    """Bytes per device. `parts` is the typed breakdown; `activations` the saved
    activations by part of the model; `phases` the temporaries each phase of the step
    needs on top of the arguments."""

    parts: Breakdown
    activations: dict[str, float] = field(default_factory=dict)
    phases: dict[Phase, float] = field(default_factory=dict)
    arguments: float = 0.0
    outputs: float = 0.0  # outputs not aliased with donated arguments (the metrics)
    host: float = 0.0  # remat=offload: bytes in pinned host memory
    pipelined: bool = False  # mesh.pipeline > 1: `saved` holds the executor's buffers

    @property
    def temp(self) -> float:
        return max(self.phases.values())

    @property
    def peak_phase(self) -> Phase:
        return max(self.phases, key=self.phases.get)

    @property
    def peak(self) -> float:
        return self.arguments + self.outputs + self.temp

    @property
    def weights(self) -> float:
        """The arguments but the batch: master weights, Adam moments and their counts."""
        return self.arguments - self.parts.batch

    @property
    def held(self) -> float:
        """Gradients and copies of the weights held through the backward pass (the
        pipeline reduces its gradients after the ticks)."""
        p = self.parts
        if self.pipelined:
            return p.compute_copy + p.accumulators
        return p.compute_copy + p.gradients + p.accumulators + p.embed_grad

    def to_dict(self) -> dict:
        return {
            "parts": asdict(self.parts),
            "activations": dict(self.activations),
            "phases": {str(k): v for k, v in self.phases.items()},
            "arguments": self.arguments,
            "outputs": self.outputs,
            "temp": self.temp,
            "peak": self.peak,
            "peak_phase": str(self.peak_phase),
            "host": self.host,
            "pipelined": self.pipelined,
            "weights": self.weights,
            "held": self.held,
        }


def estimate(cfg: Config, platform: str | None = None) -> Estimate:
    """The analytic memory of one train step per device (see the module docstring), for
    the attention `model.attention` means on `platform` (default: this backend)."""
    platform = platform or jax.default_backend()
    cfg = concrete(cfg, platform)
    fixed = _fixed(cfg, platform)
    if cfg.mesh.pipeline > 1:
        return _pipelined(cfg, fixed, platform)
    held = _gradients(cfg, platform)
    per_layer = saved_per_layer(cfg, platform)
    activations = {part: cfg.model.n_layers * b for part, b in per_layer.items()}
    activations["masks and rotary tables"] = invariant_activations(cfg)
    saved = sum(activations.values())
    work = layer_work(cfg, platform=platform)
    kept = fixed.copy + held["gradients"] + held["accumulators"] + held["embed_grad"]
    phases = _phases(cfg, saved, kept, work, fixed.head_work, fixed.head_copy)
    if tables.lookup_after(cfg):
        phases[Phase.LOOKUP_BACKWARD] = tables.lookup_backward(cfg, fixed.copy, held)
    if tables.reduced_whole(cfg, platform):
        head = tables.head_all_reduce(cfg, saved + fixed.copy, fixed.head_copy, held)
        phases[Phase.HEAD_BACKWARD] = max(phases[Phase.HEAD_BACKWARD], head)
        # a layer's weight gradients too: all-reduced whole, then sliced
        phases[Phase.LAYER_BACKWARD] += 4.0 * sum(layer_weight_elements(cfg).values())
    if loop_on_gpu(cfg, platform):
        phases = _looped(cfg, phases, saved, fixed.copy, held)
    elif _last_built_early(cfg):
        phases = _with_the_last_built_early(cfg, phases, saved)
    parts = Breakdown(
        **fixed.states,
        compute_copy=fixed.copy,
        **held,
        head_copy=fixed.head_copy,
        saved=saved,
        head_work=fixed.head_work,
        work=work,
    )
    host = cfg.model.n_layers * offloaded_per_layer(cfg)
    return Estimate(parts, activations, phases, fixed.arguments, fixed.outputs, host)


@dataclass(frozen=True)
class _Fixed:
    """What a step holds whatever the layout does with the gradients and activations."""

    states: dict  # Breakdown's master, optimizer and batch
    arguments: float
    outputs: float  # loss, grad_norm, lr, n_targets
    copy: float  # the compute-dtype copies of the weights held through the layer backward
    head_copy: float  # the gathered LM head, from before the forward to the head's backward
    head_work: float  # the logits' and loss's working set


def _fixed(cfg: Config, platform: str) -> _Fixed:
    """The arguments (master weights, Adam's moments and count, the batch), the outputs,
    the compute copy of the weights and the logits' working set."""
    m, t = cfg.model, cfg.train
    d = dims(cfg)
    pb, c = dtype_bytes(m.param_dtype), d.c
    stored = param_elements(cfg, "stored")
    # the five int32 fields of batch.Batch, (grad_accum, rows, seq_len) each
    batch = 5 * 4 * t.grad_accum * d.b * (m.seq_len // cfg.mesh.sequence)
    moments = (4 + pb) * stored if cfg.optim.name == "adamw" else 0  # mu is fp32 (optim.py)
    if cfg.parallel.diloco_steps:  # DiLoCo: this rank's replica and the fp32 outer momentum
        moments += (pb + 4) * stored
    states = dict(master=pb * stored, optimizer=moments, batch=batch)
    arguments = pb * stored + moments + batch + 8  # + step counter and Adam's count
    copy, head_copy = _copies(cfg, platform)
    c_loss = tables.loss_chunk(cfg)
    if c_loss and cfg.mesh.pipeline == 1:
        # the chunked loss writes each chunk's logit gradient out in the compute dtype
        # beside its fp32 logits (model/loss.py, nn.cross_entropy_grad)
        head_work = (4 + c) * d.V * c_loss / m.seq_len
    else:
        head_work = HEAD_WORK_V * 4 * d.V * (c_loss / m.seq_len if c_loss else 1.0)
    head_work += HEAD_WORK_X * c * d.X
    return _Fixed(states, arguments, 4 * 4, copy, head_copy, head_work)


def _copies(cfg: Config, platform: str) -> tuple[float, float]:
    """(compute-dtype copies of the weights held through the layer backward, the LM head's
    gathered copy held only from before the forward to the head's backward), in bytes.

    Read off XLA:CPU's buffer assignment (d_model 1024, vocabulary 8192): ZeRO-1/2 gather
    the layers' masters into one whole copy for the step. The embedding's and the head's
    gathered tables are whole temporaries (not the shard held plus the rest): with one
    micro-batch the embedding's is freed once the lookup is done and the head's once its
    backward is; with several, the gathers are loop-invariant, XLA hoists them out of the
    micro-batch loop and both tables live through the whole step (ZeRO-3 too). A tied
    table is the head's. Without ZeRO the compute copy is a separate array only when its
    dtype differs from the masters' or it is gathered: a pipeline's embedding and head,
    stored split over `pipeline` (mesh.vocab_over_pipeline), are gathered whole each step."""
    z = Zero(cfg.parallel.zero, cfg.mesh.fsdp)
    m, c = cfg.model, dims(cfg).c
    shard_copy = c * param_elements(cfg, "compute") if c != dtype_bytes(m.param_dtype) else 0.0
    if not z.active:
        if shard_copy == 0.0 and vocab_over_pipeline(cfg):
            shard_copy = c * tables.whole(cfg, (llama.EMBEDDING, llama.HEAD))
        return shard_copy, 0.0
    table = tables.whole(cfg, (llama.EMBEDDING,)) * (not m.tie_embeddings)
    head = tables.whole(cfg, (llama.HEAD,) if not m.tie_embeddings else (llama.EMBEDDING,))
    layers = tables.whole(cfg, (llama.ATTENTION, llama.MLP, llama.NORM))
    copy = c * layers if z.active in (1, 2) else shard_copy
    if cfg.train.grad_accum > 1 and not (z.active >= 3 and tables.reduced_whole(cfg, platform)):
        return copy + c * (table + head), 0.0
    return copy, c * head  # gspmd's ZeRO-3 on a CPU: the head gathered in the loop


def _gradients(cfg: Config, platform: str) -> dict[str, float]:
    """Gradient memory held through the backward pass, by Breakdown field.

    Gradients leave each weight's backward rule in fp32, reduced (ultrajax/model/ops.py):
    ZeRO >= 1 scatters them per layer, so only shards are kept. Accumulation adds one
    fp32 running sum, whole and unreduced below ZeRO-2 (its reduction waits for the last
    micro-batch), and nothing else: every micro-batch's backward rules add into it in
    place (parallel/grads.py). What else lives beside the sum, read off XLA:CPU's buffer
    assignment (d_model 1024, vocabulary 8192, fsdp 8): without ZeRO, the zeros the last
    micro-batch's layer scan reduces the layers' gradients into, which XLA materialises
    before the micro-batch loop (the embedding's and head's are reduced from the sum
    after it); ZeRO-1, the shards the last micro-batch scatters into; ZeRO-2/3 scatter
    every micro-batch into the sum's shards, which are the gradients. A tied embedding's
    gradient is a whole fp32 table through the backward pass (the LM head's share first,
    the lookup's added after the layers; reduced after the backward), beyond the shard
    kept under ZeRO >= 1, or whole from ZeRO-2 with accumulation; ZeRO-0/1 accumulation
    adds it into the whole sum instead. An untied lookup's is made after the layers'
    backward (its zeros read off the cotangent, model/ops.py), so none is held through it
    (XLA:CPU, d_model 1024: one fp32 table less at every ZeRO >= 1 peak since). Where
    the partitioner splits the step (gspmd with TP or SP) the zeros stay a constant and
    the table is counted as before (that shape, ZeRO-1 over fsdp 4 x TP 2 with SP: 0.86,
    compiled the same before and after)."""
    z = Zero(cfg.parallel.zero, cfg.mesh.fsdp)
    stored = param_elements(cfg, "stored")
    whole = param_elements(cfg, "compute", ignore=(FSDP,))
    accum = cfg.train.grad_accum > 1
    if not z.active:
        final = tables.whole(cfg, (llama.ATTENTION, llama.MLP, llama.NORM)) if accum else whole
    else:
        # ZeRO-2/3 accumulation scatters into the sum's shards, which are the gradients,
        # but where a data axis' reduction waits for the last micro-batch: that one's
        # reduced shards are a buffer beside the sum
        final = 0 if accum and z.active >= 2 and not splits_last(cfg) else stored
    embed = 0.0  # an untied lookup's own gradient is made after the layers' backward
    held = not tables.lookup_made_after(cfg) and not tables.reduced_whole(cfg, platform)
    if held and not accum:
        embed = tables.beyond_shard(cfg, llama.EMBEDDING, 4) if z.active >= 1 else 0.0
    elif held and z.active >= 2:
        embed = 4.0 * tables.whole(cfg, (llama.EMBEDDING,))
    if tables.loss_chunk(cfg) and not cfg.model.tie_embeddings and z.active >= (2 if accum else 1):
        # the chunked loss makes the head's gradient whole in the forward pass (the tied
        # table's is the embedding's, above): held through the layer backward beside the
        # reduced one, but where it is the gradient itself (no ZeRO, one micro-batch) or is
        # added into the whole running sum as soon as it is complete (ZeRO-0/1 with
        # accumulation; its zeros are read off the activations, model/loss.py, so XLA
        # cannot build them before the micro-batch loop and keep them through it)
        embed += 4.0 * tables.whole(cfg, (llama.HEAD,))
    acc_elems = stored if z.active >= 2 else whole
    return dict(
        gradients=4.0 * final,
        accumulators=4.0 * acc_elems if accum else 0.0,
        embed_grad=embed,
    )


def _phases(cfg, saved, kept, work, head_work, head_copy) -> dict[Phase, float]:
    """Each phase's temporaries on top of the arguments (module docstring), in the order
    the step runs them (the first of equal phases is the peak's)."""
    d = dims(cfg)
    head_elems = param_elements(cfg, "compute", where=lambda p: p.part == llama.HEAD)
    phases = {Phase.LAYER_BACKWARD: saved + kept + work}
    phases[Phase.LAYER_FORWARD] = saved + kept + head_copy + _forward_work(cfg)
    phases[Phase.HEAD_BACKWARD] = saved + kept - d.c * head_elems + head_work + head_copy
    phases[Phase.OPTIMIZER_UPDATE] = _update(param_elements(cfg, "stored"))
    return phases


def _last_built_early(cfg: Config) -> bool:
    """Whether the last micro-batch's stacked buffers are built before the micro-batch
    loop and live through it: where it runs apart from the loop (a reduction waits for
    it) under gspmd, whose step never takes the conditional branch that builds them in
    their place (parallel/grads.py, accumulate: the partitioner resharded the branch's
    operands). The layers' scan makes them (a Python layer loop stacks nothing)."""
    gspmd = cfg.parallel.collectives == "gspmd"
    return gspmd and cfg.model.scan_layers and splits_last(cfg)


def _with_the_last_built_early(cfg: Config, phases: dict, saved: float) -> dict:
    """The earlier micro-batches' phases with the last one's stacked buffers beside them:
    its saved activations, and for plain attention the mask's broadcasts its layer scan
    hoists (`_hoisted`'s fp32 copies; the layer forward counts them already). Read off
    XLA:CPU, fp32, data 8 at seq 256 to 1024 with 4 micro-batches: 0.57-0.63 of the
    compiled peak before, the last micro-batch's saved activations and 1.2 to 2.1 fp32
    score arrays the gap."""
    hoisted = 0.0 if _flash(cfg) else _mask_broadcasts(cfg)
    out = dict(phases)
    out[Phase.LAYER_BACKWARD] += saved + hoisted
    out[Phase.HEAD_BACKWARD] += saved + hoisted
    out[Phase.LAYER_FORWARD] += saved
    return out


def _looped(cfg, phases, saved, copy, held) -> dict[Phase, float]:
    """`_phases` for the layers as a Python loop on a GPU (activations.loop_on_gpu): each
    layer's gradient is its own buffer, made as its backward runs (no stacked gradient
    zeroed before the backward), and each layer's compute copy and saved activations are
    freed once its backward is done. So the forward and the head hold none of the layers'
    gradients, and the layer backward's peak is at one end of it: the first layer back
    (every activation, no layer gradient) or the last (one layer's activations and copy,
    every gradient). With accumulation the step's compute copy is one stacked array held
    through the micro-batch loop (parallel/grads.py, `held`), and each layer's weights
    are a slice copied out of it: without recomputation the slices are kept for the
    backward, a second copy of the layers; a checkpointed layer slices it again in its
    backward instead (model/stack.py `Held`). And an earlier micro-batch's layer weight
    gradients, fp32 and unreduced, are added into the running sum (each an in-place
    update of its slice) only once its whole backward is done: XLA's GPU compiler
    schedules the updates there, so at its end they all wait beside the sum (the 1B step
    over fsdp 8 with ZeRO-1: 46 of the 48 MLP gradients, 2.9 GiB, under every policy).
    The update is one fusion over the layers' gradient buffers, in place: no temporaries
    beyond the gradients (read off the compiled steps, docs/memory.md)."""
    n = cfg.model.n_layers

    def layered(p):
        return p.layered

    layers = param_elements(cfg, "stored", where=layered) / param_elements(cfg, "stored")
    grads = layers * held["gradients"]
    slices = dims(cfg).c * param_elements(cfg, "compute", ignore=(FSDP,), where=layered)
    z, accum = Zero(cfg.parallel.zero, cfg.mesh.fsdp), cfg.train.grad_accum > 1
    checkpointed = cfg.model.remat != "none" or z.active >= 3
    twice = slices if accum and not checkpointed else 0.0
    out = dict(phases)
    for phase in (Phase.LAYER_FORWARD, Phase.HEAD_BACKWARD):
        out[phase] += twice - grads
    first = phases[Phase.LAYER_BACKWARD] + twice - grads
    last = phases[Phase.LAYER_BACKWARD] - saved * (n - 1) / n
    if not accum:  # the compute copy is the slices themselves, each freed after its layer
        last -= layers * copy * (n - 1) / n
    out[Phase.LAYER_BACKWARD] = max(first, last)
    if accum:  # an earlier micro-batch's end: its gradients unadded, as the rules return
        # them (ZeRO-2/3: scattered over fsdp every micro-batch)
        if z.shards_grads:
            late = 4.0 * param_elements(cfg, "stored", where=layered)
        else:
            late = 4.0 * param_elements(cfg, "compute", ignore=(FSDP,), where=layered)
        kept = copy + held["accumulators"] + held["embed_grad"] + late
        out[Phase.LAYER_BACKWARD] = max(out[Phase.LAYER_BACKWARD], kept)
    out[Phase.OPTIMIZER_UPDATE] = 4.0 * param_elements(cfg, "stored")
    return out


def _forward_work(cfg: Config) -> float:
    """The layer forward's own temporaries: one layer's weights as the scan slices them
    out of the stack (or ZeRO-3 gathers them; XLA:CPU then also transposes one gathered
    MLP matrix for its matmul; with the prefetch the next layer's arrive besides), and
    plain attention's hoisted masks (`_hoisted`), which the prefetch's layer loop, its
    backward residuals taken inside the loop (model/prefetch.py), never hoists."""
    lw = layer_weight_elements(cfg)
    weights = dims(cfg).c * sum(lw.values())
    if Zero(cfg.parallel.zero, cfg.mesh.fsdp).active >= 3:
        weights += dims(cfg).c * lw[llama.MLP] / 3
    if prefetches(cfg):
        return 2 * weights
    return weights + (0 if _flash(cfg) else _hoisted(cfg))


def _hoisted(cfg: Config) -> int:
    """Plain attention's forward: XLA hoists the mask's broadcasts out of the layer loop,
    two fp32 and one bool array of scores' size; under remat the layer's scores and
    probabilities are live again on top of them during the forward pass, and XLA:CPU
    writes the normalised probabilities as a third fp32 array once the softmax has
    SOFTMAX_ROWS_SPLIT rows."""
    d = dims(cfg)
    recompute = _policy(cfg.model) != "none"
    hoisted = _mask_broadcasts(cfg) + (2 * 4 * d.S if recompute else 0)
    if recompute and d.b * d.a * d.s >= SOFTMAX_ROWS_SPLIT:
        hoisted += 4 * d.S
    return hoisted


def _mask_broadcasts(cfg: Config) -> float:
    """Plain attention's mask broadcasts XLA hoists out of a layer scan: two fp32 arrays
    and a bool one of the scores' size (HOISTED_S of them in fp32)."""
    return HOISTED_S * 4 * dims(cfg).S


def _update(stored: int) -> float:
    """The optimizer's phase: the fp32 gradients it reads and the update's temporaries."""
    return 4.0 * stored + OPT_WORK * 4 * stored


def _pipelined(cfg: Config, fixed: _Fixed, platform: str | None = None) -> Estimate:
    """mesh.pipeline > 1 (parallel/pipeline/executor.py): the executor's buffers replace the saved
    activations, every device holds one stage's layers, the final norm, its share of the
    embedding and LM head (split over `pipeline` where mesh.vocab_over_pipeline, whole
    otherwise) and their whole compute copy, and no gradient is reduced before the last
    micro-batch is done.

    Phases: a tick (the buffers, the fp32 accumulators, one chunk's residuals being read
    or written, and one layer's backward working set, PIPE_WORK of it beside the
    attention's PIPE_ATTN_S copies of the scores); the last stage's head (the logits'
    working set instead of the chunk's); then the reduction and the optimizer."""
    m = cfg.model
    plan = pipeline_plan(cfg)
    stored = param_elements(cfg, "stored")
    whole = param_elements(cfg, "compute", ignore=(FSDP,))
    # fp32 sums of every weight this device holds, whole over fsdp (a tied embedding's
    # lookup and LM head add into one)
    accum = 4.0 * whole
    # the state's layout: ZeRO's shards, the embedding and head reduce-scattered over
    # `pipeline` (mesh.vocab_over_pipeline); whole otherwise
    grads = 4.0 * stored
    activations = pipeline_buffers(cfg)
    saved = sum(activations.values())
    per_chunk = m.n_layers // (plan.p * plan.v)
    # a chunk of several layers stacks its residuals before they go into their slot
    chunk_res = per_chunk * sum(pipeline_saved_per_layer(cfg).values()) if per_chunk > 1 else 0
    work = layer_work(cfg, PIPE_WORK[work_features(cfg)[0]], PIPE_ATTN_S, platform)
    kept = fixed.copy + accum
    phases = {
        Phase.PIPELINE_TICK: saved + kept + chunk_res + work,
        Phase.HEAD_BACKWARD: saved + kept + fixed.head_work,
        Phase.GRADIENT_REDUCTION: accum + grads,
        Phase.OPTIMIZER_UPDATE: _update(stored),
    }
    parts = Breakdown(
        **fixed.states,
        compute_copy=fixed.copy,
        gradients=grads,
        accumulators=accum,
        saved=saved,
        chunk_residuals=chunk_res,
        head_work=fixed.head_work,
        work=work,
    )
    return Estimate(parts, activations, phases, fixed.arguments, fixed.outputs, pipelined=True)


def summary_lines(cfg: Config, measured_peak: int | None = None) -> list[str]:
    """Lines for the train loop's summary: the predicted per-device breakdown beside the
    backend's measured peak (device.memory_stats on GPU), where there is one."""
    e = estimate(cfg)
    p = e.parts
    after = e.peak_phase in AFTER_BACKWARD
    work = e.temp if after else e.temp - p.saved - e.held
    name = concrete(cfg).model.attention  # as this backend runs it (analyze: as a GPU does)
    lines = [
        f"  predicted    {fmt_bytes(e.peak)} per device at the {e.peak_phase}, attention "
        f"{name}: weights + Adam {fmt_bytes(e.weights)}, gradients and copies "
        f"{fmt_bytes(e.held)}, saved activations {fmt_bytes(p.saved)}, working set "
        f"{fmt_bytes(work)} (python -m ultrajax.analyze predicts for a GPU's attention)"
    ]
    if measured_peak:
        lines.append(f"  predicted / measured peak  {e.peak / measured_peak:.2f}")
    return lines


def sweep(cfg: Config, seq_lens=None, policies=("none", "selective", "full")) -> dict:
    """Predicted activation memory (saved + working sets) and peak per seq_len and policy."""
    if seq_lens is None:
        top = max(cfg.model.seq_len * 4, 1024)
        seq_lens = [2**k for k in range(7, 20) if 2**k <= top]
    out = {"seq_len": list(seq_lens), "policies": {}}
    for pol in policies:
        acts, peaks = [], []
        for s in seq_lens:
            c = copy.deepcopy(cfg)
            c.model.seq_len, c.model.remat = s, pol
            e = estimate(c)
            acts.append(e.parts.saved + e.parts.work)
            peaks.append(e.peak)
        out["policies"][pol] = {"activations": acts, "peak": peaks}
    out["model_states"] = estimate(cfg).weights
    return out
