"""`python -m ultrajax.analyze --config FILE [section.key=value ...] [options]`

Will this fit, and what does it cost? Memory per device (analytic, and with
--compile XLA's own figures beside it), FLOPs per step, and the communication of
one step read from the compiled HLO beside the playbook's formulas.

What is compiled is the real train step (`step.jit_train_step`, the program
train.py runs) lowered on abstract inputs: `jax.eval_shape` for the state and
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

import copy
import dataclasses
import functools
import json
import sys

import jax
import numpy as np

from ultrajax import attention, cli, comms, hardware, memory, metrics, optim
from ultrajax import batch as batch_lib
from ultrajax import mesh as mesh_lib
from ultrajax.config import Config, ConfigError, no_effect, resolve_mesh
from ultrajax.memory import fmt_bytes
from ultrajax.model import param_count
from ultrajax.parallel import schedule

KNOWN_ACCELERATORS = ("h100", "h200", "a100")  # the verdict on a CPU host


# --------------------------------------------------------------------------- compiling


def _compile_config(cfg: Config) -> tuple[Config, list[str]]:
    """The config to compile on this backend, and notes on what had to change."""
    notes = []
    backend = jax.default_backend()
    on_gpu = attention.resolve(cfg.model.attention, "gpu", cfg.data.cross_doc_mask)
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
    from ultrajax.step import unsupported

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
    from ultrajax.step import init_state, state_shardings

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


def lower_step(cfg: Config, devices=None):
    """The train step (step.jit_train_step) lowered on abstract inputs over `devices`."""
    from ultrajax.step import jit_train_step

    devices = list(jax.devices() if devices is None else devices)
    mesh = mesh_lib.make_mesh(cfg, devices)
    rules = mesh_lib.rules(cfg)
    tx, schedule = optim.optimizer(cfg), optim.schedule(cfg)
    state, batch, shardings, batch_sh = abstract_inputs(cfg, mesh, rules, tx)
    with jax.set_mesh(mesh):
        step = jit_train_step(cfg, mesh, rules, tx, schedule, shardings, batch_sh)
        return step.lower(state, batch)


_COMPILED: dict = {}  # (config, devices, options) -> (compiled step, partitioned module)


def compile_step(cfg: Config, devices=None, compiler_options: dict | None = None):
    """Lower and compile the train step; `compiler_options` go to XLA (tests use
    {"xla_backend_optimization_level": 0}: the same buffers, half the compile time).
    The same config on the same devices is compiled once per process."""
    return compile_step_partitioned(cfg, devices, compiler_options)[0]


def compile_step_partitioned(cfg: Config, devices=None, compiler_options: dict | None = None):
    """(compiled step, its module as the SPMD partitioner left it, or None on one device),
    from one compile."""
    from ultrajax.config import dump

    devices = list(jax.devices() if devices is None else devices)
    key = (dump(cfg), tuple(d.id for d in devices), tuple(sorted((compiler_options or {}).items())))
    if key not in _COMPILED:
        if len(_COMPILED) >= 64:
            _COMPILED.pop(next(iter(_COMPILED)))
        lowered = lower_step(cfg, devices)
        if len(devices) > 1:
            _COMPILED[key] = comms.compile_partitioned(lowered, compiler_options)
        else:
            _COMPILED[key] = (lowered.compile(compiler_options), None)
    return _COMPILED[key]


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
    n = math_prod(cfg.mesh.sizes().values())
    tokens = cfg.tokens_per_step
    out = {
        "model": metrics.flops_per_token(m) * tokens / n,
        "hardware": metrics.hardware_flops_per_token(m) * tokens / n,
        "recompute": metrics.recompute_flops_per_token(m) * tokens / n,
    }
    if compiled is not None:
        try:
            cost = compiled.cost_analysis()
            cost = cost[0] if isinstance(cost, list) else cost
            out["cost_analysis"] = float(cost["flops"]) if cost and "flops" in cost else None
        except Exception:  # backends without a cost model
            out["cost_analysis"] = None
    if cfg.mesh.sequence > 1:  # context parallelism: causal attention work per device
        from ultrajax.parallel.context import attention_flops

        out["attention_per_device"] = attention_flops(cfg)
    if hlo_text is not None:
        out["hlo_dots"], out["hlo_dots_once"] = comms.matmul_flops(hlo_text)
        out["ratio"] = out["hardware"] / out["hlo_dots"] if out["hlo_dots"] else None
        if cfg.mesh.pipeline > 1:  # each tick's branches are all counted: no like for like
            out["ratio"] = None
            out["note"] = (
                "pipeline: the compiled count takes every branch of every tick (forward, "
                "backward, head, ...) as run at every tick; a device runs one per tick"
            )
    return out


def math_prod(values) -> int:
    p = 1
    for v in values:
        p *= v
    return p


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
    original = cfg
    ccfg, notes = _compile_config(cfg) if compile or communication else (cfg, [])
    analysed = ccfg  # predictions for what is compiled; the verdict for the config as given
    # a config analysed as given is predicted for a GPU (the attention `auto` means there)
    est = memory.estimate(analysed, platform="gpu" if analysed is original else None)
    report = {
        "config": {
            "devices": len(devices),
            "backend": jax.default_backend(),
            "mesh": dict(cfg.mesh.sizes()),
            "zero": cfg.parallel.zero,
            "sequence_parallel": cfg.parallel.sequence_parallel,
            "remat": cfg.model.remat,
            "dtype": cfg.model.dtype,
            "param_dtype": cfg.model.param_dtype,
            "attention": cfg.model.attention,
            "parameters": param_count(cfg.model),
            "micro_batch_size": cfg.train.micro_batch_size,
            "grad_accum": cfg.train.grad_accum,
            "seq_len": cfg.model.seq_len,
            "tokens_per_step": cfg.tokens_per_step,
            "pipeline_schedule": cfg.parallel.pipeline_schedule if cfg.mesh.pipeline > 1 else None,
            "virtual_stages": cfg.parallel.virtual_stages,
        },
        "notes": notes,
        "predicted": est.to_dict(),
    }
    peak_for_verdict = est.peak
    if original is not analysed:
        as_configured = memory.estimate(original, platform="gpu")
        peak_for_verdict = as_configured.peak
        report["predicted_as_configured"] = as_configured.to_dict()
    if device_memory is None:
        device_memory, source = memory.device_memory(devices[0])
    else:
        source = "--device-memory"
    report["verdict"] = verdict(peak_for_verdict, device_memory, source)

    compiled = text = partitioned = None
    if compile or communication:
        compiled, partitioned = compile_step_partitioned(analysed, devices, compiler_options)
        report["compiled"] = compiled_memory(compiled)
        text = compiled.as_text()
        c = report["compiled"]
        report["ratios"] = {
            "arguments": est.arguments / c["argument"] if c["argument"] else None,
            "temp": est.temp / c["temp"] if c["temp"] else None,
            "peak": est.peak / c["peak"] if c["peak"] else None,
        }
    report["flops"] = flops_report(analysed, compiled, text)
    if cfg.mesh.pipeline > 1:
        source = "partitioned" if partitioned is not None else "compiled"
        hlo = partitioned if partitioned is not None else text
        report["pipeline"] = pipeline_report(analysed, hlo, source)
    if communication and text is not None:
        report["communication"] = communication_report(analysed, text, partitioned)
        report["communication_modes"] = {analysed.parallel.collectives: report["communication"]}
        other = copy.deepcopy(analysed)
        other.parallel.collectives = (
            "gspmd" if analysed.parallel.collectives == "explicit" else "explicit"
        )
        from ultrajax.step import unsupported

        skip = unsupported(other, jax.default_backend())
        if both_modes and skip:
            report["notes"].append(f"{other.parallel.collectives} not compiled: {skip}")
        elif both_modes:
            other_compiled, other_part = compile_step_partitioned(other, devices, compiler_options)
            report["communication_modes"][other.parallel.collectives] = communication_report(
                other, other_compiled.as_text(), other_part
            )
    return report


def communication_report(cfg: Config, text: str, partitioned: str | None = None) -> dict:
    """comms.report of the step: read from the module as the SPMD partitioner left it
    where there is one (the collectives, bytes and dtypes the program asks for, which a
    GPU runs), else from the compiled program. `compiled_traffic` keeps the compiled
    program's total, which on XLA:CPU moves bf16 collectives as f32."""
    rep = comms.report(cfg, partitioned if partitioned is not None else text)
    rep["mode"] = cfg.parallel.collectives
    rep["source"] = "partitioned" if partitioned is not None else "compiled"
    if partitioned is not None:
        compiled = comms.summarize(comms.collectives(text)[0])
        rep["compiled_traffic"] = sum(r["traffic"] for r in compiled.values())
    return rep


