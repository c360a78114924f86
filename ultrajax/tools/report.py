"""The analyzer's text: memory, FLOPs, communication and the pipeline, predicted
beside compiled."""

from __future__ import annotations

import jax

from ultrajax.config.schema import Config
from ultrajax.cost import activations as activations_lib
from ultrajax.cost import comms, hardware, sizes
from ultrajax.cost.units import fmt_bytes
from ultrajax.parallel.pipeline import schedules as schedule
from ultrajax.tools import hlo

# --------------------------------------------------------------------------- pipeline


def pipeline_report(cfg: Config, hlo_text: str | None = None, source: str = "") -> dict | None:
    """The schedule the executor runs (mesh.pipeline > 1), read off its own table, and its
    point-to-point bytes per step per device three ways: what the executor sends, the
    textbook count, and (given the HLO) the compiled collective-permutes."""
    p, v, m = cfg.mesh.pipeline, cfg.parallel.virtual_stages, cfg.train.grad_accum
    if p == 1:
        return None
    plan = activations_lib.pipeline_plan(cfg)
    table, kind = plan.table, plan.kind
    message = comms.pipeline_message_bytes(cfg)
    d = sizes.dims(cfg)
    out = {
        "schedule": kind,
        "p": p,
        "m": m,
        "v": v,
        "ticks": plan.ticks,
        "layers_per_chunk": cfg.model.n_layers // (p * v),
        "bubble": schedule.bubble(table),
        "bubble_formula": schedule.formula(kind, p, m, v),
        "bubble_formula_text": schedule.SCHEDULES[kind].bubble,
        "in_flight": schedule.in_flight(table),
        "in_flight_per_device": schedule.in_flight_per_device(table),
        "slots": dict(plan.slots),
        "message": {
            "bytes": message,
            "shape": [d.b, d.s_res, d.h],
            "dtype": cfg.model.dtype,
        },
        "p2p": _p2p_counts(plan, message, p),
    }
    if hlo_text is not None:
        out["p2p"]["compiled"] = _compiled_sends(plan, hlo_text, source)
    return out


def _send_ticks(plan) -> tuple[int, int]:
    """(ticks where some device sends an activation, ticks where some sends a gradient)."""
    act_ticks, grad_ticks = (int(x) for x in plan.sends.sum(axis=0))
    return act_ticks, grad_ticks


def _p2p_counts(plan, message: float, p: int) -> dict:
    """Point-to-point messages per step per device: as the executor sends them (a
    collective at every tick with a send), and as the textbook counts them."""
    act_ticks, grad_ticks = _send_ticks(plan)
    activations, gradients = schedule.p2p_messages(plan.table)
    return {
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
    }


