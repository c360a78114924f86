"""Settings that are valid but do nothing in this layout (or cost far more than they
should): one warning line each, saying what to change. Not errors: a recipe may be meant
for a larger mesh."""

from __future__ import annotations

import dataclasses

from ultrajax.config.schema import Config, ModelConfig, ParallelConfig
from ultrajax.model import units
from ultrajax.model.attention import backends as attention
from ultrajax.parallel import zero
from ultrajax.parallel.context import pair_chunk, pair_kernel, pair_tile


def _moe_warnings(cfg: Config) -> list[str]:
    """no_effect's lines about mixture of experts."""
    m, mesh, par = cfg.model, cfg.mesh, cfg.parallel
    out = []
    if m.moe_experts and mesh.tensor > 1 and par.collectives == "gspmd":
        out.append(
            "parallel.collectives=gspmd with model.moe_experts and mesh.tensor > 1 trains "
            "correctly but slowly: the partitioner all-reduces the experts' partial outputs "
            "over tensor where they are largest (3.5x to 25x the bytes of explicit on the "
            "tests' shapes, docs/moe.md): use parallel.collectives=explicit"
        )
    dense = ModelConfig()
    moe_keys = [f.name for f in dataclasses.fields(ModelConfig) if f.name.startswith("moe_")]
    changed = [k for k in moe_keys if k != "moe_experts" and getattr(m, k) != getattr(dense, k)]
    if not m.moe_experts and changed:
        out.append(
            f"model.{', model.'.join(changed)} {'has' if len(changed) == 1 else 'have'} no "
            "effect with model.moe_experts=0 (a dense model): set model.moe_experts, or drop "
            f"{'it' if len(changed) == 1 else 'them'}"
        )
    elif m.moe_experts:  # each balance reads its own coefficient only (model/moe.py)
        unread = {"aux": ("moe_bias_rate",), "bias": ("moe_aux_coef",)}
        keys = unread.get(m.moe_balance, ("moe_aux_coef", "moe_bias_rate"))
        out += _unread(cfg, "model", keys, f"model.moe_balance={m.moe_balance}")
    return out


def scans_kept(cfg: Config) -> list[str]:
    """What keeps the layer loop a lax.scan under model.scan_layers=false (model/stack.py:
    the pipeline's stages, units of dense and MoE layers, ZeRO-3's prefetch)."""
    m, scans = cfg.model, []
    if cfg.mesh.pipeline > 1:
        scans.append("mesh.pipeline > 1 (each stage's layers)")
    if units.size(m) > 1:
        scans.append(f"model.moe_every={m.moe_every} (units of dense and MoE layers)")
    elif zero.prefetches(cfg):
        scans.append("ZeRO-3's prefetch (parallel.prefetch)")
    return scans


def layer_loop(cfg: Config) -> bool:
    """Whether the step runs its layers as a Python loop (model.scan_layers=false, and
    nothing keeps the scan): the step then orders each layer's weight gradients on
    several devices (parallel/layout.py), and the memory model counts what the loop keeps
    on a GPU (cost/activations.py)."""
    return not cfg.model.scan_layers and not scans_kept(cfg)


def _loop_warnings(cfg: Config, platform: str | None) -> list[str]:
    """no_effect's lines about model.scan_layers=false: the layer loops that stay scans,
    and recomputation lost on a CPU."""
    m = cfg.model
    if m.scan_layers:
        return []
    scans = scans_kept(cfg)
    out = []
    if scans:
        out.append(
            f"model.scan_layers=false has no effect with {' and '.join(scans)}: that layer "
            "loop stays a lax.scan (model/stack.py): drop it"
        )
    elif m.scan_unroll > 1:
        out.append(
            f"model.scan_unroll={m.scan_unroll} has no effect with model.scan_layers=false "
            "(the layers are a Python loop, no scan to unroll): drop it"
        )
    if not scans and platform == "cpu" and m.remat not in ("none", "offload"):
        out.append(
            f"model.scan_layers=false with model.remat={m.remat} holds on a CPU about what "
            "no recomputation holds: XLA:CPU runs every layer's recomputation early "
            "(docs/memory.md); keep model.scan_layers=true on a CPU"
        )
    return out