# --------------------------------------------------------------------------- pipeline

BUBBLE_FORMULA = {
    "afab": "(p-1)/(m+p-1)",
    "1f1b": "(p-1)/(m+p-1)",
    "interleaved": "(p-1)/(v·m+p-1)",
    "zb-h1": "(p-1)/(3m+p-1)",
}


def _in_flight_per_device(table: np.ndarray) -> list[int]:
    """schedule.in_flight's count, per device: the most micro-batch chunks each holds."""
    ops = table[..., 0]
    stored = (ops == schedule.FORWARD).astype(np.int64)
    stored -= (ops == schedule.BACKWARD) | (ops == schedule.BACKWARD_WEIGHT)
    return [int(x) for x in np.cumsum(stored, axis=0).max(axis=0, initial=0)]


def pipeline_report(cfg: Config, hlo_text: str | None = None, source: str = "") -> dict | None:
    """The schedule the executor runs (mesh.pipeline > 1), read off its own table, and its
    point-to-point bytes per step per device three ways: what the executor sends, the
    textbook count, and (given the HLO) the compiled collective-permutes."""
    p, v, m = cfg.mesh.pipeline, cfg.parallel.virtual_stages, cfg.train.grad_accum
    if p == 1:
        return None
    plan = memory.pipeline_plan(cfg)
    table, kind = plan.table, plan.kind
    message = comms.pipeline_message_bytes(cfg)
    act_ticks, grad_ticks = (int(x) for x in plan.sends.sum(axis=0))
    activations, gradients = schedule.p2p_messages(table)
    d = memory.dims(cfg)
    out = {
        "schedule": kind,
        "p": p,
        "m": m,
        "v": v,
        "ticks": plan.ticks,
        "layers_per_chunk": cfg.model.n_layers // (p * v),
        "bubble": schedule.bubble(table),
        "bubble_formula": schedule.formula(kind, p, m, v),
        "bubble_formula_text": BUBBLE_FORMULA[kind],
        "in_flight": schedule.in_flight(table),
        "in_flight_per_device": _in_flight_per_device(table),
        "slots": dict(plan.slots),
        "message": {
            "bytes": message,
            "shape": [d.b, d.s_res, d.h],
            "dtype": cfg.model.dtype,
        },
        "p2p": {
            "executor": {
                "activation_ticks": act_ticks,
                "gradient_ticks": grad_ticks,
                "bytes": (act_ticks + grad_ticks) * message,
                "what": "every device sends one message down the ring at each tick where "
                "any device sends an activation, and one up where any sends a gradient "
                "(a collective: devices with nothing to send send a spare slot)",
            },
            "formula": {
                "messages": [activations, gradients],
                "per_device": (activations + gradients) / p,
                "bytes": (activations + gradients) / p * message,
                "what": "2·m·(v·p-1)/p messages per device: each micro-batch crosses each "
                "of the v·p-1 stage boundaries once forward (its activation) and once "
                "backward (its gradient)",
            },
        },
    }
    if hlo_text is not None:
        found, _ = comms.collectives(hlo_text)
        ops = [
            c
            for c in found
            if c.kind == "collective-permute" and c.count and c.count % plan.ticks == 0
        ]
        compiled = {
            "source": source or "compiled",
            "ops": len(ops),
            "bytes_per_op": [c.bytes for c in ops],
            "runs": sum(c.count for c in ops),
            "static_bytes": sum(c.bytes * c.count for c in ops),
            "at_send_ticks_bytes": None,
            "what": "collective-permutes inside the tick loop; each sits in a conditional "
            "taken only at ticks with a send, so the static count (each one x the loop's "
            f"{plan.ticks} ticks) is an upper bound",
        }
        if len(ops) == 2 and ops[0].bytes == ops[1].bytes:  # one each way
            compiled["at_send_ticks_bytes"] = ops[0].bytes * (act_ticks + grad_ticks)
        out["p2p"]["compiled"] = compiled
    return out


