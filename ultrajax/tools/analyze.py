"""`python -m ultrajax.analyze --config FILE [section.key=value ...] [options]`

Will this fit, and what does it cost? Memory per device (analytic, and with
--compile XLA's own figures beside it), FLOPs per step, and the communication of
one step read from the compiled HLO beside the playbook's formulas.

What is compiled is the real train step (`step.jit_train_step`, the program
the train loop runs) lowered on abstract inputs: `jax.eval_shape` for the state and
`ShapeDtypeStruct`s carrying the state and batch shardings. Nothing is
allocated and nothing runs, so an 8B recipe is analysed on a laptop
(`--cpu-devices N` simulates the mesh's N devices).

Options:
  --compile              compile and show XLA's memory_analysis / cost_analysis
                         (implied on a mesh of more than one device, for the
                         communication report; --no-compile skips it)
  --json                 one JSON object on stdout instead of the tables
  --device-memory SIZE   per-device memory for the verdict (80GB, 80GiB, bytes);
                         default: the device's own where known
  --plot FILE.png        predicted vs compiled memory, stacked bars
  --plot-sweep FILE.png  activation memory against sequence length per remat policy
  --plot-schedule FILE.png
                         the pipeline schedule (mesh.pipeline > 1), devices by ticks;
                         compiles nothing (the report stays analytic unless --compile)

With mesh.pipeline > 1 the report has a pipeline section: the schedule's ticks, bubble
and activations in flight read off the very table the executor runs, and the
point-to-point bytes the executor sends beside the textbook count and the compiled HLO.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import json
import math
import sys
from types import SimpleNamespace

import jax

from ultrajax import cli
from ultrajax.config.no_effect import no_effect
from ultrajax.config.schema import Config, ConfigError
from ultrajax.config.validate import resolve_mesh
from ultrajax.cost import activations, flops, hardware, memory, units
from ultrajax.cost.activations import concrete
from ultrajax.cost.flops import attention_flops
from ultrajax.model.attention import backends as attention
from ultrajax.model.llama import param_count
from ultrajax.parallel import mesh as mesh_lib
from ultrajax.parallel.layout import attention_backend, unsupported
from ultrajax.tools import hlo as hlo_lib
from ultrajax.tools.plots import plot_breakdown, plot_schedule, plot_sweep
from ultrajax.tools.report import format_report, pipeline_report
from ultrajax.train import batch as batch_lib
from ultrajax.train import optim
from ultrajax.train.step import init_state, jit_train_step, state_shardings

KNOWN_ACCELERATORS = ("h100", "h200", "a100")  # the verdict on a CPU host


# --------------------------------------------------------------------------- compiling


def _compile_config(cfg: Config) -> tuple[Config, list[str]]:
    """The config to compile on this backend, and notes on what had to change."""
    notes = []
    backend = jax.default_backend()
    on_gpu = attention_backend(cfg, "gpu")
    if backend != "gpu" and attention.BACKENDS[on_gpu].gpu_kernel:
        cfg = copy.deepcopy(cfg)
        cfg.model.attention = "xla"
        notes.append(
            f"attention={on_gpu} runs on a GPU: compiled here with attention=xla, whose s² "
            "scores a flash kernel never stores (the predicted figures are for xla too; the "
            f"verdict uses {on_gpu}'s)"
        )
    elif on_gpu != cfg.model.attention:
        cfg = copy.deepcopy(cfg)
        cfg.model.attention = on_gpu
    if cfg.model.dtype != "float32" and backend == "cpu":
        notes.append(
            f"{cfg.model.dtype} on XLA:CPU: matmuls and collectives run in float32 there, so "
            "compiled temporaries and communication exceed a GPU's; the "
            "model is validated in float32 on CPU"
        )

    if unsupported(cfg, backend):
        raise ConfigError(unsupported(cfg, backend))
    if cfg.model.remat == "offload" and backend != "gpu":
        raise ConfigError(
            f"model.remat=offload needs host offloading, which the {backend} backend lacks; "
            "analyse it without --compile, or use full or selective"
        )
    return cfg, notes


def abstract_inputs(cfg: Config, mesh, rules, tx):
    """(state, batch) as ShapeDtypeStructs with the train step's shardings."""

    shardings = state_shardings(cfg, mesh, rules, tx)
    shapes = jax.eval_shape(functools.partial(init_state, cfg, tx), jax.random.key(0))
    state = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes, shardings
    )
    t = cfg.train
    batch_sh = batch_lib.sharding(mesh)
    batch = batch_lib.abstract(
        t.grad_accum, t.micro_batch_size * cfg.dp, cfg.model.seq_len, batch_sh
    )
    return state, batch, shardings, batch_sh


