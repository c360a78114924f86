"""The vocabulary tables' gradients: where the lookup's and the LM head's are made,
held and reduced, the terms memory.py's phases add for them (docs/memory.md). Closed
forms in the config, per device, read off XLA's buffer assignment."""

from __future__ import annotations

from ultrajax.config.schema import Config
from ultrajax.config.validate import auto_loss_chunk
from ultrajax.cost.sizes import dims, param_elements
from ultrajax.model import llama
from ultrajax.parallel.axes import FSDP
from ultrajax.parallel.layout import partitioned
from ultrajax.parallel.zero import Zero


def loss_chunk(cfg: Config) -> int:
    """model.loss_chunk, 0 where the head and loss run whole: the logits of one chunk of
    the sequence at a time (ultrajax/model/loss.py); null in a config that skipped
    validation is what validation would resolve it to."""
    m = cfg.model
    c = auto_loss_chunk(cfg) if m.loss_chunk is None else m.loss_chunk
    return c if 0 < c < m.seq_len else 0


def whole(cfg: Config, parts: tuple[str, ...]) -> int:
    """Elements of these parts of the model per device once gathered over fsdp."""
    return param_elements(cfg, "compute", ignore=(FSDP,), where=lambda p: p.part in parts)


def beyond_shard(cfg: Config, part: str, nbytes: int) -> float:
    """Bytes of the whole (gathered over fsdp) parameters of `part` beyond this device's
    shard of them."""

    def where(p):
        return p.part == part

    full = param_elements(cfg, "compute", ignore=(FSDP,), where=where)
    return nbytes * (full - param_elements(cfg, "stored", where=where))


def lookup_made_after(cfg: Config) -> bool:
    """Whether the embedding lookup's gradient is made after the layers' backward: an
    untied table, the code each device's own (model/ops.py's lookup rule reads its zeros
    off the cotangent). A tied table's is held through the backward, and where the
    partitioner splits the step its zeros are a constant XLA builds before it."""
    return not cfg.model.tie_embeddings and not partitioned(cfg)


def lookup_after(cfg: Config) -> bool:
    """Whether the step ends with its own phase for the lookup's gradient: made after the
    layers' backward, whole, and reduce-scattered over fsdp (ZeRO >= 1)."""
    return Zero(cfg.parallel.zero, cfg.mesh.fsdp).active >= 1 and lookup_made_after(cfg)


def lookup_backward(cfg: Config, copy: float, held: dict[str, float]) -> float:
    """After the layers' backward: the lookup's whole fp32 gradient (its zeros and the
    scatter into them one buffer) and, for the reduce-scatter over fsdp along the
    embedding axis, a transposed copy of it, beside the copies, the running sum and the
    other gradients; not yet its own reduced shard where the gradients are buffers apart
    from the sum (the scatter writes it), nor a chunked loss's whole head gradient
    (reduced by then). ZeRO-1 with accumulation adds the lookup's into the whole running
    sum in place, and the sum is copied for its reduce-scatter where the earlier
    micro-batches run in a loop (3 or more; with 2 the loop is inlined and no copy was
    seen). Read off XLA:CPU's buffers (vocabulary 32768 beside d_model 64, fsdp 8: 1.86
    to 2.0 tables beyond the rest; ZeRO-1 with accumulation 1.06, 0.03 with 2)."""
    table = 4.0 * whole(cfg, (llama.EMBEDDING,))
    stored = param_elements(cfg, "stored", where=lambda p: p.part == llama.EMBEDDING)
    own = 4.0 * stored if held["gradients"] else 0.0
    rest = copy + held["gradients"] - own + held["accumulators"]
    if cfg.train.grad_accum > 1 and Zero(cfg.parallel.zero, cfg.mesh.fsdp).active == 1:
        return rest + table * (cfg.train.grad_accum > 2)
    return rest + 2 * table


def reduced_whole(cfg: Config, platform: str) -> bool:
    """Whether the partitioner's reductions of the weight gradients are all-reduces with
    whole results, then sliced to this device's shard: gspmd, ZeRO-2/3 over data and fsdp
    alone, an untied table and the whole loss, on XLA:CPU, which has no pass to rewrite
    the pair into a reduce-scatter (XLA:GPU's ReduceScatterCreator does; its buffers are
    not read yet, so a GPU keeps explicit's terms). Read off XLA:CPU's buffer assignment
    (vocabulary 32768 beside d_model 64, and 8192 beside 1024, fsdp 8, 1 to 4
    micro-batches): each micro-batch's whole fp32 head gradient and each layer's are
    all-reduced into a second whole buffer; the lookup's gradient is made from the
    shards (no whole table); under ZeRO-3 the head is gathered inside the micro-batch
    loop and the embedding never (ZeRO-2: both gathers hoisted out of it, as explicit's)."""
    sizes = cfg.mesh.sizes()
    alone = all(v == 1 for k, v in sizes.items() if k not in ("data", FSDP))
    return (
        platform == "cpu"
        and cfg.parallel.collectives == "gspmd"
        and Zero(cfg.parallel.zero, cfg.mesh.fsdp).active >= 2
        and alone
        and not cfg.model.tie_embeddings
        and not loss_chunk(cfg)
    )


def head_all_reduce(cfg: Config, kept: float, head_copy: float, held: dict) -> float:
    """The head backward of `reduced_whole`: beside what is kept (the saved
    activations, the copies, the gradient shards and the running sum) its larger moment,
    the head's gradient made (the gathered head where not held through the step, one fp32
    logits gradient and the whole fp32 head gradient) or reduced (that gradient and the
    all-reduce's whole result)."""
    grad = 4.0 * whole(cfg, (llama.HEAD,))
    kept += held["gradients"] + held["accumulators"] + held["embed_grad"]
    return kept + max(head_copy + 4.0 * dims(cfg).V + grad, 2 * grad)