def _p2p_row(label: str, nbytes: float, note: str = "") -> str:
    return f"    {label:<58}{fmt_bytes(nbytes):>12}  {note}".rstrip()


def _pipeline_lines(pp: dict) -> list[str]:
    p2p, msg = pp["p2p"], pp["message"]
    ex, fo = p2p["executor"], p2p["formula"]
    per_device = ", ".join(str(k) for k in pp["in_flight_per_device"])
    slots = pp["slots"]
    shape = " x ".join(str(k) for k in msg["shape"])
    lines = [
        "",
        f"pipeline: {pp['schedule']}, p={pp['p']} stages, v={pp['v']} chunk(s) of "
        f"{pp['layers_per_chunk']} layer(s) per device, m={pp['m']} micro-batches, "
        f"{pp['ticks']} ticks",
        f"  bubble (idle device-ticks, from the table)  {pp['bubble']:.1%}   formula "
        f"{pp['bubble_formula_text']} = {pp['bubble_formula']:.1%}",
        f"  micro-batch activations in flight          {pp['in_flight']} (per device: "
        f"{per_device}{'; one per micro-batch and chunk' if pp['v'] > 1 else ''})",
        f"  buffer slots (+1 spare each)               residuals {slots['res']}, activations "
        f"{slots['act']}, gradients {slots['grad']}"
        + (f", cotangents {slots['cot']}" if pp["schedule"] == "zb-h1" else ""),
        f"  point-to-point per step per device: message {shape} {msg['dtype']} = "
        f"{fmt_bytes(msg['bytes'])}",
        _p2p_row(
            f"executor: {ex['activation_ticks'] + ex['gradient_ticks']} sends "
            f"({ex['activation_ticks']} activation, {ex['gradient_ticks']} gradient ticks)",
            ex["bytes"],
        ),
        _p2p_row(
            f"formula 2·m·(v·p-1)/p = {fo['per_device']:g} messages",
            fo["bytes"],
            f"executor / formula {ex['bytes'] / fo['bytes']:.2f}",
        ),
    ]
    c = p2p.get("compiled")
    if c:
        each = sorted({fmt_bytes(b) for b in c["bytes_per_op"]})
        lines.append(
            _p2p_row(
                f"compiled: {c['ops']} collective-permutes ({', '.join(each) or '-'}), "
                f"{c['runs']} runs",
                c["static_bytes"],
                "static count: each at every tick",
            )
        )
        if c["at_send_ticks_bytes"] is not None:
            lines.append(_p2p_row("compiled, at the ticks with a send", c["at_send_ticks_bytes"]))
        lines.append(
            "    (each send sits in a conditional of the tick loop, taken at the ticks with "
            f"a send; read from the {c['source']} program)"
        )
    return lines