def lower_step(cfg: Config, devices=None, platform: str | None = None):
    """The train step (step.jit_train_step) lowered on abstract inputs over `devices`;
    `platform` ("cuda"): lowered for that backend instead of the devices' own, to be
    read, not compiled (what a GPU's step would hold, checked on a CPU host)."""

    devices = list(jax.devices() if devices is None else devices)
    mesh = mesh_lib.make_mesh(cfg, devices)
    rules = mesh_lib.rules(cfg)
    tx, schedule = optim.optimizer(cfg), optim.lr_schedule(cfg)
    state, batch, shardings, batch_sh = abstract_inputs(cfg, mesh, rules, tx)
    with jax.set_mesh(mesh):
        step = jit_train_step(cfg, mesh, rules, tx, schedule, shardings, batch_sh)
        if platform is None:
            return step.lower(state, batch)
        return step.trace(state, batch).lower(lowering_platforms=(platform,))


@contextlib.contextmanager
def traced_as_gpu(cudnn: bool = False):
    """While inside, jax.default_backend() answers "gpu", so the step a CPU host traces
    takes a GPU's branches (the model asks it which kernel to run) and can be lowered or
    compiled for one. With `cudnn`, jax's own tracing-time checks for cuDNN attention
    (its private module: cuDNN's version, the card's compute capability) answer for cuDNN
    9.10 on a Hopper card. jax's caches are emptied after, so nothing traced this way
    reaches a later CPU compile."""
    saved = jax.default_backend
    patched = []
    try:
        jax.default_backend = lambda: "gpu"
        if cudnn:
            from jax._src.cudnn import fused_attention_stablehlo as module

            for name, value in (
                ("cuda_versions", SimpleNamespace(cudnn_get_version=lambda: 91000)),
                ("check_compute_capability", lambda capability: True),
            ):
                patched.append((module, name, getattr(module, name)))
                setattr(module, name, value)
        yield
    finally:
        jax.default_backend = saved
        for module, name, value in patched:
            setattr(module, name, value)
        jax.clear_caches()


def compile_step(cfg: Config, devices=None, compiler_options: dict | None = None):
    """Lower and compile the train step; `compiler_options` go to XLA (tests use
    {"xla_backend_optimization_level": 0}: the same buffers, half the compile time)."""
    return compile_step_partitioned(cfg, devices, compiler_options)[0]


def compile_step_partitioned(cfg: Config, devices=None, compiler_options: dict | None = None):
    """(compiled step, its module as the SPMD partitioner left it, or None on one device),
    from one compile."""
    devices = list(jax.devices() if devices is None else devices)
    lowered = lower_step(cfg, devices)
    if len(devices) > 1:
        return hlo_lib.compile_partitioned(lowered, compiler_options)
    return lowered.compile(compiler_options), None


def compiled_memory(compiled) -> dict:
    """XLA's memory_analysis, and the peak we read from it.

    The peak is argument + output - alias + temp: the donated state's outputs alias
    its arguments, and on the CPU backend peak_memory_in_bytes leaves the temporaries
    out (it comes to about argument + output), so we add them ourselves on every
    backend."""
    ma = compiled.memory_analysis()
    out = {
        "argument": int(ma.argument_size_in_bytes),
        "output": int(ma.output_size_in_bytes),
        "alias": int(ma.alias_size_in_bytes),
        "temp": int(ma.temp_size_in_bytes),
        "host_temp": int(getattr(ma, "host_temp_size_in_bytes", 0) or 0),
    }
    out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    return out


