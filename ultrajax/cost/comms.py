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
from ultrajax.parallel.axes import FSDP
from ultrajax.parallel.pipeline import schedules as schedule

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


def expected(cfg: Config) -> list[Term]:
    """The playbook's per-step communication for this layout, per device.

    Ψ here is the parameter count of one tensor-parallel shard (the DP/ZeRO collectives
    move that much); gradients are reduced in `parallel.grad_reduce_dtype` (fp32 by
    default: each weight's backward rule reduces in that dtype, ultrajax/model/ops.py), weights
    gathered in the compute dtype. Gradient accumulation over m micro-batches: DP and
    ZeRO-1 reduce once per step (accumulation inside one jitted step is our no_sync),
    ZeRO-2 reduce-scatters every micro-batch (a sharded accumulator cannot hold
    unreduced gradients), ZeRO-3 also gathers the layer weights twice per micro-batch
    (the embedding and LM head once per step: see the ZeRO-3 terms below).
    """

    mesh, m, t = cfg.mesh, cfg.model, cfg.train
    # context parallelism splits the tokens like the data axes: gradients sum over it too
    dp_d, fs, tp = mesh.data * mesh.sequence, mesh.fsdp, mesh.tensor
    accum = t.grad_accum
    c = units.dtype_bytes(m.dtype)
    psi = sizes.param_elements(cfg, kind="compute", ignore=(FSDP,))
    grads = units.dtype_bytes(cfg.parallel.grad_reduce_dtype) * psi
    weights = c * psi
    zero = cfg.parallel.zero if fs > 1 else 0
    terms = []
    dp = dp_d * fs
    pp = mesh.pipeline
    if pp > 1:  # parallel/pipeline/executor.py: psi counts this stage's layers and the whole rest
        terms += _pipeline_terms(cfg, grads, psi, dp_d, fs, zero)
    elif zero == 0 and dp > 1:
        terms.append(
            Term(
                "all-reduce",
                "gradients over data x fsdp" + (" x sequence" if mesh.sequence > 1 else ""),
                "2Ψ(N-1)/N",
                _ring(grads, dp, 2.0),
                "data",
                "hidden",
            )
        )
    if zero >= 1 and pp == 1:
        rs_times = accum if zero >= 2 else 1
        terms.append(
            Term(
                "reduce-scatter",
                f"gradients over fsdp (ZeRO-{zero})"
                + (", every micro-batch" if rs_times > 1 else ""),
                f"{rs_times}·Ψ(N-1)/N" if rs_times > 1 else "Ψ(N-1)/N",
                rs_times * _ring(grads, fs),
                "fsdp",
                "hidden",
            )
        )
        if dp_d > 1:
            terms.append(
                Term(
                    "all-reduce",
                    "gradient shards over data" + (" x sequence" if mesh.sequence > 1 else ""),
                    "2(Ψ/N_fsdp)(N_data-1)/N_data",
                    _ring(grads / fs, dp_d, 2.0),
                    "data",
                    "hidden",
                )
            )
        if zero == 3:
            # Layer weights are gathered inside the layer scan, forward and again in the
            # (recomputing) backward, every micro-batch. The embedding, final norm and LM
            # head are gathered outside it: the gather is loop-invariant, so XLA hoists it
            # out of the micro-batch loop and the backward reuses it (the embedding's
            # backward needs no weights at all): once per step. The playbook's 2Ψ counts
            # every weight twice.
            psi_layers = sizes.param_elements(
                cfg, kind="compute", ignore=(FSDP,), where=lambda p: p.startswith("['layers']")
            )
            rest = psi - psi_layers
            terms.append(
                Term(
                    "all-gather",
                    "layer weights over fsdp (forward and backward, every micro-batch)",
                    f"{2 * accum}·Ψ_layers(N-1)/N",
                    2 * accum * _ring(c * psi_layers, fs),
                    "fsdp",
                    "gathers",
                )
            )
            terms.append(
                Term(
                    "all-gather",
                    "embedding, final norm, LM head over fsdp (once per step)",
                    "Ψ_rest(N-1)/N",
                    _ring(c * rest, fs),
                    "fsdp",
                    "exposed",
                )
            )
        else:
            terms.append(_updated_gather(weights, fs))
    if mesh.sequence > 1:
        ring = cfg.parallel.context == "ring"
        what = (
            "K/V blocks around the ring (cp-1 hops forward and backward) and dK/dV (cp hops)"
            if ring
            else "K/V all-gathered over sequence (forward, backward) and dK/dV scattered home"
        )
        for kind, nbytes in permute_bytes(cfg).items():
            formula = "L·m·[2(cp-1)·kv_block + cp·dkv_block]" if ring else "L·m·(cp-1)·kv_block"
            terms.append(Term(kind, what, formula, nbytes, "sequence", "context"))
    if tp > 1:
        # b·s·h of one micro-batch (the device's part of the sequence under CP)
        act = c * t.micro_batch_size * (m.seq_len // mesh.sequence) * m.d_model
        per_block = 6 if m.remat == "full" else 4  # full remat repeats the forward's two
        # + embedding forward, LM head backward; a pipeline stage runs its layers
        n_ops = (per_block * m.n_layers // mesh.pipeline + 2) * accum
        what = f"activations b·s·h, {per_block} per block + embedding and LM head, per micro-batch"
        if cfg.parallel.sequence_parallel:
            for kind in ("all-gather", "reduce-scatter"):
                terms.append(
                    Term(
                        kind,
                        what + " (SP)",
                        f"{n_ops}·bsh(t-1)/t",
                        n_ops * _ring(act, tp),
                        "tensor",
                        "tp",
                    )  # fmt: skip
                )
        else:
            terms.append(
                Term(
                    "all-reduce",
                    what,
                    f"{n_ops}·2bsh(t-1)/t",
                    n_ops * _ring(act, tp, 2.0),
                    "tensor",
                    "tp",
                )  # fmt: skip
            )
    return terms


def pipeline_message_bytes(cfg: Config) -> float:
    """One point-to-point message of the pipeline: a micro-batch's residual stream on one
    device, rows x seq_len (/ tensor with SP) x d_model in the compute dtype."""

    d = sizes.dims(cfg)
    return float(d.c * d.X_res)


def _pipeline_terms(cfg: Config, grads: float, psi: int, dp_d: int, fs: int, zero: int):
    """mesh.pipeline > 1 (parallel/pipeline/executor.py): every gradient is reduced once, after the
    last micro-batch (ZeRO-2 too); the embedding, final norm and LM head, which every
    stage holds, sum over `pipeline` in the same all-reduce as over the data axes; and
    the activations and gradients cross the stage boundaries point to point."""

    p = cfg.mesh.pipeline
    psi_rest = sizes.param_elements(
        cfg, kind="compute", ignore=(FSDP,), where=lambda w: not w.startswith("['layers']")
    )
    rest = grads * psi_rest / psi  # grads: bytes of the psi weights' gradients
    layers = grads - rest
    terms = []
    if zero >= 1:
        terms.append(
            Term(
                "reduce-scatter",
                f"gradients over fsdp (ZeRO-{zero}, once per step)",
                "Ψ(N-1)/N",
                _ring(grads, fs),
                "fsdp",
                "hidden",
            )
        )
    shard = fs if zero >= 1 else 1
    over = "gradient shards" if zero >= 1 else "gradients"
    n = dp_d * (fs if zero == 0 else 1)
    if n > 1:
        terms.append(
            Term(
                "all-reduce",
                f"layer {over} over the data axes",
                "2Ψ_layers(N-1)/N",
                _ring(layers / shard, n, 2.0),
                "data",
                "hidden",
            )
        )
    terms.append(
        Term(
            "all-reduce",
            f"embedding, final norm, LM head {over} over data x pipeline",
            "2Ψ_rest(N·p-1)/(N·p)",
            _ring(rest / shard, n * p, 2.0),
            "data+pipeline",
            "hidden",
        )
    )
    if zero >= 1:
        weights = grads / units.dtype_bytes(cfg.parallel.grad_reduce_dtype)
        weights *= units.dtype_bytes(cfg.model.dtype)
        terms.append(_updated_gather(weights, fs))
    table = activations.pipeline_plan(cfg).table
    sends = sum(schedule.p2p_messages(table))
    terms.append(
        Term(
            "collective-permute",
            "activations down, gradients up the pipeline (each micro-batch crosses each "
            "stage boundary once each way)",
            "2·m·(v·p-1)/p·bsh",
            sends / p * pipeline_message_bytes(cfg),
            "pipeline",
            "p2p",
        )
    )
    return terms


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
    # any recomputation repeats the forward ring: no policy saves the attention's
    # log-sum-exp, so the backward reruns the whole custom_vjp forward
    forwards = 1 if m.remat == "none" else 2
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