def plot_schedule(cfg: Config, path: str) -> str:
    """Draw the configured pipeline schedule (schedule_plot.draw); compiles nothing."""
    from ultrajax import schedule_plot

    p, v, m = cfg.mesh.pipeline, cfg.parallel.virtual_stages, cfg.train.grad_accum
    kind = cfg.parallel.pipeline_schedule
    if p == 1:
        raise ConfigError(
            "--plot-schedule: mesh.pipeline=1, so there is no pipeline schedule to draw; "
            "set mesh.pipeline > 1 (and train.grad_accum >= it)"
        )
    table = memory.pipeline_plan(cfg).table
    title = (
        f"{kind}: p={p}, m={m}, v={v}, bubble {schedule.bubble(table):.1%} "
        f"(formula {schedule.formula(kind, p, m, v):.1%})"
    )
    try:
        schedule_plot.draw(table, path, title=title)
    except RuntimeError as e:  # no matplotlib
        raise ConfigError(f"--plot-schedule: {e}") from None
    return title


def _row(label, predicted=None, compiled=None, indent=2, ratio=True) -> str:
    r = f"{predicted / compiled:6.2f}" if ratio and predicted and compiled else ""
    p = fmt_bytes(predicted) if predicted is not None else ""
    c = fmt_bytes(compiled) if compiled is not None else ""
    return f"{' ' * indent}{label:<{46 - indent}}{p:>12}{c:>12}  {r}".rstrip()


