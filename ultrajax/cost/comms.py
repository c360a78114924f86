"""One step's communication: what the compiled HLO does, beside what the playbook predicts.

Measured: every collective in `compiled.as_text()` (all-reduce, all-gather,
reduce-scatter, collective-permute, all-to-all and their async `-start` forms),
counted as many times as it runs. A collective inside a while loop (the layer
scan, the micro-batch scan) runs once per iteration, so each computation's
multiplicity is the product of the trip counts of the loops that call it, read
from XLA's `known_trip_count` (or the loop condition's constant bound). Bytes
are per device: XLA's SPMD program is the same on every device.

Two figures per collective, for a group of n devices and a buffer of B bytes:
  payload: the full logical buffer (all-reduce B, all-gather its output B,
    reduce-scatter its input B, all-to-all B, collective-permute B);
  traffic: what one device sends with a ring algorithm: all-reduce 2B(n-1)/n,
    all-gather and reduce-scatter B(n-1)/n, all-to-all B(n-1)/n, permute B.
The playbook's formulas are traffic, so the ratio compares
traffic with traffic.
"""

from __future__ import annotations

from dataclasses import dataclass

from ultrajax.config.schema import Config
from ultrajax.cost import activations, sizes, units
from ultrajax.cost.units import dtype_bytes
from ultrajax.model import llama, remat
from ultrajax.parallel import mesh as mesh_lib
from ultrajax.parallel.axes import FSDP
from ultrajax.parallel.pipeline import schedules as schedule
from ultrajax.parallel.zero import prefetches

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")


# --------------------------------------------------------------------------- the playbook


@dataclass
class Term:
    kind: str
    what: str
    formula: str
    traffic: float  # bytes one device sends per step
    axis: str  # the mesh axes it runs over: data (data x fsdp), fsdp, tensor, sequence,
    # pipeline, data+pipeline
    # when it runs, for the overlap rules of the step-time model (ultrajax/cost/steptime.py):
    # "tp" in every block (critical path), "p2p" between pipeline stages, "context" the
    # K/V ring beside attention, "gathers" ZeRO-3's per-layer gathers, "hidden" a gradient
    # reduction behind the backward pass, "exposed" once per step after it
    when: str


def _ring(nbytes: float, n: int, factor: float = 1.0) -> float:
    return factor * nbytes * (n - 1) / n if n > 1 else 0.0


def _updated_gather(weights: float, fs: int) -> Term:
    """ZeRO-1/2: the updated parameter shards all-gathered over fsdp, once per step."""
    return Term("all-gather", "parameters over fsdp (updated)", "Ψ(N-1)/N",
                _ring(weights, fs), "fsdp", "exposed")  # fmt: skip


def expected(cfg: Config, split_vocab: bool = True) -> list[Term]:
    """The playbook's per-step communication for this layout, per device.

    Ψ here is the parameter count of one tensor-parallel shard (the DP/ZeRO collectives
    move that much); gradients are reduced in `parallel.grad_reduce_dtype` (fp32 by
    default: each weight's backward rule reduces in that dtype, ultrajax/model/ops.py), weights
    gathered in the compute dtype. Gradient accumulation over m micro-batches: DP and
    ZeRO-1 reduce once per step (accumulation inside one jitted step is our no_sync),
    ZeRO-2 reduce-scatters every micro-batch (a sharded accumulator cannot hold
    unreduced gradients), ZeRO-3 also gathers the layer weights twice per micro-batch
    (the embedding and LM head once per step: `_zero3_gathers`). `split_vocab=False`
    prices a pipeline whose stages keep the embedding and head whole (another framework:
    the planner's validation against nanotron's sweep), not ultrajax's split of them.
    """
    psi = sizes.param_elements(cfg, kind="compute", ignore=(FSDP,))
    grads = units.dtype_bytes(cfg.parallel.grad_reduce_dtype) * psi
    # under a pipeline (parallel/pipeline/executor.py) psi counts this stage's layers and
    # the whole embedding, final norm and LM head
    if cfg.mesh.pipeline > 1:
        terms = _pipeline_terms(cfg, grads, psi, split_vocab)
    else:
        terms = _data_terms(cfg, grads, psi)
    return (
        terms + _context_terms(cfg) + _tensor_terms(cfg) + _expert_terms(cfg) + _diloco_terms(cfg)
    )


