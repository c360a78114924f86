"""The parallel layout of a step, decided once: which mesh axes the step's code is manual
over, the specs of every parameter copy, the ZeRO stage, the tensor-parallel boundaries and
the gradient plan. The step composes what this hands it; nothing else asks the config.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from ultrajax.config.no_effect import layer_loop
from ultrajax.config.schema import Config
from ultrajax.model import fp8, remat
from ultrajax.model.attention import backends as attention_lib
from ultrajax.model.llama import fp8_weights, logical_axes
from ultrajax.parallel import grads as grads_lib
from ultrajax.parallel.axes import (
    AXES,
    DATA,
    DATA_AXES,
    EXPERT,
    FSDP,
    PIPELINE,
    SEQUENCE_AXIS,
    TENSOR,
    TOKEN_AXES,
)
from ultrajax.parallel.context import Context, KernelRegion, pair_kernel
from ultrajax.parallel.expert import Experts
from ultrajax.parallel.grads import Gradients
from ultrajax.parallel.mesh import Rules, entry_axes, only_axes
from ultrajax.parallel.partitioned import Partitioned
from ultrajax.parallel.tensor import TensorParallel
from ultrajax.parallel.zero import Zero, prefetches


def unsupported(cfg: Config, backend: str) -> str | None:
    """Why this step cannot compile on `backend`, or None."""
    p = cfg.parallel
    if p.diloco_steps and p.collectives == "gspmd":  # the config's validation refuses it
        return "DiLoCo runs in the explicit step only (each rank reads its own replica there)"
    if backend == "cpu" and cfg.mesh.sequence > 1 and pair_kernel(cfg, backend) == "pallas":
        return (
            f"model.attention={cfg.model.attention} under context parallelism (mesh.sequence="
            f"{cfg.mesh.sequence}) runs the ring's pairs in the Pallas kernel, whose CPU "
            "interpreter fails JAX's varying-axes check inside the step; on a CPU use "
            "model.attention=auto (plain XLA pairs): on a GPU the kernel runs them"
        )
    if not partly_manual(cfg):
        return None
    where = (
        "with parallel.collectives=gspmd, the step manual over "
        f"{', '.join(sorted(manual_axes(cfg, cfg.mesh.sizes())))} and the partitioner's over "
        "the other axes"
    )
    if backend == "gpu" and cfg.model.attention == "cudnn":
        return (
            f"model.attention=cudnn {where}: jax's partitioning of cuDNN's call fails to "
            "compile there; use model.attention=auto (our Pallas kernel) or "
            "parallel.collectives=explicit"
        )
    if backend == "cpu" and p.grad_reduce_dtype == "bfloat16":
        return (
            f"parallel.grad_reduce_dtype=bfloat16 {where}, aborts XLA's CPU compiler (a bf16 "
            "all-reduce in a partly manual shard_map); on a CPU use "
            "parallel.collectives=explicit or grad_reduce_dtype=float32"
        )
    return None


def manual_axes(cfg: Config, sizes: dict, grads: bool = True) -> frozenset:
    """The mesh axes (of `sizes`, the mesh's) the step's code is manual over: every axis
    wider than one under explicit collectives; under gspmd only where accumulation defers
    a data reduction: ZeRO-0/1 over the token axes, ZeRO-2/3 over `data` and `sequence`
    when there are micro-batches to defer over (their fsdp reduce-scatter is due every
    micro-batch: the partitioner's); elsewhere context parallelism goes manual over
    `sequence` inside attention alone (Shardy rejects that nested shard_map inside one
    manual over the data axes)."""
    big = frozenset(a for a in AXES if sizes[a] > 1)
    if cfg.parallel.collectives != "gspmd":
        return big
    if Zero(cfg.parallel.zero, sizes[FSDP]).active <= 1:
        owed = frozenset(TOKEN_AXES) if big & set(DATA_AXES) else frozenset()
    else:
        # not with fsdp and tensor both left to the partitioner: XLA aborts on that
        # partly manual program (spmd_partitioner_util.cc:497, jax 0.10); there the
        # data reduction runs every micro-batch
        many = cfg.train.grad_accum > 1 and DATA in big and not {FSDP, TENSOR} <= big
        owed = frozenset(a for a in TOKEN_AXES if a != FSDP) if many else frozenset()
    if EXPERT in big:  # expert parallelism's all-to-all runs per device (expert.py)
        owed = frozenset(TOKEN_AXES)
    needed = big & owed if grads or EXPERT in big else frozenset()
    if sizes[PIPELINE] > 1:  # the schedule runs per device; its data reductions wait
        needed = big & frozenset((*TOKEN_AXES, PIPELINE))
    return needed


def partitioned(cfg: Config) -> bool:
    """Whether XLA's partitioner splits the step's arrays over some axis (gspmd with TP or
    SP, ...): there the step's code is not each device's own (kernels/varying.py,
    partitioned_axes, asks the same inside the trace)."""
    sizes = cfg.mesh.sizes()
    return not frozenset(a for a in AXES if sizes[a] > 1) <= manual_axes(cfg, sizes)


def partly_manual(cfg: Config) -> bool:
    """Whether the step's code runs in a shard_map manual over some mesh axes while the
    partitioner splits it over others (gspmd: the data axes manual for a deferred
    reduction or the experts' exchange, beside TP, SP or fsdp left to the partitioner).
    Where every axis wider than one is manual the region is made manual over the
    one-wide axes too (`Layout.axis_names`). Compiled for H200s on a CPU host, jax 0.10:
    jax's custom partitioning, cuDNN attention's, fails in a partly manual region
    (AssertionError over one-wide auto axes; with TP left to the partitioner, its rule
    reads a GSPMDSharding's missing spec, and given the mesh XLA's partitioner aborts)."""
    gspmd = cfg.parallel.collectives == "gspmd"
    return gspmd and bool(manual_axes(cfg, cfg.mesh.sizes())) and partitioned(cfg)


def attention_backend(cfg: Config, platform: str) -> str:
    """The attention backend `model.attention` means for this run on `platform`
    (model/attention/backends.py `resolve`, told whether the step is `partly_manual`)."""
    m = cfg.model
    return attention_lib.resolve(
        m.attention, platform, cfg.data.cross_doc_mask, m.seq_len, partly_manual(cfg)
    )


def splits_last(cfg: Config) -> bool:
    """`Gradients.splits_last` from the config alone (the memory model asks): whether the
    last micro-batch reduces apart from the others, in a program of its own."""
    sizes = cfg.mesh.sizes()
    zero = Zero(cfg.parallel.zero, sizes[FSDP])
    return grads_lib.splits_last(cfg.train.grad_accum, zero, manual_axes(cfg, sizes))


def _is_names(x) -> bool:
    return isinstance(x, tuple)


def _ordered_weights(cfg: Config, mesh, names: dict) -> frozenset:
    """The layer weights whose reduced gradients are made before their input's gradient
    leaves (model/ops.py `ordered`): every one when the layers run as a Python loop on
    several devices, but the MLP's down projection under a policy that keeps the MLP's
    inputs, whose barrier would split the SwiGLU's recomputation from its backward.
    Compiled for an H200, the 1B step over data 8: full recomputation 34.04 -> 19.95 GiB,
    none the same peak and 9 GiB a step less moved, selective 33.59 -> 31.29 GiB for 2.9
    GiB a step more (10.9 with the down projection ordered too; docs/memory.md)."""
    if not layer_loop(cfg) or math.prod(mesh.shape.values()) == 1:
        return frozenset()
    m = cfg.model
    split = m.remat != "none" and remat.MLP_IN in remat.kept_tags(m.remat)
    return frozenset(names["layers"]) - ({"w_down"} if split else set())


class Layout:
    """Everything the step needs to know about the layout, decided once."""

    def __init__(self, cfg: Config, mesh, rules: Rules, *, grads: bool = True):
        self.cfg, self.mesh, self.rules = cfg, mesh, rules
        self.names = logical_axes(cfg.model)
        self.zero = Zero(cfg.parallel.zero, mesh.shape[FSDP])
        self.gspmd = cfg.parallel.collectives == "gspmd"
        self.replicas = grads and cfg.parallel.diloco_steps > 0  # DiLoCo's train step
        self.pipeline = mesh.shape[PIPELINE]
        self.manual = manual_axes(cfg, dict(mesh.shape), grads=grads)
        self.cp = Context(
            mesh.shape[SEQUENCE_AXIS],
            cfg.parallel.context,
            cfg.parallel.context_zigzag,
            own_shard_map=SEQUENCE_AXIS not in self.manual,
            kernel=pair_kernel(cfg, jax.default_backend()) if cfg.mesh.sequence > 1 else "xla",
            blocks=None if (b := cfg.model.attention_blocks) is None else tuple(b),
            fused_bwd=cfg.model.attention_backward == "fused",
            partly_manual=partly_manual(cfg),
        )
        # explicit: manual over every axis, the one-wide ones too (their specs name none of
        # them, so nothing varies over them): a partially manual shard_map puts sharding
        # annotations into collectives' reducers, and XLA:CPU aborts on a bf16 all-reduce
        # of such (AllReducePromotion)
        # gspmd: as explicit where every axis wider than one is manual (nothing is left to
        # the partitioner), so that no region is partly manual (`partly_manual`)
        whole = self.manual and not partly_manual(cfg)
        self.axis_names = frozenset(AXES) if whole or not self.gspmd else self.manual
        self.specs = {k: self._specs(k) for k in ("stored", "compute")}
        self.gathered = self._specs("compute", drop=FSDP)
        if self.gspmd and FSDP in self.manual:
            # ZeRO-3 under a step manual over fsdp (expert parallelism): the partitioner
            # gathers all but the layers, which `gather_layer` gathers per device
            self.specs["compute"] = dict(self.gathered, layers=self.specs["compute"]["layers"])
        inner = rules.inside(self.axis_names) if self.manual else rules
        if self.gspmd:  # the GPU kernels' own shard_map over the partitioner's axes
            self.cp = dataclasses.replace(self.cp, region=self._kernel_region(inner))
        self.tp = (
            Partitioned(inner, join_inputs=mesh.shape[TENSOR] > 1)
            if self.gspmd
            else TensorParallel(mesh.shape[TENSOR], cfg.parallel.sequence_parallel)
        )
        auto_specs = None
        if self.gspmd:  # the partitioner gives each reduced gradient its final layout
            auto = frozenset(AXES) - self.axis_names
            # the state's layout (ZeRO: this rank's shard; a pipeline's embedding and head:
            # this stage's split of the vocabulary)
            flat = _flat_specs(self.specs["stored"])
            auto_specs = {
                k: only_axes(PartitionSpec(*s[1:]) if k.startswith("layers/") else s, auto)
                for k, s in flat.items()
            }
        self.grads = Gradients(
            self.zero,
            self.manual,
            self.names,
            cfg.parallel.grad_reduce_dtype,
            auto_specs,
            cfg.train.grad_accum,
            after=("embed", "lm_head")
            if 0 < (cfg.model.loss_chunk or 0) < cfg.model.seq_len
            else ("embed",),
            prefetch=prefetches(cfg),
            fp8=fp8_weights(cfg.model) if cfg.model.fp8 == "delayed" else (),
            # DiLoCo's replicas keep their own; each pipeline stage has its own layers' rows
            fp8_apart=frozenset({DATA} if self.replicas else ())
            | frozenset({PIPELINE} if self.pipeline > 1 else ()),
            ordered=_ordered_weights(cfg, mesh, self.names),
        )

    def _kernel_region(self, inner: Rules) -> KernelRegion | None:
        """`Context.region`: the axes the partitioner splits the attention over and its
        operands' layouts there; none where the step is manual over every axis wider than
        one."""
        axes = frozenset(AXES) - (self.axis_names if self.manual else frozenset())
        if all(self.mesh.shape[a] == 1 for a in axes):
            return None
        q = inner.spec(("batch", "length", "heads", "head_dim"))
        kv = inner.spec(("batch", "length", "kv_heads", "head_dim"))
        return KernelRegion(axes, q, kv, inner.spec(("batch", "length")))

    def _specs(self, kind, drop=None):
        specs = jax.tree.map(lambda n: self.rules.spec(n, kind), self.names, is_leaf=_is_names)
        if drop:
            specs = jax.tree.map(
                lambda s: PartitionSpec(*(None if e == drop else e for e in s)),
                specs,
                is_leaf=lambda x: isinstance(x, PartitionSpec),
            )
        return specs

    def manual_specs(self, specs):
        return jax.tree.map(
            lambda s: only_axes(s, self.manual),
            specs,
            is_leaf=lambda x: isinstance(x, PartitionSpec),
        )

    def shard_map(self, fn, in_specs, out_specs):
        """fn per device over the manual axes, with JAX's varying-axes check on."""
        if not self.manual:
            return fn
        return jax.shard_map(
            fn,
            mesh=self.mesh,
            in_specs=self.manual_specs(in_specs),
            out_specs=self.manual_specs(out_specs),
            axis_names=self.axis_names,
            check_vma=True,
        )

    @property
    def token_axes(self) -> tuple[str, ...]:
        """The manual axes that split one model's tokens (its loss, its target count, an
        MoE layer's balance): all of TOKEN_AXES, but `data` in DiLoCo's train step, whose
        ranks are replicas training apart (parallel/diloco.py; evaluation reads the outer
        parameters, one model)."""
        apart = (DATA,) if self.replicas else ()
        return tuple(a for a in TOKEN_AXES if a in self.manual and a not in apart)

    def psum(self, x):
        axes = self.token_axes
        return jax.lax.psum(x, axes) if axes else x

    @property
    def ep(self) -> Experts:
        """The MoE layers' boundary: counts over the ranks that split the tokens, and the
        experts over `expert` (manual wherever it is wider than one)."""
        axes = self.token_axes
        return Experts(
            micro_batches=self.cfg.train.grad_accum,
            ranks=math.prod(self.mesh.shape[a] for a in axes),
            token_axes=axes,
            expert_ranks=self.mesh.shape[EXPERT],
            copies=self.mesh.shape[TENSOR] if TENSOR in self.manual else 1,
            copy_axis=TENSOR if TENSOR in self.manual and self.mesh.shape[TENSOR] > 1 else None,
        )

    # ---------------------------------------------------------------- compute copy

    def compute_copy(self, params):
        """The compute-dtype weights the forward reads, from the master weights.

        Cast first, so every weight all-gather moves the compute dtype. explicit: the
        ZeRO-1/2 gather is written out here (once a step); ZeRO-3 gathers the layers
        inside the layer scan (`gather_layer`) and the rest here. gspmd: a sharding
        constraint asks the partitioner for the compute layout. The embedding and head
        stored over `pipeline` (mesh.vocab_over_pipeline) are gathered over it here in
        either mode, once a step."""
        dtype = jnp.dtype(self.cfg.model.dtype)
        cast = jax.tree.map(lambda p: p.astype(dtype), params)
        if self.gspmd:
            sh = jax.tree.map(
                lambda s: NamedSharding(self.mesh, s),
                self.specs["compute"],
                is_leaf=lambda x: isinstance(x, PartitionSpec),
            )
            # the barrier keeps the cast on the shards: without it the partitioner
            # gathers the fp32 masters and casts after (twice the bytes)
            return jax.lax.with_sharding_constraint(jax.lax.optimization_barrier(cast), sh)
        cast = jax.tree.map(
            _gather_pipeline,
            cast,
            self.specs["stored"],
            self.specs["compute"],
            is_leaf=lambda x: isinstance(x, PartitionSpec),
        )
        if not self.zero.active:
            return cast
        out = {}
        for k, w in cast.items():
            if k == "layers" and self.zero.shards_params:
                out[k] = w
            else:
                out[k] = jax.tree.map(self.zero.gather, w, self.names[k], is_leaf=_is_names)
        return out

    @property
    def gathered_over(self) -> str | None:
        """The mesh axis ZeRO-3 gathers each layer's weights over inside the layer scan."""
        return FSDP if self.zero.shards_params and self.zero.active else None

    def gather_layer(self):
        """ZeRO-3: one layer's whole weights inside the layer scan, or None.

        parallel.fp8_gather: an FP8 weight's shards travel in e4m3 with one fp32 scale,
        the whole weight's (its shards' amaxes max-reduced over fsdp), and are read back
        into the compute dtype. The matmul's tensorwise quantisation of that weight
        finds the same amax and puts every value back on the value it travelled as: the
        same products as gathering the compute dtype, at half its bytes."""
        if not self.zero.shards_params or not self.zero.active:
            return None
        layer_names = {k: n[1:] for k, n in self.names["layers"].items()}
        if self.gspmd and FSDP not in self.manual:
            specs = {k: PartitionSpec(*s[1:]) for k, s in self.gathered["layers"].items()}

            def whole(w, k):
                return jax.lax.with_sharding_constraint(w, specs[k])

            amax = fp8.amax  # of the whole weight: the partitioner reduces it

        else:

            def whole(w, k):
                return self.zero.gather(w, layer_names[k])

            def amax(w):
                return jax.lax.pmax(fp8.amax(w), FSDP)

        in_fp8 = fp8_weights(self.cfg.model) if self.cfg.parallel.fp8_gather else ()

        def gather(w, k):
            if k in in_fp8:  # the barrier keeps the cast on the shards (compute_copy)
                q, scale = fp8.quantize(w, fp8.E4M3, amax(w))
                q = jax.lax.optimization_barrier(q)
                w = (whole(q, k).astype(jnp.float32) / scale).astype(w.dtype)
            else:
                w = whole(w, k)
            return jax.ad_checkpoint.checkpoint_name(w, remat.GATHERED)

        return gather


def _gather_pipeline(w, stored: PartitionSpec, compute: PartitionSpec):
    """Per-device code: the weight gathered over `pipeline` along each dimension it is
    stored split over `pipeline` but computed whole over it (the vocabulary)."""
    for dim, (s, c) in enumerate(zip(stored, compute, strict=True)):
        if PIPELINE in entry_axes(s) and PIPELINE not in entry_axes(c):
            w = jax.lax.all_gather(w, PIPELINE, axis=dim, tiled=True)
    return w


def _flat_specs(specs: dict) -> dict:
    out = {}
    for k, v in specs.items():
        if isinstance(v, dict):
            out.update({f"{k}/{kk}": vv for kk, vv in v.items()})
        else:
            out[k] = v
    return out