def format_report(r: dict) -> str:
    cf, p = r["config"], r["predicted"]
    mesh = " x ".join(f"{k}={v}" for k, v in cf["mesh"].items() if v > 1) or "one device"
    lines = [
        f"layout: {mesh} ({cf['devices']} device(s), {cf['backend']}); ZeRO-{cf['zero']}"
        f"{', SP' if cf['sequence_parallel'] else ''}; remat {cf['remat']}; "
        f"{cf['dtype']} compute, {cf['param_dtype']} master; attention {cf['attention']}",
        f"model: {cf['parameters']:,} parameters; per device {cf['micro_batch_size']} x "
        f"{cf['seq_len']} tokens per micro-batch, {cf['grad_accum']} micro-batches; "
        f"{cf['tokens_per_step']:,} tokens per step",
    ]
    lines += [f"note: {n}" for n in r["notes"]]
    c = r.get("compiled")
    lines.append("")
    lines.append(f"{'memory per device':<46}{'predicted':>12}{'compiled':>12}  ratio")
    parts = p["parts"]
    cf_dtype, cf_master = cf["dtype"], cf["param_dtype"]
    for key, label in (
        ("master", f"parameters (master, {cf_master})"),
        ("optimizer", "optimizer state (Adam mu, nu)"),
        ("batch", "batch (int32, 5 fields)"),
    ):
        lines.append(_row(label, parts[key], indent=4))
    lines.append(_row("= arguments", p["arguments"], c and c["argument"]))
    pipelined = p["pipelined"]
    reduced = "reduced after the ticks" if pipelined else "reduced"
    for key, label in (
        ("compute_copy", f"compute copy ({cf_dtype})"),
        ("gradients", f"gradients (fp32, {reduced})"),
        ("accumulators", "gradient accumulators (fp32)"),
        ("embed_grad", "whole embedding gradient (fp32)"),
        ("head_copy", "ZeRO-3 LM head, gathered (head backward)"),
    ):
        if parts[key]:
            lines.append(_row(label, parts[key], indent=4))
    saved = (
        "activations saved (pipeline buffers)" if pipelined else "activations saved for backward"
    )
    lines.append(_row(saved, parts["saved"], indent=4))
    for part, v in p["activations"].items():
        label = "norms and block inputs" if part == "norms" else part
        lines.append(_row(label, v, indent=6))
    lines.append(_row("logits and loss (working set)", parts["head_work"], indent=4))
    if pipelined:
        lines.append(
            _row("one chunk's residuals (the tick's own)", parts["chunk_residuals"], indent=4)
        )
    lines.append(_row("one layer's backward (working set)", parts["work"], indent=4))
    for phase, v in p["phases"].items():
        mark = "  <- peak" if phase == p["peak_phase"] else ""
        lines.append(f"      phase: {phase:<36}{fmt_bytes(v):>12}{mark}")
    lines.append(_row(f"= temporaries ({p['peak_phase']})", p["temp"], c and c["temp"]))
    lines.append(
        _row("outputs not aliased", p["outputs"], c and c["output"] - c["alias"], ratio=False)
    )
    lines.append(_row("= peak", p["peak"], c and c["peak"]))
    if p["host"]:
        lines.append(_row("pinned host memory (offloaded activations)", p["host"]))
    if c:
        lines.append(
            f"  XLA memory_analysis: argument {fmt_bytes(c['argument'])}, output "
            f"{fmt_bytes(c['output'])}, alias {fmt_bytes(c['alias'])}, temp {fmt_bytes(c['temp'])}"
            "; compiled peak = argument + output - alias + temp"
        )
    if "predicted_as_configured" in r:
        lines.append(
            f"  as configured (attention {cf['attention']}): predicted peak "
            f"{fmt_bytes(r['predicted_as_configured']['peak'])}"
        )
    v = r["verdict"]
    lines.append("")
    if v["fits"] is None:
        known = ", ".join(
            f"{name} {fmt_bytes(hardware.by_name(name).memory)}: {'fits' if ok else 'does not fit'}"
            for name, ok in v["known"].items()
        )
        lines.append(
            f"verdict: {v['source']} (pass --device-memory); predicted peak per device against "
            f"{known}"
        )
    else:
        word = "fits" if v["fits"] else "does NOT fit"
        lines.append(
            f"verdict: {word} in {fmt_bytes(v['device_memory'])} per device ({v['source']}): "
            f"predicted peak {v['fraction']:.0%} of it"
        )

    f = r["flops"]
    lines.append("")
    lines.append("FLOPs per step per device")
    lines.append(f"  model (6N + 12·L·h·s per token)        {f['model']:.4g}")
    lines.append(
        f"  hardware (+ recomputation)             {f['hardware']:.4g}"
        f"  (recomputed {f['recompute']:.4g})"
    )
    if "hlo_dots" in f:
        ratio = f" (hardware / compiled {f['ratio']:.3f})" if f.get("ratio") else ""
        lines.append(f"  compiled dots x loop trip counts       {f['hlo_dots']:.4g}{ratio}")
    for zigzag, per in (f.get("attention_per_device") or {}).items():
        on = "on " if zigzag else "off"
        lines.append(
            f"  attention, zig-zag {on} (per device)   max {max(per):.4g}  min {min(per):.4g}"
            f"  (max/min {max(per) / min(per):.2f})"
        )
    if f.get("note"):
        lines.append(f"  note: {f['note']}")
    if f.get("cost_analysis") is not None:
        lines.append(
            f"  XLA cost_analysis                      {f['cost_analysis']:.4g}  (reads each loop "
            f"body once: compare {f['hlo_dots_once']:.4g} dots counted once)"
        )

    if r.get("pipeline"):
        lines += _pipeline_lines(r["pipeline"])

    modes = r.get("communication_modes") or (
        {"": r["communication"]} if r.get("communication") else {}
    )
    for mode, comm in modes.items():
        if comm["total"]["traffic"] or comm["total"]["expected"]:
            lines += _communication_lines(comm, mode)
    return "\n".join(lines)