def _diloco_terms(cfg: Config) -> list[Term]:
    """DiLoCo (parallel/diloco.py): the pseudo-gradients of this device's stored shard of
    the parameters all-reduced over `data` in parallel.diloco_dtype, once every H steps
    (per step: 1/H of it); nothing else crosses `data`."""
    h, n = cfg.parallel.diloco_steps, cfg.mesh.data
    if not h or n == 1:
        return []
    nbytes = units.dtype_bytes(cfg.parallel.diloco_dtype) * sizes.param_elements(cfg)
    what = f"pseudo-gradients over data (DiLoCo, once every {h} steps)"
    if units.dtype_bytes(cfg.parallel.diloco_dtype) == 1:  # fp8: gathered, each with its scale
        per = n * (nbytes + 4 * _leaves(cfg))  # every replica's bytes arrive at every rank
        return [Term("all-gather", what + ", fp8 and scales", "Ψ(N-1) / H",
                     _ring(per, n) / h, "data", "exposed")]  # fmt: skip
    return [Term("all-reduce", what, "2Ψ(N-1)/N / H", _ring(nbytes, n, 2.0) / h, "data", "exposed")]


def _leaves(cfg: Config) -> int:
    """How many parameter arrays the model has (fp8 pseudo-gradients: one scale each)."""
    return sum(1 for _ in llama.params_of(cfg.model))


def _data_axes(cfg: Config) -> tuple[int, int, int]:
    """(data x sequence x expert, fsdp, the ZeRO stage in effect): context and expert
    parallelism split the tokens like the data axes, so gradients sum over them too;
    ZeRO needs fsdp > 1. Under DiLoCo `data` splits replicas, not one model's tokens."""
    mesh = cfg.mesh
    fs = mesh.fsdp
    data = 1 if cfg.parallel.diloco_steps else mesh.data  # DiLoCo: replicas, never summed
    return data * mesh.sequence * mesh.expert, fs, cfg.parallel.zero if fs > 1 else 0


def _expert_share(cfg: Config, psi: int) -> float:
    """The share of this device's weights (psi) that expert parallelism splits: the
    experts' gradients are complete over `expert` (their rank saw every token sent to
    them) and sum over the other data axes only."""
    if cfg.mesh.expert == 1:
        return 0.0
    experts = sizes.param_elements(
        cfg, kind="compute", ignore=(FSDP,), where=lambda p: "experts" in p.names
    )
    return experts / psi


