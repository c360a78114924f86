"""Where a train step's memory goes, per device, predicted from the config alone.

Nothing here traces the model or touches a device: the figures are closed forms in
the shapes (docs/memory.md derives each one), divided the way the mesh rules shard
them. `python -m ultrajax.analyze` prints them beside XLA's compiled figures.

A step's peak is what lives for the whole step (the arguments: master weights,
Adam moments, the batch) plus the largest of its phases' temporaries:
  - layer backward: the activations saved for backward (all layers), the gradient
    buffers, fp32 accumulators (grad_accum > 1), the compute-dtype copy of the
    weights where it is a separate array, and the working set of one layer's
    backward pass (its slice of the saved activations, recomputed ones, their
    gradients, the layer's weights and weight gradients);
  - head backward: the same saved activations, the gradient buffers, and the
    logits' working set (exp(logits), their gradient and its transposed copy);
  - layer forward (plain xla attention): the mask's hoisted broadcasts, and under
    recomputation the layer's scores and probabilities live again;
  - optimizer update: the fp32 gradients and the update's temporaries.

`estimate(cfg).parts` is the typed breakdown (`Breakdown`) that analyze's report, the
train summary and the planner read; display labels live where the text is printed.

With mesh.pipeline > 1 the executor's fixed buffers (parallel/pipeline.py) replace the
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
import functools
import math
from dataclasses import asdict, dataclass, field
from enum import StrEnum

import jax
import jax.numpy as jnp

from ultrajax import attention as attention_lib
from ultrajax import hardware
from ultrajax.config import Config, ModelConfig
from ultrajax.parallel.zero import Zero

GiB = 2**30

# One layer's backward working set, in copies of (per device):
#   S  b·a·s² fp32 attention scores     F  b·s·d_ff MLP hidden
#   X  b·s·h inside a TP region         R  b·s·h of the residual stream (/tp with SP)
#   K  b·s·kv·hd keys                   Wm h·d_ff one MLP matrix
#   Wa h·hd·(a + kv) attention weights  Z  the whole layer's weights, ZeRO-3 only
# Fitted by least squares over scripts/fit_memory.py's FIT_SHAPES (72 compiled shapes and
# layouts for these: fp32, XLA:CPU, one device, ZeRO-3, TP, TP+SP) and checked on its
# VALIDATION_SHAPES, kept apart; docs/memory.md. All but S count compute-dtype bytes.
# Z < 0 for `none`: under ZeRO-3 XLA reuses buffers the exact terms count.
WORK = {
    "none": {"X": 4.0, "R": 7.6, "K": 6.4, "Wm": 9.1, "Wa": 6.2, "Z": -1.7, "S": 2.0, "F": 2.6},
    "full": {"X": 4.6, "R": 7.1, "K": 9.1, "Wm": 2.7, "Wa": 0.5, "Z": 0.0, "S": 2.5, "F": 5.4},
    "selective": {"X": 2.7, "R": 4.8, "K": 0.0, "Wm": 3.7, "Wa": 1.8, "Z": 0.1, "S": 3.0, "F": 3.0},
}
ATTN_S = 3.75  # fitted: scores, probabilities, their gradient, a transposed copy (fp32)
# Not fitted, read off XLA:CPU's buffer assignment: from this many softmax rows (b·a·s per
# device) XLA:CPU's fusion writes the normalised probabilities as an fp32 array of their
# own instead of fusing the division into the consumer (the step lies between b·a·s =
# 4032 and 4096, whatever b, a or s), so a recomputing forward holds one more copy of the
# scores (s = 1008 -> 1040 at b = 1, a = 4: predicted/compiled 0.99 -> 0.81 without it)
SOFTMAX_ROWS_SPLIT = 4096
# mesh.sequence > 1, the ring's own working set beyond one layer's, in copies of a pair of
# chunks' fp32 scores (S) and of an fp32 b·s·a·hd (Q: the running output and dq); fitted
CP_WORK = {"S": 0.94, "Q": 4.54}
# attention tiled / blocked (memory-efficient, plain XLA: XLA:CPU's `auto`): the scores
# they hold while one layer's attention runs, in copies of kernel_features' units (T one
# row group's fp32 scores, P one key block's, M the bool masks of every block); fitted
KERNEL_WORK = {"T": 1.46, "P": 4.16, "M": 1.55}
HEAD_WORK_V = 2.0  # exp(logits) and d logits: fp32 b·s·v each
HEAD_WORK_X = 3.0  # final norm input, output and their gradient: b·s·h
OPT_WORK = 1.0  # fp32 parameter-sized temporaries of the AdamW update beyond the gradients
# mesh.pipeline > 1: the share of one layer's backward working set (layer_work, but its
# attention moment) live at a tick beside the chunk's residuals, and the copies of the fp32
# scores its attention backward holds; fitted on XLA:CPU, fp32 (scripts/fit_memory.py)
PIPE_WORK = {"none": 0.5, "full": 1.05, "selective": 1.0}
PIPE_ATTN_S = 3.0


def dtype_bytes(name: str) -> int:
    return jnp.dtype(name).itemsize


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def parse_bytes(text: str) -> int:
    """'80GB' (10^9), '80GiB' / '80G' (2^30), '85899345920': bytes, or ValueError."""
    units = {
        "": 1,
        "b": 1,
        "kb": 10**3,
        "mb": 10**6,
        "gb": 10**9,
        "tb": 10**12,
        "k": 2**10,
        "m": 2**20,
        "g": 2**30,
        "t": 2**40,
        "kib": 2**10,
        "mib": 2**20,
        "gib": 2**30,
        "tib": 2**40,
    }
    s = text.strip().lower().replace(" ", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num) :]
    if unit not in units or not num:
        raise ValueError(text)
    value = float(num) * units[unit]
    if not math.isfinite(value) or value <= 0:
        raise ValueError(text)
    return int(value)


def device_memory(device) -> tuple[int | None, str]:
    """(bytes of one device's memory, where the figure comes from), None where unknown."""
    try:
        stats = device.memory_stats() or {}
    except Exception:  # CPU backends may raise
        stats = {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), f"{device.device_kind}: memory_stats bytes_limit"
    kind = getattr(device, "device_kind", "")
    acc = hardware.lookup(kind)
    if acc is not None:
        return acc.memory, f"{kind} (nvidia-smi total)"
    return None, f"{kind or device.platform}: no device memory to compare against"


# --------------------------------------------------------------------------- sharding


def _axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _ways(cfg: Config, entry, ignore=()) -> int:
    """How many ways a rules-table entry splits a dimension on this mesh."""
    sizes = cfg.mesh.sizes() if hasattr(cfg.mesh, "sizes") else vars(cfg.mesh)
    return math.prod(sizes[a] for a in _axes(entry) if a not in ignore)


def _rules(cfg: Config):
    from ultrajax import mesh as mesh_lib

    return mesh_lib.rules(cfg)


_SHAPE_FIELDS = (
    "vocab_size",
    "d_model",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "d_ff",
    "head_dim",
    "tie_embeddings",
    "param_dtype",
)


@functools.lru_cache(maxsize=64)
def _param_leaves(key: tuple) -> tuple[tuple[str, tuple[int, ...], tuple[str, ...]], ...]:
    """(path, shape, logical names) of every parameter; traced abstractly, nothing allocated."""
    from ultrajax.model import init_params, logical_axes

    m = ModelConfig(**dict(zip(_SHAPE_FIELDS, key, strict=True)))
    shapes = jax.eval_shape(lambda: init_params(m, jax.random.key(0)))
    names = logical_axes(m)
    flat_s = jax.tree_util.tree_leaves_with_path(shapes)
    flat_n = jax.tree.leaves(names, is_leaf=lambda x: isinstance(x, tuple))
    return tuple(
        (jax.tree_util.keystr(p), tuple(s.shape), tuple(n))
        for (p, s), n in zip(flat_s, flat_n, strict=True)
    )


def _leaves(m: ModelConfig):
    return _param_leaves(tuple(getattr(m, f) for f in _SHAPE_FIELDS))


def shard_elements(cfg: Config, shape, names, kind: str, ignore=()) -> int:
    """Elements of one device's shard of a parameter under the rules' `kind` column."""
    table = getattr(_rules(cfg), kind)
    return math.prod(
        -(-dim // _ways(cfg, table.get(n), ignore)) for dim, n in zip(shape, names, strict=True)
    )


def param_elements(cfg: Config, kind: str = "stored", ignore=(), where=None) -> int:
    """Parameters held per device under the rules' `kind` column (stored | compute).

    `ignore` leaves mesh axes out (`("fsdp",)`: the size once gathered over fsdp);
    `where(path)` selects leaves."""
    return sum(
        shard_elements(cfg, shape, names, kind, ignore)
        for path, shape, names in _leaves(cfg.model)
        if where is None or where(path)
    )


def layer_weight_elements(cfg: Config, ignore=("fsdp",)) -> dict[str, int]:
    """One layer's compute weights per device (as used: gathered over fsdp)."""
    out = {"attn": 0, "mlp": 0, "norm": 0}
    for path, shape, names in _leaves(cfg.model):
        if not path.startswith("['layers']"):
            continue
        n = shard_elements(cfg, shape[1:], names[1:], "compute", ignore)
        key = "mlp" if "'w_" in path else "norm" if "norm" in path else "attn"
        out[key] += n
    return out


@dataclass(frozen=True)
class Dims:
    """Per-device activation sizes (elements) of one micro-batch."""

    b: int  # micro-batch rows on this device
    s: int  # sequence inside attention and MLP (the TP regions)
    s_res: int  # sequence of the residual stream and norms (s / tensor with SP)
    h: int
    a: int  # query heads on this device
    kv: int
    hd: int
    f: int  # d_ff on this device
    v: int  # vocabulary on this device
    L: int
    c: int  # bytes per element of the compute dtype

    @property
    def X(self) -> int:  # residual stream inside a TP region
        return self.b * self.s * self.h

    @property
    def X_res(self) -> int:
        return self.b * self.s_res * self.h

    @property
    def N(self) -> int:
        return self.b * self.s

    @property
    def N_res(self) -> int:
        return self.b * self.s_res

    @property
    def Q(self) -> int:
        return self.b * self.s * self.a * self.hd

    @property
    def K(self) -> int:
        return self.b * self.s * self.kv * self.hd

    @property
    def S(self) -> int:
        return self.b * self.a * self.s * self.s

    @property
    def F(self) -> int:
        return self.b * self.s * self.f

    @property
    def V(self) -> int:
        return self.b * self.s * self.v


def dims(cfg: Config) -> Dims:
    m, mesh = cfg.model, cfg.mesh
    tp = mesh.tensor
    s = m.seq_len // mesh.sequence
    return Dims(
        b=cfg.train.micro_batch_size,
        s=s,
        s_res=s // tp if cfg.parallel.sequence_parallel else s,
        h=m.d_model,
        a=m.n_heads // tp,
        kv=m.n_kv_heads // tp,
        hd=m.hd,
        f=m.d_ff // tp,
        v=m.vocab_size // tp,
        L=m.n_layers,
        c=dtype_bytes(m.dtype),
    )


# --------------------------------------------------------------------------- activations


def _policy(m: ModelConfig) -> str:
    return m.remat if isinstance(m.remat, str) else "list"


def saved_per_layer(cfg: Config) -> dict[str, float]:
    """Bytes one layer keeps for the backward pass, by part, per device.

    Derived from print_saved_residuals (tests/test_memory.py checks it exactly):
      no recompute:
        norms (x2): input and normalised output in fp32 (8·X), the matmul input
          in the compute dtype (c·X), two fp32 statistics per token (8·b·s) and
          the scale broadcast to (1, 1, h) in fp32;
        attention: rotated q and k, v, and the attention output (c·(2Q + 2K)),
          softmax probabilities in fp32 and cast for the PV matmul ((4 + c)·S),
          max and sum of the softmax per head and token (8·a·b·s);
        MLP: gate, up, sigmoid(gate), silu(gate), their product and a
          broadcast of it (6·c·F).
      full: the block input (c·X).
      selective: the block input, q, k, v, attention output, gate and up.
      a list of names: the block input and the named tensors.
    The block input is counted under norms.
    """
    d = dims(cfg)
    m = cfg.model
    c = d.c
    flash = _flash(cfg)  # the kernel keeps the log-sum-exp, never the scores
    block_input = c * d.X_res
    pol = _policy(m)
    if pol == "none":
        norms = 2 * (8 * d.X_res + c * d.X + 8 * d.N_res + 4 * d.h)  # + the broadcast scale
        if flash:
            attention = c * (2 * d.Q + 2 * d.K) + 4 * d.a * d.N
            if cfg.mesh.sequence == 1 and m.attention == "blocked":
                attention += c * d.Q  # its own `out` beside the one wo reads
            if cfg.mesh.sequence == 1 and m.attention == "tiled":
                attention += c * d.Q - 4 * d.a * d.N  # a head-major output, no log-sum-exp
        else:
            attention = c * (2 * d.Q + 2 * d.K) + (4 + c) * d.S + 8 * d.a * d.N
        return {"attention": attention, "mlp": 6 * c * d.F, "norms": norms}
    if pol in ("full", "offload"):
        return {"attention": 0.0, "mlp": 0.0, "norms": block_input}
    names = (
        {"query", "key", "value", "attn_out", "mlp_in", "mlp_out"}
        if pol == "selective"
        else set(m.remat)
    )
    attention = c * (
        d.Q * ("query" in names)
        + d.K * ("key" in names)
        + d.K * ("value" in names)
        + d.Q * ("attn_out" in names)
    )
    mlp = 2 * c * d.F * ("mlp_in" in names)
    return {"attention": attention, "mlp": mlp, "norms": block_input}


def offloaded_per_layer(cfg: Config) -> float:
    """remat=offload: bytes per layer moved to pinned host memory instead of kept."""
    if cfg.model.remat != "offload":
        return 0.0
    d = dims(cfg)
    return d.c * (2 * d.Q + 2 * d.K + 2 * d.F)


def invariant_activations(cfg: Config) -> float:
    """Saved once, not per layer, without recomputation: the attention mask (1 byte per
    score) and the rotary cos/sin tables (fp32, b·s·hd/2 each)."""
    d = dims(cfg)
    if _policy(cfg.model) != "none":
        return float(d.b * d.s * d.s)  # the causal/segment mask, recomputed per layer
    mask = 0 if _flash(cfg) else d.S
    return float(mask + 2 * 4 * d.N * d.hd // 2)


def work_features(cfg: Config) -> tuple[str, dict[str, float], dict[str, float]]:
    """(policy row of WORK, bytes per unit of each common coefficient, bytes per unit of
    each MLP-moment coefficient): layer_work is their dot product with WORK, so the
    coefficients can be fitted (scripts/fit_memory.py)."""
    d = dims(cfg)
    pol = _policy(cfg.model)
    if pol == "list":  # recomputing the MLP's inputs works like full, keeping them selective
        pol = "selective" if "mlp_in" in cfg.model.remat else "full"
    lw = layer_weight_elements(cfg)
    zero3 = cfg.parallel.zero >= 3 and cfg.mesh.fsdp > 1
    flash = _flash(cfg)
    common = {
        "X": d.c * (d.X - d.X_res),
        "R": d.c * d.X_res,
        "K": d.c * d.K,
        "Wm": d.c * lw["mlp"] / 3,
        "Wa": d.c * lw["attn"] / 2,
        "Z": d.c * (lw["mlp"] + lw["attn"]) * zero3,
    }
    mlp = {"S": 0.0 if flash else 4 * d.S, "F": d.c * d.F}
    return ("full" if pol == "offload" else pol), common, mlp


def layer_work(cfg: Config, share: float = 1.0, attn_s: float = ATTN_S) -> float:
    """One layer's backward working set (bytes per device), from the WORK table.

    Two moments compete: the MLP's backward (its hidden-size temporaries, with the
    layer's attention scores already sliced out or recomputed: the `S` coefficient),
    and the attention's backward (scores, probabilities, their gradients and a
    transposed copy: `attn_s` copies of the fp32 scores). The larger is the working set.
    `share` scales everything but the attention's moment (the pipeline's tick keeps a
    share of it: PIPE_WORK).
    """
    pol, common, mlp = work_features(cfg)
    coef = WORK[pol]
    d = dims(cfg)
    norms = layer_weight_elements(cfg)["norm"]
    attn = 0.0 if _flash(cfg) else attn_s * 4 * d.S
    if cfg.mesh.sequence > 1:  # context parallelism: one pair of chunks' fp32 scores at a
        # time, (s / 2cp)² = S / 4 with d.s = s / cp, unless a flash kernel runs the pair
        from ultrajax.parallel.context import pair_kernel

        attn = attn_s * d.S if pair_kernel(cfg, "cpu") == "xla" else 0.0
    # tiled / blocked attention (KERNEL_WORK): blocked's loop over key blocks is a moment
    # of its own, in place of the s² scores; tiled's row groups add to the layer's
    kernel = {k: KERNEL_WORK[k] * v for k, v in kernel_features(cfg).items()}
    attn += kernel["P"] + kernel["M"]
    base = sum(coef[k] * v for k, v in common.items()) + d.c * norms
    moment = max(share * sum(coef[k] * v for k, v in mlp.items()), attn)
    return share * base + moment + ring_work(cfg) + kernel["T"]


def mlp_moment(cfg: Config) -> float:
    """The MLP's moment of layer_work (the fit of KERNEL_WORK replaces it)."""
    pol, _common, mlp = work_features(cfg)
    return sum(WORK[pol][k] * v for k, v in mlp.items())


def ring_features(cfg: Config) -> dict[str, float]:
    """Context parallelism (mesh.sequence > 1): bytes per unit of each CP_WORK coefficient,
    S a pair of chunks' fp32 scores (b·a·(s/2)², s per device; none when a flash kernel
    runs the pair), Q an fp32 b·s·a·hd (the ring's running output and dq)."""
    if cfg.mesh.sequence == 1:
        return {"S": 0.0, "Q": 0.0}
    from ultrajax.parallel.context import pair_kernel

    d = dims(cfg)
    return {"S": d.S if pair_kernel(cfg, "cpu") == "xla" else 0.0, "Q": 4.0 * d.Q}


def kernel_features(cfg: Config) -> dict[str, float]:
    """The plain-XLA attentions that store no s² scores (attention.py's `tiled` and
    `blocked`: counted as flash kernels in what they save) still hold scores while one
    layer's attention runs: bytes per unit of each KERNEL_WORK coefficient.
      T  tiled: r·a·s² fp32, the scores of one row group (r rows per iteration of its
         loop: TILE_ROWS of this device's rows, all of them under the partitioner);
      P  blocked: b·a·s·min(s, BLOCK) fp32, the scores of one block of keys;
      M  blocked: b·a·s² bytes, the bool masks of every block (XLA:CPU hoists them out of
         the loop over blocks)."""
    out = {"T": 0.0, "P": 0.0, "M": 0.0}
    name = cfg.model.attention
    if cfg.mesh.sequence > 1 or name not in ("tiled", "blocked"):
        return out
    d = dims(cfg)
    if name == "tiled":
        shared = cfg.parallel.collectives == "gspmd" and math.prod(cfg.mesh.sizes().values()) > 1
        rows = min(attention_lib.TILE_ROWS, d.b)
        rows = d.b if shared or d.b % rows else rows
        out["T"] = 4.0 * rows * d.a * d.s * d.s
    else:
        out["P"] = 4.0 * d.b * d.a * d.s * min(d.s, attention_lib.BLOCK)
        out["M"] = float(d.S)
    return out


def ring_work(cfg: Config) -> float:
    """The ring's own working set beside one layer's (CP_WORK . ring_features)."""
    return sum(CP_WORK[k] * v for k, v in ring_features(cfg).items())


# --------------------------------------------------------------------------- pipeline


def pipeline_plan(cfg: Config):
    """The executor's plan (parallel/pipeline.py) of this config: its table and slots."""
    from ultrajax.parallel import pipeline

    par = cfg.parallel
    return pipeline.make_plan(
        par.pipeline_schedule, cfg.mesh.pipeline, cfg.train.grad_accum, par.virtual_stages
    )


def pipeline_saved_per_layer(cfg: Config) -> dict[str, float]:
    """Bytes of one layer's residuals in the pipeline's buffer, by part, per device: what
    one layer's `jax.vjp` keeps (parallel/residuals.py) and the compiled program does not
    drop (tests/test_memory.py reads them off the tick loop's carry).

    saved_per_layer's parts (the RMSNorm scale as a scalar, not broadcast), and:
      no recompute: the mask (bool b·a·s², both `where`s keep their own broadcast) and
        rotary cos/sin for q and k apart (fp32 4·b·s·hd/2 each), in every layer: the
        layer scan keeps these once (invariant_activations), one layer's vjp cannot
        share them, so 2 x invariant_activations per layer;
      under jax.checkpoint: what the policy saves, nothing more (the layer's weights and
        the zeros it is differentiated at are inputs the executor hands back).
    """
    m = cfg.model
    parts = dict(saved_per_layer(cfg))
    pol = _policy(m)
    if pol == "none":
        parts["norms"] -= 2 * 4 * m.d_model  # the scale stays a scalar residual
        parts["masks and rotary tables"] = 2 * invariant_activations(cfg)
        return parts
    return parts


def zero_bubble_pairs_per_layer(cfg: Config) -> float:
    """Bytes per layer zero bubble's input step keeps for its weight step: each weight's
    (input, output cotangent) (weights.Deferred). The seven matmuls' in the compute
    dtype: wq (X, Q), wk and wv (K; they share wq's input), wo (Q, X), w_gate (X, F),
    w_up (F; w_gate's input), w_down (F, X); the two RMSNorm scales' (y, dy) in fp32 on
    the residual stream."""
    d = dims(cfg)
    return d.c * (4 * d.X + 2 * d.Q + 2 * d.K + 3 * d.F) + 2 * 2 * 4 * d.X_res


def pipeline_buffers(cfg: Config) -> dict[str, float]:
    """Bytes per device of the executor's buffers (parallel/pipeline.py `run`), each with
    its spare slot: the residuals of (slots + 1) micro-batch chunks of n_layers / (p v)
    layers, the arriving activations and gradients (b·s·h each, compute dtype), and
    zero bubble's (input, cotangent) pairs per chunk (one b·s·h slot otherwise)."""
    m, plan = cfg.model, pipeline_plan(cfg)
    d = dims(cfg)
    per_chunk = m.n_layers // (plan.p * plan.v)
    x = d.c * d.X_res
    layers = (plan.slots["res"] + 1) * per_chunk
    out = {k: layers * v for k, v in pipeline_saved_per_layer(cfg).items()}
    out["arriving activations"] = (plan.slots["act"] + 1) * x
    out["arriving gradients"] = (plan.slots["grad"] + 1) * x
    if plan.kind == "zb-h1":
        pairs = zero_bubble_pairs_per_layer(cfg)
        out["weight-step pairs (zb-h1)"] = (plan.slots["cot"] + 1) * per_chunk * pairs
    else:
        out["unused cotangent slot"] = x
    return out


# --------------------------------------------------------------------------- the estimate


class Phase(StrEnum):
    """The phases of a step whose temporaries compete for the peak (docs/memory.md)."""

    LAYER_BACKWARD = "layer backward"
    LAYER_FORWARD = "layer forward"
    HEAD_BACKWARD = "head backward"
    PIPELINE_TICK = "pipeline tick"
    GRADIENT_REDUCTION = "gradient reduction"
    OPTIMIZER_UPDATE = "optimizer update"


AFTER_BACKWARD = (Phase.OPTIMIZER_UPDATE, Phase.GRADIENT_REDUCTION)


@dataclass(frozen=True)
class Breakdown:
    """Bytes per device by what they hold: the typed breakdown the report (analyze.py),
    the train summary and the planner read. Display text lives where it is printed."""

    master: float = 0.0  # master weights, model.param_dtype (an argument)
    optimizer: float = 0.0  # Adam mu, nu (an argument; mu is fp32 whatever param_dtype)
    batch: float = 0.0  # the batch, five int32 fields (an argument)
    compute_copy: float = 0.0  # the model.dtype copy of the weights, where a separate array
    gradients: float = 0.0  # fp32 gradients, reduced (pipeline: after the ticks)
    accumulators: float = 0.0  # fp32 running sums over micro-batches
    embed_grad: float = 0.0  # the whole fp32 embedding gradient beyond its shard (ZeRO >= 1)
    head_copy: float = 0.0  # ZeRO-3: the LM head's gathered copy beyond its shard
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


def concrete(cfg: Config, platform: str | None = None) -> Config:
    """The config with `model.attention` resolved for `platform` (default: this process's
    backend): the memory model needs to know whether the scores are stored."""
    platform = platform or jax.default_backend()
    name = attention_lib.resolve(
        cfg.model.attention, platform, cfg.data.cross_doc_mask, cfg.model.seq_len
    )
    if name == cfg.model.attention:
        return cfg
    cfg = copy.deepcopy(cfg)
    cfg.model.attention = name
    return cfg


def _flash(cfg: Config) -> bool:
    """Whether the attention never stores the s² scores (a flash kernel; context
    parallelism's ring and all-gather keep only each pair of chunks' log-sum-exp)."""
    if cfg.mesh.sequence > 1:
        return True
    return attention_lib.BACKENDS[concrete(cfg).model.attention].flash


def estimate(cfg: Config, platform: str | None = None) -> Estimate:
    """The analytic memory of one train step per device (see the module docstring), for
    the attention `model.attention` means on `platform` (default: this backend)."""
    cfg = concrete(cfg, platform)
    m, t, zero = cfg.model, cfg.train, cfg.parallel.zero
    fsdp = cfg.mesh.fsdp
    d = dims(cfg)
    pb = dtype_bytes(m.param_dtype)
    c = d.c
    stored = param_elements(cfg, "stored")
    compute = param_elements(cfg, "compute")  # ZeRO-3: sharded over fsdp
    head_elems = param_elements(cfg, "compute", where=lambda p: "lm_head" in p)
    # the five int32 fields of batch.Batch, (grad_accum, rows, seq_len) each
    batch = 5 * 4 * t.grad_accum * d.b * (m.seq_len // cfg.mesh.sequence)
    states = dict(
        master=pb * stored,
        optimizer=(4 + pb) * stored,  # mu is fp32 (optim.py)
        batch=batch,
    )
    arguments = (2 * pb + 4) * stored + batch + 8  # + step counter and Adam's count
    outputs = 4 * 4  # loss, grad_norm, lr, n_targets

    # the compute-dtype copy: a separate array when the dtype differs, or when ZeRO-1/2
    # all-gather the (sharded) masters into a whole copy
    z = Zero(zero, fsdp)
    copy = c * compute if (c != pb or (z.active in (1, 2))) else 0.0
    # model.loss_chunk: the logits of one chunk of the sequence at a time (ultrajax/loss.py)
    chunk = m.loss_chunk / m.seq_len if 0 < m.loss_chunk < m.seq_len else 1.0
    head_work = HEAD_WORK_V * 4 * d.V * chunk + HEAD_WORK_X * c * d.X
    if cfg.mesh.pipeline > 1:
        return _pipelined(cfg, states, arguments, outputs, copy, head_work)
    # gradients leave each weight's backward rule in fp32, reduced (ultrajax/weights.py):
    # ZeRO >= 1 scatters them per layer, so only shards are kept; before the last
    # micro-batch ZeRO-0/1 accumulate whole, unreduced gradients (parallel/data.py)
    whole = param_elements(cfg, "compute", ignore=("fsdp",))
    final = stored if z.active >= 1 else whole
    acc_elems = stored if z.active >= 2 else whole
    grads = 4.0 * final
    accum = 4.0 * acc_elems if t.grad_accum > 1 else 0.0

    activations = {part: d.L * nbytes for part, nbytes in saved_per_layer(cfg).items()}
    activations["masks and rotary tables"] = invariant_activations(cfg)
    saved = sum(activations.values())
    work = layer_work(cfg)

    # the embedding's gradient is a whole fp32 table through the backward pass (read twice
    # when tied, it is reduced after it): beyond the shard kept under ZeRO >= 1; ZeRO-3
    # also holds the LM head's whole copy until the head's backward is done
    def beyond_shard(name, nbytes):
        def where(p):
            return p == f"['{name}']"

        full = param_elements(cfg, "compute", ignore=("fsdp",), where=where)
        return nbytes * (full - param_elements(cfg, "stored", where=where))

    embed_full = beyond_shard("embed", 4) if z.active >= 1 else 0.0
    head_full = beyond_shard("lm_head", c) if z.shards_params and z.active else 0.0
    kept = copy + grads + accum + embed_full
    phases = {Phase.LAYER_BACKWARD: saved + kept + work}
    if not _flash(cfg):
        # XLA hoists the mask's broadcasts out of the layer loop: two fp32 and one bool
        # array of scores' size; under remat the layer's scores and probabilities are live
        # again on top of them during the forward pass, and XLA:CPU writes the normalised
        # probabilities as a third fp32 array once the softmax has SOFTMAX_ROWS_SPLIT rows
        recompute = _policy(m) != "none"
        hoisted = (2 * 4 + 1) * d.S + (2 * 4 * d.S if recompute else 0)
        if recompute and d.b * d.a * d.s >= SOFTMAX_ROWS_SPLIT:
            hoisted += 4 * d.S
        phases[Phase.LAYER_FORWARD] = saved + kept + hoisted
    phases[Phase.HEAD_BACKWARD] = saved + kept - c * head_elems + head_work + head_full
    grads_f32 = 4.0 * stored  # after the reduction: the optimizer's input
    phases[Phase.OPTIMIZER_UPDATE] = grads_f32 + OPT_WORK * 4 * stored
    parts = Breakdown(
        **states,
        compute_copy=copy,
        gradients=grads,
        accumulators=accum,
        embed_grad=embed_full,
        head_copy=head_full,
        saved=saved,
        head_work=head_work,
        work=work,
    )
    host = d.L * offloaded_per_layer(cfg)
    return Estimate(parts, activations, phases, arguments, outputs, host)


def _pipelined(cfg: Config, states, arguments, outputs, copy, head_work) -> Estimate:
    """mesh.pipeline > 1 (parallel/pipeline.py): the executor's buffers replace the saved
    activations, every device holds one stage's layers and the whole embedding, final
    norm and LM head, and no gradient is reduced before the last micro-batch is done.

    Phases: a tick (the buffers, the fp32 accumulators, one chunk's residuals being read
    or written, and one layer's backward working set, PIPE_WORK of it beside the
    attention's PIPE_ATTN_S copies of the scores); the last stage's head (the logits'
    working set instead of the chunk's); then the reduction and the optimizer."""
    m = cfg.model
    z = Zero(cfg.parallel.zero, cfg.mesh.fsdp)
    plan = pipeline_plan(cfg)
    stored = param_elements(cfg, "stored")
    whole = param_elements(cfg, "compute", ignore=("fsdp",))
    # fp32 sums of every weight this device holds, whole over fsdp (a tied embedding's
    # lookup and LM head add into one)
    accum = 4.0 * whole
    grads = 4.0 * (stored if z.active >= 1 else whole)
    activations = pipeline_buffers(cfg)
    saved = sum(activations.values())
    per_chunk = m.n_layers // (plan.p * plan.v)
    host = (plan.slots["res"] + 1) * per_chunk * offloaded_per_layer(cfg)
    # a chunk of several layers stacks its residuals before they go into their slot
    chunk_res = per_chunk * sum(pipeline_saved_per_layer(cfg).values()) if per_chunk > 1 else 0
    work = layer_work(cfg, PIPE_WORK[work_features(cfg)[0]], PIPE_ATTN_S)
    kept = copy + accum
    phases = {
        Phase.PIPELINE_TICK: saved + kept + chunk_res + work,
        Phase.HEAD_BACKWARD: saved + kept + head_work,
        Phase.GRADIENT_REDUCTION: accum + grads,
        Phase.OPTIMIZER_UPDATE: 4.0 * stored + OPT_WORK * 4 * stored,
    }
    parts = Breakdown(
        **states,
        compute_copy=copy,
        gradients=grads,
        accumulators=accum,
        saved=saved,
        chunk_residuals=chunk_res,
        head_work=head_work,
        work=work,
    )
    return Estimate(parts, activations, phases, arguments, outputs, host, pipelined=True)


def summary_lines(cfg: Config, measured_peak: int | None = None) -> list[str]:
    """Lines for train.py's summary: the predicted per-device breakdown beside the
    backend's measured peak (device.memory_stats on GPU), where there is one."""
    e = estimate(cfg)
    p = e.parts
    after = e.peak_phase in AFTER_BACKWARD
    work = e.temp if after else e.temp - p.saved - e.held
    lines = [
        f"  predicted    {fmt_bytes(e.peak)} per device at the {e.peak_phase}: weights + Adam "
        f"{fmt_bytes(e.weights)}, gradients and copies {fmt_bytes(e.held)}, saved activations "
        f"{fmt_bytes(p.saved)}, working set {fmt_bytes(work)} (python -m ultrajax.analyze)"
    ]
    if measured_peak:
        lines.append(f"  predicted / measured peak  {e.peak / measured_peak:.2f}")
    return lines