def _dtypes(shares: dict) -> str:
    total = sum(shares.values())
    if not total:
        return ",".join(shares) or "-"
    if len(shares) == 1:
        return next(iter(shares))
    return ", ".join(f"{k} {v / total:.0%}" for k, v in sorted(shares.items(), key=lambda x: -x[1]))


def _communication_lines(comm: dict, mode: str) -> list[str]:
    title = f"communication per step per device ({mode})" if mode else "communication"
    lines = ["", f"{title:<35}{'ops':>5} {'runs':>6} {'payload':>11} {'traffic':>11} "
             f"{'formula':>11}  ratio  dtypes"]  # fmt: skip
    for kind, row in comm["kinds"].items():
        if not row["ops"] and not row["expected"]:
            continue
        ratio = f"{row['ratio']:.3f}" if row["ratio"] is not None else "-"
        lines.append(
            f"  {kind:<33}{row['ops']:>5} {row['count']:>6} {fmt_bytes(row['payload']):>11} "
            f"{fmt_bytes(row['traffic']):>11} {fmt_bytes(row['expected']):>11}  {ratio:>5}  "
            f"{_dtypes(row.get('dtypes', {}))}"
        )
    t = comm["total"]
    ratio = f"{t['ratio']:.3f}" if t["ratio"] is not None else "-"
    lines.append(
        f"  {'total':<33}{'':>5} {'':>6} {'':>11} {fmt_bytes(t['traffic']):>11} "
        f"{fmt_bytes(t['expected']):>11}  {ratio:>5}"
    )
    for term in comm["terms"]:
        lines.append(
            f"  formula: {term['kind']} {term['what']}: {term['formula']} = "
            f"{fmt_bytes(term['traffic'])}"
        )
    source = (
        "the program as XLA's SPMD partitioner wrote it (the collectives and dtypes a GPU runs)"
        if comm.get("source") == "partitioned"
        else "the compiled program"
    )
    lines.append(
        f"  (read from {source}; traffic: what one device sends, ring algorithms; runs: "
        "executions per step, loop bodies times their trip counts; dtypes: shares of traffic)"
    )
    if "compiled_traffic" in comm and comm["compiled_traffic"] != t["traffic"]:
        lines.append(
            f"  the compiled {jax.default_backend()} program sends "
            f"{fmt_bytes(comm['compiled_traffic'])}: its backend rewrites collectives "
            "(XLA:CPU moves bf16 as f32)"
        )
    lines += [f"  note: {n}" for n in comm["notes"]]
    return lines