def _data_terms(cfg: Config, grads: float, psi: int) -> list[Term]:
    """Without a pipeline: DP's all-reduce of the gradients, or ZeRO's reduce-scatter (and
    an all-reduce of the shards over the data axes) and its gathers of the weights."""
    dp_d, fs, zero = _data_axes(cfg)
    over = " x sequence" * (cfg.mesh.sequence > 1) + " x expert" * (cfg.mesh.expert > 1)
    share, n_e = _expert_share(cfg, psi), cfg.mesh.expert
    experts, grads = grads * share, grads * (1 - share)
    if zero == 0:
        terms = []
        axes = "fsdp" if cfg.parallel.diloco_steps else "data x fsdp"  # DiLoCo: data = replicas
        if dp_d * fs > 1:
            terms.append(Term("all-reduce", f"gradients over {axes}" + over, "2Ψ(N-1)/N",
                              _ring(grads, dp_d * fs, 2.0), "data", "hidden"))  # fmt: skip
        if experts and dp_d // n_e * fs > 1:
            terms.append(_expert_reduction(experts, dp_d // n_e * fs, axes))
        return terms
    rs_times = cfg.train.grad_accum if zero >= 2 else 1
    terms = [
        Term(
            "reduce-scatter",
            f"gradients over fsdp (ZeRO-{zero})" + (", every micro-batch" if rs_times > 1 else ""),
            f"{rs_times}·Ψ(N-1)/N" if rs_times > 1 else "Ψ(N-1)/N",
            rs_times * _ring(grads + experts, fs),
            "fsdp",
            "hidden",
        )
    ]
    if dp_d > 1:
        terms.append(
            Term("all-reduce", "gradient shards over data" + over,
                 "2(Ψ/N_fsdp)(N_data-1)/N_data", _ring(grads / fs, dp_d, 2.0), "data", "hidden")
        )  # fmt: skip
    if experts and dp_d // n_e > 1:
        terms.append(_expert_reduction(experts / fs, dp_d // n_e, "data (shards)"))
    grads = grads + experts
    if zero == 3:
        return terms + _zero3_gathers(cfg, psi)
    return terms + [_updated_gather(units.dtype_bytes(cfg.model.dtype) * psi, fs)]


def _expert_reduction(nbytes: float, n: int, over: str) -> Term:
    return Term("all-reduce", f"expert gradients over {over}, not expert", "2Ψ_experts(N-1)/N",
                _ring(nbytes, n, 2.0), "data", "hidden")  # fmt: skip


def _expert_terms(cfg: Config) -> list[Term]:
    """Expert parallelism (parallel/expert.py): every MoE layer sends its assignments to
    the experts' ranks and the outputs back, all-to-all over `expert` in slots of T·k rows
    (T the tokens an MoE layer sees on a device: tensor ranks hold the same ones), twice
    forward and twice backward per micro-batch, and the forward again where the backward
    recomputes; each rows' local expert (int32) travels with the forward's."""
    n, m, t = cfg.mesh.expert, cfg.model, cfg.train
    if n == 1 or not m.moe:
        return []
    rows = t.micro_batch_size * (m.seq_len // cfg.mesh.sequence) * m.moe_top_k
    forwards = 1 if m.remat == "none" else 2
    times = m.n_layers // m.moe_every * t.grad_accum  # the MoE layers'
    c = units.dtype_bytes(m.dtype)
    again = ", forward again)" if forwards > 1 else ")"
    return [
        Term("all-to-all", "MoE rows to their experts' ranks and back (forward, backward" + again,
             f"{2 * (forwards + 1)}·L·m·(n-1)·Tk·d",
             times * 2 * (forwards + 1) * _ring(n * rows * m.d_model * c, n), "expert", "tp"),
        Term("all-to-all", "each row's local expert (int32, with the forward's rows)",
             f"{forwards}·L·m·(n-1)·Tk", times * forwards * _ring(n * rows * 4, n), "expert", "tp"),
    ]  # fmt: skip


def _zero3_gathers(cfg: Config, psi: int) -> list[Term]:
    """ZeRO-3's gathers of the weights over fsdp.

    Layer weights are gathered inside the layer scan, forward and again in the
    (recomputing) backward, every micro-batch. The embedding, final norm and LM head are
    gathered outside it: the gather is loop-invariant, so XLA hoists it out of the
    micro-batch loop and the backward reuses it (the embedding's backward needs no
    weights at all): once per step. The playbook's 2Ψ counts every weight twice; the
    prefetch (parallel.prefetch) gathers one layer more per micro-batch (2 + 1/L), the
    last layer again at the forward's end, for the backward to start with. An FP8 weight
    whose e4m3 copy the forward keeps is gathered in the forward only (1 + 1/L)."""
    fs, accum = cfg.mesh.fsdp, cfg.train.grad_accum
    c = units.dtype_bytes(cfg.model.dtype)
    psi_layers = sizes.param_elements(
        cfg, kind="compute", ignore=(FSDP,), where=lambda p: p.layered
    )
    rest = psi - psi_layers
    # FP8 weights: parallel.fp8_gather moves them in e4m3, one byte a value; without
    # recomputation (tensorwise, delayed) the backward reads the e4m3 copy the forward
    # kept, no second gather
    m, par = cfg.model, cfg.parallel
    fp8 = set(llama.fp8_weights(m))
    in_fp8 = sizes.param_elements(cfg, kind="compute", ignore=(FSDP,), where=lambda p: p.key in fp8)
    kept = bool(fp8) and m.remat == "none" and m.fp8 != "rowwise"
    fp8_bytes = (1 if par.fp8_gather else c) * in_fp8
    # the prefetch gathers one layer more per micro-batch (model/prefetch.py)
    extra = 1 / cfg.model.n_layers if prefetches(cfg) else 0
    times = f"({2 * accum}+{accum}/L)" if extra else f"{2 * accum}"
    return [
        Term(
            "all-gather",
            "layer weights over fsdp (forward and backward, every micro-batch"
            + (", one layer ahead" if extra else "")
            + ("; FP8 weights forward only" if kept else "")
            + ("; FP8 weights in e4m3)" if par.fp8_gather else ")"),
            f"{times}·Ψ_layers(N-1)/N",
            accum
            * (
                (2 + extra) * _ring(c * (psi_layers - in_fp8), fs)
                + (1 + extra if kept else 2 + extra) * _ring(fp8_bytes, fs)
            ),
            "fsdp",
            "gathers",
        ),
        Term(
            "all-gather",
            "embedding, final norm, LM head over fsdp (once per step)",
            "Ψ_rest(N-1)/N",
            _ring(c * rest, fs),
            "fsdp",
            "exposed",
        ),
    ]


def _context_terms(cfg: Config) -> list[Term]:
    """Context parallelism (mesh.sequence > 1): the K/V blocks the ring passes around, or
    the all-gathers and reduce-scatters of parallel.context=allgather (`permute_bytes`)."""
    if cfg.mesh.sequence == 1:
        return []
    ring = cfg.parallel.context == "ring"
    what = (
        "K/V blocks around the ring (cp-1 hops forward and backward) and dK/dV (cp hops)"
        if ring
        else "K/V all-gathered over sequence (forward, backward) and dK/dV scattered home"
    )
    formula = "L·m·[2(cp-1)·kv_block + cp·dkv_block]" if ring else "L·m·(cp-1)·kv_block"
    return [
        Term(kind, what, formula, nbytes, "sequence", "context")
        for kind, nbytes in permute_bytes(cfg).items()
    ]


def tp_collectives_per_block(m, kind: str = "all-reduce") -> int:
    """Tensor parallelism's collectives of `kind` per block and micro-batch. Forward: a
    reduction of attention's and of the MLP's output (all-reduces; under sequence
    parallelism reduce-scatters, each norm's output all-gathered before); backward: the
    transposes, so 4 of each kind. Recomputation gathers both norms' outputs again under
    SP, and runs wo's reduction again unless the residual stream after it is kept
    (remat.RESIDUAL: selective keeps it; w_down's output only enters a residual sum):
    up to 5 all-reduces, or 6 all-gathers and 5 reduce-scatters (measured:
    tests/test_analyze.py)."""
    if m.remat == "none":
        return 4
    if kind == "all-gather":
        return 6
    return 4 + (remat.RESIDUAL not in remat.kept_tags(m.remat))


def _tensor_terms(cfg: Config) -> list[Term]:
    """Tensor parallelism (mesh.tensor > 1): all-reduces of b·s·h activations in every
    block, plus the embedding's forward and the LM head's backward; with sequence
    parallelism the same volume as all-gathers and reduce-scatters."""
    mesh, m, t = cfg.mesh, cfg.model, cfg.train
    tp = mesh.tensor
    if tp == 1:
        return []
    # b·s·h of one micro-batch (the device's part of the sequence under CP)
    act = units.dtype_bytes(m.dtype) * t.micro_batch_size * (m.seq_len // mesh.sequence)
    act *= m.d_model

    def ops(kind):  # + embedding forward, LM head backward; a pipeline stage its layers
        per_block = tp_collectives_per_block(m, kind)
        what = f"activations b·s·h, {per_block} per block + embedding and LM head, a micro-batch"
        return (per_block * m.n_layers // mesh.pipeline + 2) * t.grad_accum, what

    if cfg.parallel.sequence_parallel:
        return [
            Term(kind, what + " (SP)", f"{n}·bsh(t-1)/t", n * _ring(act, tp), "tensor", "tp")
            for kind in ("all-gather", "reduce-scatter")
            for n, what in [ops(kind)]
        ]
    n, what = ops("all-reduce")
    return [Term("all-reduce", what, f"{n}·2bsh(t-1)/t", n * _ring(act, tp, 2.0), "tensor", "tp")]


def pipeline_message_bytes(cfg: Config) -> float:
    """One point-to-point message of the pipeline: a micro-batch's residual stream on one
    device, rows x seq_len (/ tensor with SP) x d_model in the compute dtype."""

    d = sizes.dims(cfg)
    return float(d.c * d.X_res)


def _pipeline_terms(cfg: Config, grads: float, psi: int, split_vocab: bool) -> list[Term]:
    """mesh.pipeline > 1 (parallel/pipeline/executor.py): every gradient is reduced once, after the
    last micro-batch (ZeRO-2 too); the embedding, final norm and LM head, which every
    stage holds, sum over `pipeline` in the same all-reduce as over the data axes; and
    the activations and gradients cross the stage boundaries point to point."""
    p = cfg.mesh.pipeline
    dp_d, fs, zero = _data_axes(cfg)
    psi_rest = sizes.param_elements(
        cfg, kind="compute", ignore=(FSDP,), where=lambda w: not w.layered
    )
    rest = grads * psi_rest / psi  # grads: bytes of the psi weights' gradients
    layers = grads - rest
    # the embedding and LM head split over `pipeline` along the vocabulary
    # (mesh.vocab_over_pipeline): their gradients reduce-scattered over it first (then
    # over fsdp and the data axes at 1/p), their compute copy gathered over it once a
    # step (of the fsdp shard: the fsdp gather after it moves the whole tables as before)
    vocab = split_vocab and mesh_lib.vocab_over_pipeline(cfg)
    tables = grads * _vocab_elements(cfg) / psi if vocab else 0.0
    terms = []
    if vocab:
        terms.append(
            Term("reduce-scatter", "embedding, LM head gradients over pipeline (vocabulary)",
                 "Ψ_vocab(p-1)/p", _ring(tables, p), "pipeline", "hidden")
        )  # fmt: skip
    if zero >= 1:
        terms.append(
            Term("reduce-scatter", f"gradients over fsdp (ZeRO-{zero}, once per step)",
                 "Ψ(N-1)/N", _ring(grads - tables + tables / p, fs), "fsdp", "hidden")
        )  # fmt: skip
    shard = fs if zero >= 1 else 1
    over = "gradient shards" if zero >= 1 else "gradients"
    n = dp_d * (fs if zero == 0 else 1)
    if n > 1:
        terms.append(
            Term("all-reduce", f"layer {over} over the data axes", "2Ψ_layers(N-1)/N",
                 _ring(layers / shard, n, 2.0), "data", "hidden")
        )  # fmt: skip
    if vocab and n > 1:
        terms.append(
            Term("all-reduce", f"embedding, LM head {over} over the data axes (1/p)",
                 "2(Ψ_vocab/p)(N-1)/N", _ring(tables / shard / p, n, 2.0), "data", "hidden")
        )  # fmt: skip
    terms.append(
        Term("all-reduce", f"{'final norm' if vocab else 'embedding, final norm, LM head'} "
             f"{over} over data x pipeline", "2Ψ_rest(N·p-1)/(N·p)",
             _ring((rest - tables) / shard, n * p, 2.0), "data+pipeline", "hidden")
    )  # fmt: skip
    to_compute = units.dtype_bytes(cfg.model.dtype) / units.dtype_bytes(
        cfg.parallel.grad_reduce_dtype
    )
    if vocab:
        terms.append(
            Term("all-gather", "embedding, LM head over pipeline (once per step)",
                 "Ψ_vocab(p-1)/p", _ring(tables * to_compute / shard, p), "pipeline", "exposed")
        )  # fmt: skip
    if zero >= 1:
        terms.append(_updated_gather(grads * to_compute, fs))
    return terms + [_pipeline_sends(cfg)]


def _vocab_elements(cfg: Config) -> int:
    """The embedding's and LM head's elements on one tensor rank (whole over the rest)."""
    return sizes.param_elements(
        cfg, kind="compute", ignore=(FSDP,), where=lambda w: "vocab" in w.names
    )


def _pipeline_sends(cfg: Config) -> Term:
    """The stage boundaries' point-to-point traffic, counted off the schedule's table."""
    p = cfg.mesh.pipeline
    sends = sum(schedule.p2p_messages(activations.pipeline_plan(cfg).table))
    return Term(
        "collective-permute",
        "activations down, gradients up the pipeline (each micro-batch crosses each "
        "stage boundary once each way)",
        "2·m·(v·p-1)/p·bsh",
        sends / p * pipeline_message_bytes(cfg),
        "pipeline",
        "p2p",
    )


def expected_by_kind(terms: list[Term]) -> dict[str, float]:
    out = {k: 0.0 for k in KINDS}
    for term in terms:
        out[term.kind] += term.traffic
    return out


def permute_bytes(cfg) -> dict:
    """Bytes one device sends per step for context parallelism, by collective kind (the
    playbook: K/V sent cp - 1 times per attention forward and again in the backward ring,
    where dK, dV travel too, in fp32, cp hops)."""

    m, t, cp = cfg.model, cfg.train, cfg.mesh.sequence
    if cp == 1:
        return {}
    local = t.micro_batch_size * (m.seq_len // cp)
    kv = local * (m.n_kv_heads // cfg.mesh.tensor) * m.hd
    block = 2 * kv * dtype_bytes(m.dtype) + 4 * local  # K, V and their segment ids
    # recomputation repeats the forward ring, but selective keeps the attention's output
    # and log-sum-exp (model/remat.py ATTN_SAVED): its backward runs no forward ring
    forwards = 1 if remat.ATTN_SAVED in remat.kept_tags(m.remat) else 2
    times = m.n_layers * t.grad_accum
    if cfg.parallel.context == "ring":
        per_layer = (forwards + 1) * (cp - 1) * block + cp * 2 * kv * 4
        return {"collective-permute": times * per_layer}
    # an all-gather's traffic is (n - 1)/n of the whole; the segment ids are the same in
    # every layer, so XLA gathers them once per micro-batch
    gathered = times * (forwards + 1) * (cp - 1) * (block - 4 * local)
    return {
        "all-gather": gathered + t.grad_accum * (cp - 1) * 4 * local,
        "reduce-scatter": times * (cp - 1) * 2 * kv * 4,
    }