def flops_report(cfg: Config, compiled=None, hlo_text: str | None = None) -> dict:
    """FLOPs of one step per device: the model's (6N + attention), the hardware's
    (+ recomputation), the compiled dots counted with their loops' trip counts, and
    XLA's cost_analysis (which reads a loop body once)."""
    m = cfg.model
    n = math.prod(cfg.mesh.sizes().values())
    tokens = cfg.tokens_per_step
    saved = activations.keeps_residuals(cfg)  # selective runs no attention forward again
    out = {
        "model": flops.flops_per_token(m) * tokens / n,
        "hardware": flops.hardware_flops_per_token(m, attention_saved=saved) * tokens / n,
        "recompute": flops.recompute_flops_per_token(m, saved) * tokens / n,
        "grouped": flops.grouped_flops_per_token(m) * tokens / n,
        "fp8": flops.fp8_flops_per_token(m) * tokens / n,  # of "model", FP8 operands
    }
    if compiled is not None:
        try:
            cost = compiled.cost_analysis()
            cost = cost[0] if isinstance(cost, list) else cost
            out["cost_analysis"] = float(cost["flops"]) if cost and "flops" in cost else None
        except Exception:  # backends without a cost model
            out["cost_analysis"] = None
    if cfg.mesh.sequence > 1:  # context parallelism: causal attention work per device
        out["attention_per_device"] = attention_flops(cfg)
    if hlo_text is not None:
        out["hlo_dots"], out["hlo_dots_once"] = hlo_lib.matmul_flops(hlo_text)
        out["ratio"] = out["hardware"] / out["hlo_dots"] if out["hlo_dots"] else None
        if cfg.mesh.pipeline > 1:  # each tick's branches are all counted: no like for like
            out["ratio"] = None
            out["note"] = (
                "pipeline: the compiled count takes every branch of every tick (forward, "
                "backward, head, ...) as run at every tick; a device runs one per tick"
            )
    return out


# --------------------------------------------------------------------------- the report


def verdict(peak: float, device_memory: int | None, source: str) -> dict:
    if device_memory:
        return {
            "fits": peak <= device_memory,
            "device_memory": device_memory,
            "source": source,
            "fraction": peak / device_memory,
        }
    return {
        "fits": None,
        "device_memory": None,
        "source": source,
        "known": {name: peak <= hardware.by_name(name).memory for name in KNOWN_ACCELERATORS},
    }


def analyze(
    cfg: Config,
    *,
    compile: bool = False,
    communication: bool | None = None,
    devices=None,
    compiler_options: dict | None = None,
    device_memory: int | None = None,
    both_modes: bool = False,
) -> dict:
    """Everything analyze prints, as a JSON-ready dict.

    both_modes: also compile the step with the other `parallel.collectives` and report
    its communication beside this one's (`communication_modes`)."""
    devices = list(jax.devices() if devices is None else devices)
    resolve_mesh(cfg, len(devices))
    compiling = compile or communication
    # predictions for what is compiled; the verdict for the config as given
    analysed, notes = _compile_config(cfg) if compiling else (cfg, [])
    report, est = _predicted(cfg, analysed, notes, devices, device_memory)
    compiled = text = partitioned = None
    if compiling:
        compiled, partitioned = compile_step_partitioned(analysed, devices, compiler_options)
        report["compiled"] = compiled_memory(compiled)
        report["ratios"] = _ratios(est, report["compiled"])
        text = compiled.as_text()
    report["flops"] = flops_report(analysed, compiled, text)
    if cfg.mesh.pipeline > 1:
        source = "partitioned" if partitioned is not None else "compiled"
        hlo = partitioned if partitioned is not None else text
        report["pipeline"] = pipeline_report(analysed, hlo, source)
    if communication and text is not None:
        modes = _communication_modes(
            analysed, text, partitioned, devices, compiler_options, both_modes, report["notes"]
        )
        report["communication"] = modes[analysed.parallel.collectives]
        report["communication_modes"] = modes
    return report


