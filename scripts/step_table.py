"""The table of scripts/bench_gpu.sh's runs: each run's tokens/s, MFU both ways and peak
memory, with the ratios to transformers + torch.compile's, and packed documents against
the causal step.

    python scripts/step_table.py OUT_DIR "ultrajax-causal hf-compiled ..."

Reads OUT_DIR/<run>.txt for the runs named only (a file of a run not asked for is an
older call's, never reported): bench_step.py's table for ultrajax, the baseline's JSON
line for transformers.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

LABELS = {  # output file: the row's label, in the table's order
    "ultrajax-causal": "ultrajax, causal (defaults: auto attention, auto loss_chunk)",
    "ultrajax-selective": "ultrajax, causal, model.remat=selective",
    "ultrajax-scanned": "ultrajax, causal, model.remat=selective, layers as one scan",
    "ultrajax-packed": "ultrajax, packed documents (auto: the Pallas kernel), one a row",
    "ultrajax-packed-fused": "ultrajax, packed, model.attention_backward=fused",
    "ultrajax-packed-docs4": "ultrajax, packed, 4 documents a row (uneven)",
    "ultrajax-whole-logits": "ultrajax, causal, loss_chunk=0 (whole logits)",
    "ultrajax-full": "ultrajax, causal, model.remat=full",
    "ultrajax-offload": "ultrajax, causal, model.remat=offload (saved to pinned host), one scan",
    "hf-eager": "transformers eager",
    "hf-compiled": "transformers + torch.compile",
}
PACKED = {  # against the causal step: one document a row (the kernel skips nothing), four
    "ultrajax-packed": "packed, one document a row",
    "ultrajax-packed-fused": "packed, one document a row, fused backward",
    "ultrajax-packed-docs4": "packed, 4 documents a row",
}


def ultrajax(path: Path):
    """(tokens/s, (MFU, MFU causal), peak GiB or None) off bench_step.py's last row, its
    columns found by their names in the table's header."""
    rows = [r for r in path.read_text().splitlines() if r.startswith("| ") and "---" not in r]
    if len(rows) < 2:  # the header alone: the run failed or was skipped
        return None
    head, last = ([c.strip() for c in r.strip("|").split("|")] for r in (rows[0], rows[-1]))
    cell = dict(zip(head, last, strict=True))
    mem = cell["peak memory"].split()[0] if cell["peak memory"] != "-" else None
    tokens = float(cell["tokens/s"].replace(",", ""))
    return tokens, (cell["MFU"], cell["MFU causal"]), float(mem) if mem else None


def baseline(path: Path):
    """(tokens/s, no MFU, peak GiB) off the baseline script's last JSON line."""
    lines = [r for r in path.read_text().splitlines() if r.startswith("{")]
    if not lines:
        return None
    r = json.loads(lines[-1])
    return r["tokens_per_s"], ("", ""), r["peak_gib"]


def table(out: Path, wanted: list[str]) -> str:
    runs = {}
    for name in (n for n in LABELS if n in wanted):
        path = out / f"{name}.txt"
        read = baseline if name.startswith("hf-") else ultrajax
        runs[name] = read(path) if path.exists() else None
    base = runs.get("hf-compiled")
    lines = [
        "| run | tokens/s | MFU | MFU causal | peak GiB | tokens/s vs torch.compile "
        "| memory vs torch.compile |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in runs.items():
        if r is None:
            lines.append(f"| {LABELS[name]} | failed or skipped (see {name}.txt) | | | | | |")
            continue
        tps, (mfu, mfu_causal), mem = r
        ratio = f"{tps / base[0]:.3f}x" if base else "-"
        mratio = f"{mem / base[2]:.2f}x" if base and mem and base[2] else "-"
        mem_s = f"{mem:.1f}" if mem else "-"
        lines.append(f"| {LABELS[name]} | {tps:,.0f} | {mfu} | {mfu_causal} | {mem_s} | "
                     f"{ratio} | {mratio} |")  # fmt: skip
    causal = runs.get("ultrajax-causal")
    for name, label in PACKED.items():
        if causal and runs.get(name):
            lines.append(f"{label} / causal tokens/s: {runs[name][0] / causal[0]:.1%}")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: step_table.py OUT_DIR 'RUN RUN ...'", file=sys.stderr)
        return 2
    print(table(Path(argv[0]), argv[1].split()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
