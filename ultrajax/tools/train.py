"""`python -m ultrajax.train --config FILE [--cpu-devices N] [--print-config]
[section.key=value]`: the command around the loop."""

from __future__ import annotations

import copy
import logging
import math

from ultrajax import cli
from ultrajax.config.parse import dump
from ultrajax.config.schema import Config, ConfigError
from ultrajax.config.validate import resolve_mesh
from ultrajax.train import overlap
from ultrajax.train.checkpoint import SaveFailed
from ultrajax.train.loop import Diverged, train


def print_config(cfg: Config, devices: int | None, backend: str) -> None:
    """--print-config: the resolved config and the batch it implies, without a run.

    The figures are YAML comments, so the output is itself a config file. A mesh that
    does not fit the devices here is reported, not refused: the config may be meant
    for another machine."""
    fill = [k for k, v in cfg.mesh.sizes().items() if v == -1]
    where = f"not known here: {backend}" if devices is None else f"{devices} ({backend})"
    if devices is not None and fill:
        filled = copy.deepcopy(cfg)
        try:
            resolve_mesh(filled, devices)
            cfg, fill = filled, []
        except ConfigError as e:
            where += f"; mesh.{fill[0]}=-1 cannot be filled from them: {e}"
    t, sizes = cfg.train, cfg.mesh.sizes()
    need = math.prod(sizes.values())
    if devices is not None and not fill and need != devices:
        where += f"; this mesh needs {need}"
    lines = [dump(cfg).rstrip(), "# derived (comments: this output is itself a config file)"]
    if fill:
        lines.append(
            f"# global batch: {t.micro_batch_size} micro-batch x {t.grad_accum} grad accumulation"
            f" x dp; dp (data x fsdp x expert) waits for mesh.{fill[0]}=-1, filled at start"
        )
    else:
        lines += [
            f"# global batch: {cfg.global_batch} sequences = {t.micro_batch_size} micro-batch"
            f" x {t.grad_accum} grad accumulation x {cfg.dp} dp",
            f"# tokens per step: {cfg.tokens_per_step:,} = {cfg.global_batch} sequences x "
            f"{cfg.model.seq_len} seq_len",
            f"# dp: {cfg.dp} = data {cfg.mesh.data} x fsdp {cfg.mesh.fsdp}"
            + (f" x expert {cfg.mesh.expert}" if cfg.mesh.expert > 1 else ""),
        ]
    mesh = " ".join(f"{k}={v}" for k, v in sizes.items())
    lines.append(f"# mesh: {mesh}" + ("" if fill else f" ({need} device{'s' * (need > 1)})"))
    lines.append(f"# devices: {where}")
    print("\n".join(lines))


def _one_line_orbax_errors(record: logging.LogRecord) -> bool:
    """Keep an Orbax thread's error record, less its traceback."""
    if record.levelno >= logging.ERROR and "orbax" in record.pathname:
        record.exc_info, record.exc_text = None, None
    return True


def main(argv=None) -> int:
    p = cli.parser("ultrajax.train", "Train a Llama-style model.")
    p.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved config and the batch it implies, then exit without training",
    )
    args = p.parse_args(argv)
    if args.print_config:  # before setup_devices: looking must not join a multi-process run
        cfg = cli.load_config(args)
        print_config(cfg, *cli.device_count(args))
        return 0
    cli.setup_devices(args)  # simulated devices; joins a multi-process run if started as one
    cfg = cli.load_config(args)
    overlap.apply(cfg.parallel)  # before the backend starts
    # Orbax's writer threads log a failed save with its whole traceback (a page per
    # thread); the failure is said once, in one line, when the run waits for it
    logging.getLogger("absl").addFilter(_one_line_orbax_errors)
    try:
        return train(cfg)
    except (Diverged, SaveFailed) as e:
        if isinstance(e, SaveFailed):  # its writes' futures, said again as they are collected
            logging.getLogger("asyncio").addFilter(lambda r: "never retrieved" not in r.msg)
        cli.fail(str(e), code=1)