# --------------------------------------------------------------------------- plots


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError('--plot needs matplotlib: pip install -e ".[plot]"') from None
    return plt


def plot_breakdown(r: dict, path: str) -> None:
    """Stacked bars: the predicted breakdown beside XLA's compiled figures."""
    plt = _pyplot()
    p, parts = r["predicted"], r["predicted"]["parts"]
    unit, uname = (memory.GiB, "GiB") if p["peak"] > memory.GiB else (2**20, "MiB")
    phase = p["peak_phase"]
    predicted = [
        ("master weights", parts["master"]),
        ("Adam moments", parts["optimizer"]),
        ("batch + outputs", parts["batch"] + p["outputs"] + 8),
    ]
    if phase in memory.AFTER_BACKWARD:
        predicted.append(("optimizer temporaries", p["phases"][phase]))
    else:
        # mesh.pipeline > 1: the gradients are reduced after the ticks, not during them
        held = [
            ("compute copy", parts["compute_copy"]),
            ("gradients", 0 if p["pipelined"] else parts["gradients"]),
            ("fp32 accumulators", parts["accumulators"]),
            ("whole embedding gradient", 0 if p["pipelined"] else parts["embed_grad"]),
        ]
        saved = [(f"saved: {k}", v) for k, v in p["activations"].items()]
        work = p["phases"][phase] - p["held"] - parts["saved"]
        predicted += held + saved + [(f"working set ({phase})", work)]
    fig, ax = plt.subplots(figsize=(9, 6))
    colors = plt.get_cmap("tab20").colors
    bottom = 0.0
    for i, (label, v) in enumerate(predicted):
        if v <= 0:
            continue
        ax.bar(0, v / unit, bottom=bottom, color=colors[i % 20], label=label, width=0.6)
        bottom += v / unit
    c = r.get("compiled")
    if c:
        parts = [
            ("XLA: arguments", c["argument"], "#555555"),
            ("XLA: outputs not aliased", c["output"] - c["alias"], "#999999"),
            ("XLA: temporaries", c["temp"], "#cccccc"),
        ]
        bottom = 0.0
        for label, v, col in parts:
            ax.bar(1, v / unit, bottom=bottom, color=col, label=label, width=0.6, hatch="//")
            bottom += v / unit
        ax.text(
            1,
            bottom,
            f"{c['peak'] / unit:.2f} {uname}\npredicted / compiled {p['peak'] / c['peak']:.3f}",
            ha="center",
            va="bottom",
        )
    ax.text(0, p["peak"] / unit, f"{p['peak'] / unit:.2f} {uname}", ha="center", va="bottom")
    top = max(p["peak"], c["peak"] if c else 0) / unit
    ax.set_ylim(0, top * 1.15)
    ax.set_xticks([0, 1] if c else [0])
    ax.set_xticklabels(["predicted"] + (["compiled (XLA)"] if c else []))
    ax.set_xlim(-0.6, 2.9)
    ax.set_ylabel(f"{uname} per device")
    cf = r["config"]
    ax.set_title(
        f"Memory per device: {cf['parameters'] / 1e6:.1f}M params, ZeRO-{cf['zero']}, "
        f"remat {cf['remat']}, mbs {cf['micro_batch_size']} x seq {cf['seq_len']}"
    )
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
            e = memory.estimate(c)
            acts.append(e.parts.saved + e.parts.work)
            peaks.append(e.peak)
        out["policies"][pol] = {"activations": acts, "peak": peaks}
    out["model_states"] = memory.estimate(cfg).weights
    return out


