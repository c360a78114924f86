"""Typed run configuration: the sections and keys, with their defaults, as dataclasses.

Plain data, the bottom layer: config/parse.py reads YAML and dotted overrides into it,
config/validate.py checks every rule before JAX compiles anything (a typo costs a
one-line error, not a minute of tracing and a traceback).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal


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
    # (the backends: model/attention/backends.py's table, which validation reads)
    attention: str = "auto"
    # the Pallas flash kernel's tiles [q, k, q_bwd, k_bwd] (powers of two, >= 16; the
    # sequence is padded to their least common multiple); null: kernels/flash_attention.py's
    # BlockSizes defaults. Used where the kernel runs: pallas, auto on a GPU with packed
    # documents, and the ring's pairs under context parallelism
    attention_blocks: list[int] | None = None
    # the Pallas kernel's backward, where it runs: split (a dQ kernel, then a dK/dV kernel,
    # each recomputing the probabilities; deterministic) or fused (one kernel computes them
    # once and adds dQ in fp32 atomically: its last bits may vary from run to run on a GPU)
    attention_backward: Literal["split", "fused"] = "split"
    # LM head and loss over this many tokens of the sequence at a time (0: all at once);
    # null (auto): chunks where one micro-batch's fp32 logits would be large, resolved to
    # an int once the mesh is known (config/validate.py, auto_loss_chunk)
    loss_chunk: int | None = None
    # layers per iteration of the layer loop (lax.scan's unroll): 1 keeps one compiled
    # layer; more lets XLA slice the stacked weights statically (faster on a CPU)
    scan_unroll: int = 1
    # the layer loop as one lax.scan (compile time flat in depth), or false: a Python loop,
    # each layer its own code, whose saved activations are not copied into stacked
    # buffers (model/stack.py; the ZeRO-3 prefetch, interleaved MoE and pipeline loops
    # stay scans)
    scan_layers: bool = True
    # RMSNorm over each head's queries and keys before the rotation (Qwen3, OLMo 2)
    qk_norm: bool = False
    # FP8 matmuls in the attention projections and the MLP (model/fp8.py; e4m3 forward
    # operands, e5m2 gradients): none, tensorwise (current scaling, one scale a tensor),
    # rowwise (one scale per token of an activation, per output column of a weight) or
    # delayed (one scale a tensor from the largest amax of the last fp8_history steps)
    fp8: Literal["none", "tensorwise", "rowwise", "delayed"] = "none"
    fp8_history: int = 16  # delayed: steps of amax history per tensor
    # which weights' matmuls take FP8 operands (wq wk wv wo w_gate w_up w_down); null: all
    fp8_layers: list[str] | None = None
    # mixture of experts (model/moe.py, docs/moe.md): experts per MoE layer (0: dense)
    moe_experts: int = 0
    moe_top_k: int = 2  # experts each token goes to
    moe_d_ff: int | None = None  # an expert's hidden size; null: d_ff
    moe_shared_experts: int = 0  # experts every token goes to, one MLP of n x moe_d_ff
    moe_every: int = 1  # every n-th layer an MoE layer, the others dense (1: all MoE)
    moe_router: Literal["softmax", "sigmoid"] = "softmax"
    moe_norm_topk: bool = True  # the chosen experts' gates sum to one
    # load balance: Switch/GShard's auxiliary loss, DeepSeek-V3's bias, or none
    moe_balance: Literal["aux", "bias", "none"] = "aux"
    moe_aux_coef: float = 0.01
    moe_bias_rate: float = 0.001  # bias: the step's move of each expert's bias
    moe_z_coef: float = 0.0  # router z-loss (ST-MoE), 0: off
    moe_capacity: float = 0.0  # 0: dropless; else a capacity factor (tokens beyond drop)
    # the experts' grouped matmuls: jax's ragged_dot (dense over every expert on a CPU and,
    # with jax 0.11, on a GPU), blocks of rows (model/grouped.py), or auto: blocked on a
    # CPU, ragged elsewhere (a GPU's speed for blocked is not measured yet)
    moe_grouped: Literal["auto", "ragged", "blocked"] = "auto"

    @property
    def hd(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    @property
    def moe(self) -> bool:
        return self.moe_experts > 0

    @property
    def expert_ff(self) -> int:
        return self.moe_d_ff or self.d_ff


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
    streams: int | None = None  # logical streams; null: gcd(global batch rows, 64) (ramps: all)
    shuffle_window: int = 16  # rows shuffled together after packing, per stream
    prefetch: int = 2  # batches made ahead on a background thread (0: on the step's thread)
    strict: bool = False  # files: a bad JSONL line is an error (false: skipped, reported)


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
    # adamw; sgd: plain SGD, no momentum (weight decay and clipping as adamw's)
    name: Literal["adamw", "sgd"] = "adamw"
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
    expert: int = 1  # expert parallelism: needs model.moe_experts (docs/moe.md)
    sequence: int = 1
    tensor: int = 1
    dcn: DcnConfig = field(default_factory=DcnConfig)

    def sizes(self) -> dict[str, int]:
        """The six axis sizes (without the dcn factors)."""
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
    # pipeline parallelism over mesh.pipeline (parallel/pipeline/, docs/pipeline.md)
    pipeline_schedule: str = "1f1b"  # a name of parallel/pipeline/schedules.py's table
    virtual_stages: int = 1  # model chunks per device (interleaved only)
    # GPU: overlap collectives with compute, bucket them up to these sizes (train/overlap.py)
    overlap: bool = True
    # GPU: let XLA pipeline a layer loop's collectives across iterations (train/overlap.py).
    # Off by default: not yet measured on several GPUs (see docs/parallelism.md).
    pipeline_collectives: bool = False
    # ZeRO-3: gather layer i+1's weights while layer i computes, forward and backward
    # (model/prefetch.py); one more gathered layer held
    prefetch: bool = True
    # ZeRO-3 with model.fp8=tensorwise: gather each FP8 weight's shards in e4m3 with their
    # scale (one byte a value, not the compute dtype's two), the scale the matmul uses
    fp8_gather: bool = False
    all_reduce_bucket_mib: int = 64
    all_gather_bucket_mib: int = 64
    reduce_scatter_bucket_mib: int = 64
    # DiLoCo over mesh.data (parallel/diloco.py, docs/diloco.md): each data rank a replica
    # that trains H inner steps alone, then an outer Nesterov step on the averaged
    # pseudo-gradient; 0: off (plain data parallelism)
    diloco_steps: int = 0
    diloco_outer_lr: float = 0.7
    diloco_outer_momentum: float = 0.9
    # streaming DiLoCo: the layers synchronised in this many fragments, one every H / F
    # steps (fragment f at the steps where step / (H / F) = f mod F); 1: all at once
    diloco_fragments: int = 1
    # the pseudo-gradients' dtype over `data`: float32 and bfloat16 are summed in it;
    # float8_e4m3fn is each replica's scaled by its own amax, gathered with its scale
    diloco_dtype: Literal["float32", "bfloat16", "float8_e4m3fn"] = "float32"


@dataclass
class CheckpointConfig:
    dir: str | None = None
    every: int = 0
    keep: int = 3
    resume: str = "auto"  # auto | never | must | a checkpoint path
    # resume with changed model, data or optimizer settings or seed (each one is named);
    # without it such a resume is refused: those settings make the run what it is
    resume_changed: bool = False
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
        """Data-parallel degree: the batch is split over data x fsdp x expert."""
        return self.mesh.data * self.mesh.fsdp * self.mesh.expert

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step: mbs x grad_accum x dp."""
        return self.train.micro_batch_size * self.train.grad_accum * self.dp

    @property
    def micro_tokens(self) -> int:
        """Tokens of one micro-batch over every data rank: a batch ramp grows the batch by
        accumulation, so its batches are multiples of this."""
        return self.train.micro_batch_size * self.dp * self.model.seq_len

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.model.seq_len