def _kernel_warnings(cfg: Config, platform: str | None) -> list[str]:
    """no_effect's lines about the Pallas attention kernel: its settings where it does not
    run, and the ring's pairs of chunks left to plain XLA because they do not fit its tiles.
    `platform` resolves `auto` (unknown: auto may pick the kernel)."""
    m, cp = cfg.model, cfg.mesh.sequence
    out = []
    if platform is None:
        backend = attention.BACKENDS.get(m.attention)  # None: auto
        pairs = cp > 1 and (backend is None or backend.gpu_kernel)
        kernel = backend is None or backend.tiles or pairs
    else:
        name = attention.resolve(m.attention, platform, cfg.data.cross_doc_mask, m.seq_len)
        backend = attention.BACKENDS[name]
        pairs = cp > 1 and backend.gpu_kernel  # a flash kernel: ours runs the ring's pairs
        fits = pair_kernel(cfg, platform) == "pallas"
        if pairs and not fits:
            out.append(
                f"model.attention={m.attention} under context parallelism (mesh.sequence={cp}) "
                f"runs the ring's pairs of chunks in plain XLA, with fp32 scores of each pair: "
                f"a chunk of {pair_chunk(cfg)} tokens (model.seq_len / (2 x mesh.sequence))"
                f" is not a multiple of the kernel's tiles (their lcm is {pair_tile(cfg)}): set "
                "model.attention_blocks to tiles that divide the chunk"
            )
        kernel = (backend.tiles and cp == 1) or (pairs and fits)
    asked = [f"model.attention_blocks={m.attention_blocks}"] * (m.attention_blocks is not None)
    asked += [f"model.attention_backward={m.attention_backward}"] * (
        m.attention_backward != "split"
    )
    if not asked or kernel or out:  # out: the pairs' line says why the tiles do not apply
        return out
    one = len(asked) == 1
    resolved = f", {backend.name} here," if m.attention == "auto" and platform else ""
    return out + [
        f"{' and '.join(asked)} {'has' if one else 'have'} no effect with "
        f"model.attention={m.attention}{resolved} (the Pallas kernel's tiles and backward): "
        f"use model.attention=pallas, or drop {'it' if one else 'them'}"
    ]


def _unread(cfg: Config, section: str, keys: tuple[str, ...], when: str) -> list[str]:
    """One line for the keys of `section` set away from their defaults that `when` leaves
    unread."""
    obj = getattr(cfg, section)
    default = type(obj)()
    changed = [
        f"{section}.{k}={getattr(obj, k)}" for k in keys if getattr(obj, k) != getattr(default, k)
    ]
    if not changed:
        return []
    one = len(changed) == 1
    return [
        f"{', '.join(changed)} {'has' if one else 'have'} no effect with {when}: drop "
        f"{'it' if one else 'them'}"
    ]


def _gather_warnings(cfg: Config, regather: bool, platform: str | None) -> list[str]:
    """ZeRO-3's prefetch without ZeRO-3's gathers (`regather`), and the GPU's collective
    flags (train/overlap.py) off a GPU."""
    par, out = cfg.parallel, []
    if not par.prefetch and not regather:
        out.append(
            f"parallel.prefetch=false has no effect with parallel.zero={par.zero} and "
            f"mesh.fsdp={cfg.mesh.fsdp} (it is ZeRO-3's gather of the next layer's weights "
            "over fsdp): drop it"
        )
    if platform is not None and platform != "gpu":
        keys = ("overlap", "pipeline_collectives", "all_reduce_bucket_mib")
        keys += ("all_gather_bucket_mib", "reduce_scatter_bucket_mib")
        out += _unread(cfg, "parallel", keys, f"the {platform} backend (XLA's GPU flags)")
    return out


def _reading_warnings(cfg: Config) -> list[str]:
    """Settings that what else is set never reads: the rope scaling's numbers, the
    schedule's, Adam's with plain SGD, DiLoCo's without DiLoCo, evaluation without a held-out
    split. (Some of them name the run: rope_factor changes train.run_dir's default.)"""
    m, o, par, t = cfg.model, cfg.optim, cfg.parallel, cfg.train
    llama3 = ("rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_len")
    out = []
    if m.rope_scaling != "llama3":
        keys = llama3 if m.rope_scaling == "linear" else ("rope_factor", *llama3)
        out += _unread(cfg, "model", keys, f"model.rope_scaling={m.rope_scaling}")
    if o.schedule != "wsd":
        out += _unread(cfg, "optim", ("decay_fraction",), f"optim.schedule={o.schedule}")
    if o.schedule == "constant":
        out += _unread(cfg, "optim", ("min_lr", "schedule_steps"), "optim.schedule=constant")
    if o.name == "sgd":
        out += _unread(cfg, "optim", ("b1", "b2", "eps"), "optim.name=sgd (no moments)")
    if not par.diloco_steps:
        keys = ("diloco_outer_lr", "diloco_outer_momentum", "diloco_fragments", "diloco_dtype")
        out += _unread(cfg, "parallel", keys, "parallel.diloco_steps=0 (no DiLoCo)")
    if not t.eval_batches:
        out += _unread(cfg, "train", ("eval_every",), "train.eval_batches=0 (no evaluation)")
    if cfg.data.eval_fraction == 0 and t.eval_batches:
        out.append(
            f"train.eval_batches={t.eval_batches} has no effect with data.eval_fraction=0 (no "
            "document is held out, so nothing is evaluated): set data.eval_fraction > 0, or "
            "train.eval_batches=0"
        )
    return out