def _config_summary(cfg: Config, devices: list) -> dict:
    """The layout and batch as the report's header shows them."""
    return {
        "devices": len(devices),
        "backend": jax.default_backend(),
        "mesh": dict(cfg.mesh.sizes()),
        "zero": cfg.parallel.zero,
        "sequence_parallel": cfg.parallel.sequence_parallel,
        "remat": cfg.model.remat,
        "dtype": cfg.model.dtype,
        "param_dtype": cfg.model.param_dtype,
        "attention": cfg.model.attention,
        "loss_chunk": cfg.model.loss_chunk,  # resolved: null (auto) became an int
        "parameters": param_count(cfg.model),
        "micro_batch_size": cfg.train.micro_batch_size,
        "grad_accum": cfg.train.grad_accum,
        "seq_len": cfg.model.seq_len,
        "tokens_per_step": cfg.tokens_per_step,
        "pipeline_schedule": cfg.parallel.pipeline_schedule if cfg.mesh.pipeline > 1 else None,
        "virtual_stages": cfg.parallel.virtual_stages,
    }


def _predicted(cfg: Config, analysed: Config, notes: list, devices: list, device_memory):
    """(the report's analytic part, the estimate of what is compiled). Memory is
    predicted for `analysed`; the verdict is for `cfg` as configured, on a GPU (where
    its attention `auto` means the kernel), when compiling here had to change it."""
    platform = "gpu" if analysed is cfg else None
    est = memory.estimate(analysed, platform=platform)
    report = {
        "config": _config_summary(cfg, devices),
        "notes": notes,
        "predicted": est.to_dict(),
        # the attention the memory is predicted for: as a GPU runs it, unless compiling
        # here changed it (a CPU run of the same config may use another: its summary says)
        "predicted_attention": concrete(analysed, platform).model.attention,
        "predicted_platform": platform or "compiled",
    }
    peak = est.peak
    if analysed is not cfg:
        as_configured = memory.estimate(cfg, platform="gpu")
        peak = as_configured.peak
        report["predicted_as_configured"] = as_configured.to_dict()
    if device_memory is None:
        device_memory, source = hardware.device_memory(devices[0])
    else:
        source = "--device-memory"
    report["verdict"] = verdict(peak, device_memory, source)
    return report, est


def _ratios(est, c: dict) -> dict:
    """Predicted over compiled (`c`: compiled_memory's figures), where XLA has one."""
    return {
        "arguments": est.arguments / c["argument"] if c["argument"] else None,
        "temp": est.temp / c["temp"] if c["temp"] else None,
        "peak": est.peak / c["peak"] if c["peak"] else None,
    }


def _communication_modes(
    cfg: Config,
    text: str,
    partitioned: str | None,
    devices: list,
    compiler_options: dict | None,
    both_modes: bool,
    notes: list[str],
) -> dict:
    """collectives mode -> communication report: this config's, and with both_modes the
    other mode's compiled beside it (or a note in `notes` saying why not)."""
    modes = {cfg.parallel.collectives: communication_report(cfg, text, partitioned)}
    if not both_modes:
        return modes
    other = copy.deepcopy(cfg)
    other.parallel.collectives = "gspmd" if cfg.parallel.collectives == "explicit" else "explicit"
    skip = unsupported(other, jax.default_backend())
    if skip:
        notes.append(f"{other.parallel.collectives} not compiled: {skip}")
    else:
        other_compiled, other_part = compile_step_partitioned(other, devices, compiler_options)
        modes[other.parallel.collectives] = communication_report(
            other, other_compiled.as_text(), other_part
        )
    return modes


def communication_report(cfg: Config, text: str, partitioned: str | None = None) -> dict:
    """comms.report of the step: read from the module as the SPMD partitioner left it
    where there is one (the collectives, bytes and dtypes the program asks for, which a
    GPU runs), else from the compiled program. `compiled_traffic` keeps the compiled
    program's total, which on XLA:CPU moves bf16 collectives as f32."""
    rep = hlo_lib.report(cfg, partitioned if partitioned is not None else text)
    rep["mode"] = cfg.parallel.collectives
    rep["source"] = "partitioned" if partitioned is not None else "compiled"
    if partitioned is not None:
        compiled = hlo_lib.summarize(hlo_lib.collectives(text)[0])
        rep["compiled_traffic"] = sum(r["traffic"] for r in compiled.values())
    return rep