def plot_sweep(cfg: Config, path: str, device_memory: int | None = None) -> dict:
    plt = _pyplot()
    data = sweep(cfg)
    fig, ax = plt.subplots(figsize=(9, 6))
    markers = {"none": "o", "selective": "s", "full": "^"}
    for i, (pol, d) in enumerate(data["policies"].items()):
        color = plt.get_cmap("tab10").colors[i]
        ax.plot(
            data["seq_len"],
            [a / memory.GiB for a in d["activations"]],
            color=color,
            marker=markers.get(pol, "."),
            label=f"activations, remat={pol}",
        )
        ax.plot(
            data["seq_len"],
            [p / memory.GiB for p in d["peak"]],
            color=color,
            ls=":",
            label=f"peak per device, remat={pol}",
        )
    ax.axhline(
        data["model_states"] / memory.GiB, color="k", ls="--", label="weights + Adam (master)"
    )
    if device_memory:
        ax.axhline(device_memory / memory.GiB, color="r", ls="-.", label="device memory")
    else:
        h100 = hardware.by_name("h100").memory
        ax.axhline(h100 / memory.GiB, color="r", ls="-.", label="H100 memory (80 GB)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("GiB per device (log)")
    m = cfg.model
    mesh = " x ".join(f"{k}={v}" for k, v in cfg.mesh.sizes().items() if v > 1) or "1 device"
    ax.set_title(
        f"Memory per device vs sequence length: {param_count(m) / 1e6:.1f}M params, "
        f"micro-batch {cfg.train.micro_batch_size}, {m.dtype}\n{mesh}, ZeRO-{cfg.parallel.zero}"
        f"{' + SP' if cfg.parallel.sequence_parallel else ''}, attention {m.attention} "
        "(predicted)"
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return data


# --------------------------------------------------------------------------- CLI


def main(argv=None) -> int:
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
    args = p.parse_args(argv)
    device_memory = None
    if args.device_memory is not None:
        try:
            device_memory = memory.parse_bytes(args.device_memory)
        except ValueError:
            raise ConfigError(
                f"--device-memory: {args.device_memory!r} is not a size; use e.g. 80GB, 80GiB "
                "or a number of bytes"
            ) from None
    for flag in ("plot", "plot_sweep", "plot_schedule"):
        path = getattr(args, flag)
        if path is not None and not path.lower().endswith((".png", ".pdf", ".svg")):
            raise ConfigError(f"--{flag.replace('_', '-')}: {path!r} should end in .png")
    cli.setup_devices(args)
    cfg = cli.load_config(args)
    n = jax.device_count()
    try:
        resolve_mesh(cfg, n)
    except ConfigError as e:
        sizes = cfg.mesh.sizes().values()
        want = math_prod(sizes) if -1 not in sizes else "N"
        hint = f" (on a CPU host, --cpu-devices {want} simulates that many devices)"
        raise ConfigError(f"{e}{'' if '--cpu-devices' in str(e) else hint}") from None
    for line in no_effect(cfg):
        print(f"warning: {line}", file=sys.stderr)
    title = plot_schedule(cfg, args.plot_schedule) if args.plot_schedule else None
    multi = math_prod(cfg.mesh.sizes().values()) > 1
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
    if args.plot:
        plot_breakdown(report, args.plot)
        report["plot"] = args.plot
    if args.plot_sweep:
        report["sweep"] = plot_sweep(cfg, args.plot_sweep, report["verdict"]["device_memory"])
        report["plot_sweep"] = args.plot_sweep
    if title is not None:
        report["plot_schedule"] = args.plot_schedule
        report["plot_schedule_title"] = title
    if args.json:
        json.dump(report, sys.stdout, indent=1, default=_jsonable)
        print()
    else:
        print(format_report(report))
        for key in ("plot", "plot_sweep", "plot_schedule"):
            if key in report:
                print(f"wrote {report[key]}")
    return 0


def _jsonable(x):
    if dataclasses.is_dataclass(x):
        return dataclasses.asdict(x)
    return float(x)


if __name__ == "__main__":
    cli.run(main)