def no_effect(cfg: Config, platform: str | None = None) -> list[str]:
    """Settings that do nothing in this layout (or cost far more than they should), one
    line each saying what to change: valid, so not errors (a recipe may be meant for a
    larger mesh), but worth a warning. `platform`: the backend the step runs on, where
    known (the train command's)."""
    mesh, par = cfg.mesh, cfg.parallel
    out = []
    if par.zero > 0 and mesh.fsdp == 1:
        out.append(
            f"parallel.zero={par.zero} has no effect with mesh.fsdp=1 (ZeRO shards over "
            "fsdp): set mesh.fsdp > 1, or parallel.zero=0"
        )
    if par.fp8_gather and (par.zero != 3 or mesh.fsdp == 1):
        out.append(
            f"parallel.fp8_gather has no effect with parallel.zero={par.zero} and "
            f"mesh.fsdp={mesh.fsdp} (it is ZeRO-3's gather of the layer weights over fsdp): "
            "set parallel.zero=3 and mesh.fsdp > 1, or drop it"
        )
    if par.sequence_parallel and mesh.tensor == 1:
        out.append(
            "parallel.sequence_parallel=true has no effect with mesh.tensor=1 (it splits "
            "the sequence over tensor): set mesh.tensor > 1, or drop it"
        )
    if cfg.data.source == "prepared" and cfg.data.tokenizer != "bytes":
        out.append(
            f"data.tokenizer={cfg.data.tokenizer} has no effect with data.source=prepared (the "
            "directory's manifest names its tokenizer): drop it"
        )
    if cfg.data.strict and cfg.data.source != "files":
        how = (
            "its lines were checked by prepare, whose --strict refuses bad ones"
            if cfg.data.source == "prepared"
            else "it reads no JSONL"
        )
        out.append(
            f"data.strict=true has no effect with data.source={cfg.data.source} ({how}): drop it"
        )
    t = cfg.train
    if t.noise_every and t.grad_accum == 1 and not t.batch_schedule:
        out.append(
            f"train.noise_every={t.noise_every} has no effect with train.grad_accum=1 (the noise "
            "scale compares one micro-batch's gradient with the step's): set "
            "train.grad_accum >= 2, or drop it"
        )
    m = cfg.model
    out += _kernel_warnings(cfg, platform)
    regather = par.zero >= 3 and mesh.fsdp != 1
    out += _gather_warnings(cfg, regather, platform)
    scanned = m.scan_layers or scans_kept(cfg)
    if m.scan_unroll > 1 and (m.remat != "none" or regather) and scanned:
        why = f"model.remat={m.remat}" if m.remat != "none" else "parallel.zero=3"
        out.append(
            f"model.scan_unroll={m.scan_unroll} has no effect with {why}: unrolled, XLA merges "
            "each layer's recomputation with its forward and keeps every layer's activations "
            "(and ZeRO-3's gathered weights), so the layers run one per loop iteration "
            "(model/remat.py): drop it, or set model.scan_unroll=1"
        )
    out += _loop_warnings(cfg, platform)
    out += _moe_warnings(cfg)
    out += _reading_warnings(cfg)
    default = ParallelConfig()
    axis_keys = {
        "pipeline": ("pipeline_schedule", "virtual_stages"),
        "sequence": ("context", "context_zigzag"),
    }
    for axis, keys in axis_keys.items():
        if getattr(mesh, axis) != 1:
            continue
        for key in keys:
            if getattr(par, key) != getattr(default, key):
                out.append(
                    f"parallel.{key}={getattr(par, key)} has no effect with mesh.{axis}=1: "
                    f"set mesh.{axis} > 1, or drop it"
                )
    return out