# --------------------------------------------------------------------------- CLI


def main(argv=None) -> int:
    """The report of one train step: checks, the analysis, the pictures, then the text."""
    args = _parser().parse_args(argv)
    device_memory = _device_memory(args.device_memory)
    _check_plot_paths(args)
    cli.setup_devices(args)
    cfg = _load_config(args)
    title = plot_schedule(cfg, args.plot_schedule) if args.plot_schedule else None
    multi = math.prod(cfg.mesh.sizes().values()) > 1
    # a multi-device mesh implies --compile (for the communication), unless only the
    # schedule's picture was asked for
    do_compile = (args.compile or (multi and not args.plot_schedule)) and not args.no_compile
    report = analyze(
        cfg,
        compile=do_compile,
        communication=do_compile,
        device_memory=device_memory,
        both_modes=do_compile and multi,
    )
    _plots(report, cfg, args, title)
    if args.json:
        json.dump(report, sys.stdout, indent=1, default=_jsonable)
        print()
    else:
        print(format_report(report))
        for key in ("plot", "plot_sweep", "plot_schedule"):
            if key in report:
                print(f"wrote {report[key]}")
    return 0


def _parser():
    p = cli.parser("ultrajax.analyze", "Memory, FLOPs and communication of one train step.")
    p.add_argument("--compile", action="store_true", help="compile and compare with XLA")
    p.add_argument("--no-compile", action="store_true", help="analytic figures only")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--device-memory", default=None, metavar="SIZE", help="e.g. 80GB, 80GiB")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="memory breakdown bars")
    p.add_argument("--plot-sweep", default=None, metavar="FILE.png", help="memory vs seq_len")
    p.add_argument(
        "--plot-schedule",
        default=None,
        metavar="FILE.png",
        help="the pipeline schedule (mesh.pipeline > 1); implies no compile unless --compile",
    )
    return p


def _device_memory(size: str | None) -> int | None:
    """--device-memory in bytes (None: the device's own), checked before devices start."""
    if size is None:
        return None
    try:
        return units.parse_bytes(size)
    except ValueError:
        raise ConfigError(
            f"--device-memory: {size!r} is not a size; use e.g. 80GB, 80GiB or a number of bytes"
        ) from None


def _check_plot_paths(args) -> None:
    """Each picture's path, checked before any device starts."""
    for flag in ("plot", "plot_sweep", "plot_schedule"):
        cli.check_picture(getattr(args, flag), f"--{flag.replace('_', '-')}")


def _load_config(args) -> Config:
    """The config on this process's devices; a mesh that does not fit them says how
    many to simulate on a CPU host. Settings without effect here are warned about."""
    cfg = cli.load_config(args)
    try:
        resolve_mesh(cfg, jax.device_count())
    except ConfigError as e:
        sizes = cfg.mesh.sizes().values()
        want = math.prod(sizes) if -1 not in sizes else "N"
        hint = f" (on a CPU host, --cpu-devices {want} simulates that many devices)"
        raise ConfigError(f"{e}{'' if '--cpu-devices' in str(e) else hint}") from None
    for line in no_effect(cfg):
        print(f"warning: {line}", file=sys.stderr)
    return cfg


def _plots(report: dict, cfg: Config, args, title: str | None) -> None:
    """Draw the pictures asked for after the analysis and name them in the report (the
    schedule's was drawn before: it needs no compile)."""
    if args.plot:
        plot_breakdown(report, args.plot)
        report["plot"] = args.plot
    if args.plot_sweep:
        report["sweep"] = plot_sweep(cfg, args.plot_sweep, report["verdict"]["device_memory"])
        report["plot_sweep"] = args.plot_sweep
    if title is not None:
        report["plot_schedule"] = args.plot_schedule
        report["plot_schedule_title"] = title


def _jsonable(x):
    if dataclasses.is_dataclass(x):
        return dataclasses.asdict(x)
    return float(x)