def _compiled_sends(plan, hlo_text: str, source: str) -> dict:
    """The collective-permutes of the tick loop in the compiled (or partitioned) HLO: a
    static count, and where there is one each way, the bytes at the ticks with a send."""
    found, _ = hlo.collectives(hlo_text)
    ops = [
        c for c in found if c.kind == "collective-permute" and c.count and c.count % plan.ticks == 0
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
        compiled["at_send_ticks_bytes"] = ops[0].bytes * sum(_send_ticks(plan))
    return compiled


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
        f"  buffer slots                               residuals {slots['res']}, activations "
        f"{slots['act']} (+1 spare), gradients {slots['grad']} (+1 spare)"
        + (
            f", cotangents {slots['cot']}"
            if schedule.SCHEDULES[pp["schedule"]].splits_backward
            else ""
        ),
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


def _row(label, predicted=None, compiled=None, indent=2, ratio=True) -> str:
    r = f"{predicted / compiled:6.2f}" if ratio and predicted and compiled else ""
    p = fmt_bytes(predicted) if predicted is not None else ""
    c = fmt_bytes(compiled) if compiled is not None else ""
    return f"{' ' * indent}{label:<{46 - indent}}{p:>12}{c:>12}  {r}".rstrip()


def format_report(r: dict) -> str:
    """The analyzer's tables, top to bottom: the layout, memory per device predicted
    beside compiled, the verdict, FLOPs, the pipeline, communication per mode."""
    lines = _header_lines(r)
    lines += _memory_lines(r["config"], r["predicted"], r.get("compiled"))
    if "predicted_as_configured" in r:
        lines.append(
            f"  as configured (attention {r['config']['attention']}): predicted peak "
            f"{fmt_bytes(r['predicted_as_configured']['peak'])}"
        )
    lines += _verdict_lines(r["verdict"])
    lines += _flops_lines(r["flops"])
    if r.get("pipeline"):
        lines += _pipeline_lines(r["pipeline"])
    modes = r.get("communication_modes") or (
        {"": r["communication"]} if r.get("communication") else {}
    )
    for mode, comm in modes.items():
        if comm["total"]["traffic"] or comm["total"]["expected"]:
            lines += _communication_lines(comm, mode)
    return "\n".join(lines)


def _predicted_attention(r: dict) -> str:
    """Which attention the memory is predicted for, where `model.attention` leaves it open:
    a GPU's kernel, so a CPU run of the same config (another attention) predicts otherwise."""
    name, platform = r.get("predicted_attention"), r.get("predicted_platform")
    if name is None or name == r["config"]["attention"]:
        return ""
    if platform == "compiled":
        return f" (memory predicted for {name}, the attention compiled here)"
    return f" (memory predicted for {name}, as a {platform} runs it)"


def _header_lines(r: dict) -> list[str]:
    """The layout and batch in two lines, then the notes on what compiling changed."""
    cf = r["config"]
    mesh = " x ".join(f"{k}={v}" for k, v in cf["mesh"].items() if v > 1) or "one device"
    lines = [
        f"layout: {mesh} ({cf['devices']} device(s), {cf['backend']}); ZeRO-{cf['zero']}"
        f"{', SP' if cf['sequence_parallel'] else ''}; remat {cf['remat']}; "
        f"{cf['dtype']} compute, {cf['param_dtype']} master; attention {cf['attention']}"
        + _predicted_attention(r),
        f"model: {cf['parameters']:,} parameters; per device {cf['micro_batch_size']} x "
        f"{cf['seq_len']} tokens per micro-batch, {cf['grad_accum']} micro-batches; "
        f"{cf['tokens_per_step']:,} tokens per step; "
        + _loss_chunk(cf.get("loss_chunk"), cf["seq_len"]),
    ]
    return lines + [f"note: {n}" for n in r["notes"]]


def _loss_chunk(chunk: int | None, seq_len: int) -> str:
    """model.loss_chunk as resolved: the head and loss whole, or in chunks of the sequence."""
    if not chunk or chunk >= seq_len:
        return "LM head and loss over the whole sequence"
    return f"LM head and loss in chunks of {chunk} tokens (model.loss_chunk)"


def _memory_lines(cf: dict, p: dict, c: dict | None) -> list[str]:
    """Memory per device: the arguments, then the temporaries at the peak phase, each
    predicted term beside XLA's figure where it has one."""
    lines = ["", f"{'memory per device':<46}{'predicted':>12}{'compiled':>12}  ratio"]
    parts = p["parts"]
    for key, label in (
        ("master", f"parameters (master, {cf['param_dtype']})"),
        ("optimizer", "optimizer state (Adam mu, nu)"),
        ("batch", "batch (int32, 5 fields)"),
    ):
        lines.append(_row(label, parts[key], indent=4))
    lines.append(_row("= arguments", p["arguments"], c and c["argument"]))
    lines += _held_rows(cf, p)
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
    return lines


def _held_rows(cf: dict, p: dict) -> list[str]:
    """The temporaries' terms: gradients and copies, saved activations by part, the
    working sets (a pipeline holds its buffers and reduces gradients after its ticks)."""
    parts, pipelined = p["parts"], p["pipelined"]
    reduced = "reduced after the ticks" if pipelined else "reduced"
    lines = []
    for key, label in (
        ("compute_copy", f"compute copy ({cf['dtype']})"),
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
    return lines


def _verdict_lines(v: dict) -> list[str]:
    """Fits or not in the given device memory; with none given (a CPU host), against
    each known accelerator's."""
    if v["fits"] is None:
        known = ", ".join(
            f"{name} {fmt_bytes(hardware.by_name(name).memory)}: {'fits' if ok else 'does not fit'}"
            for name, ok in v["known"].items()
        )
        return [
            "",
            f"verdict: {v['source']} (pass --device-memory); predicted peak per device against "
            f"{known}",
        ]
    word = "fits" if v["fits"] else "does NOT fit"
    return [
        "",
        f"verdict: {word} in {fmt_bytes(v['device_memory'])} per device ({v['source']}): "
        f"predicted peak {v['fraction']:.0%} of it",
    ]


def _flops_lines(f: dict) -> list[str]:
    """FLOPs per step per device: the model's, the hardware's, and what compiled."""
    lines = [
        "",
        "FLOPs per step per device",
        f"  model (6N + 12·L·h·s per token)        {f['model']:.4g}",
        f"  hardware (+ recomputation)             {f['hardware']:.4g}"
        f"  (recomputed {f['recompute']:.4g})"
        + (f" (MoE's dense grouped matmuls {f['grouped']:.4g})" if f.get("grouped") else ""),
    ]
    if f.get("fp8"):
        share = f["fp8"] / f["model"]
        lines.append(
            f"  of the model's, FP8 matmuls            {f['fp8']:.4g}  ({share:.0%}: counted at "
            "the FP8 peak in MFU and the planner)"
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
    return lines


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
