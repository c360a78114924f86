"""What every command-line tool shares: arguments, device set-up, one-line errors.

Bad input never produces a traceback: a ConfigError becomes `error: <message>`
on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import jax

from ultrajax.config import parse
from ultrajax.config import schema as config_lib
from ultrajax.train import distributed, preemption


class ArgumentParser(argparse.ArgumentParser):
    """Every command's parser: argparse's own errors become one line with the usage and
    exit status 2, and options and overrides come in any order."""

    def error(self, message):
        usage = " ".join(self.format_usage().split())  # "usage: python -m ... [--config ...]"
        fail(f"{self.prog}: {message} ({usage}; --help lists the options)")

    def parse_args(self, args=None, namespace=None):
        if self._subparsers is not None:  # intermixed parsing cannot hand over to a subcommand
            return super().parse_args(args, namespace)
        return self.parse_intermixed_args(args, namespace)


def fail(message: str, code: int = 2):
    print(f"error: {message}", file=sys.stderr)
    exit_failed(code)


def exit_failed(code: int) -> NoReturn:
    """Exit with a failure status. In a multi-process run, at once: JAX's client, torn
    down at interpreter exit, first waits at a barrier for every other process, and a
    process failing alone then waits for processes that wait for it (in a collective, or
    in the backend's start). Gone at once, the coordinator sees it and stops the others."""
    if distributed.joined():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def parser(prog: str, description: str, *, config_required: bool = True) -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog=prog,
        description=description,
        epilog=parse.keys_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", required=config_required, help="YAML config file")
    p.add_argument(
        "--cpu-devices",
        type=int,
        default=None,
        metavar="N",
        help="simulate N devices on a CPU host (sets jax_num_cpu_devices)",
    )
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=50")
    distributed.add_arguments(p)
    return p


# XLA:CPU runs N simulated devices on a pool of N threads by default (PJRT_NPROC sizes
# it), and a collective blocks its thread until every member arrives: a device whose
# program runs two independent collectives at once takes two, and the last devices to
# arrive may find none left. The likely cause of an 8-device ZeRO-3 resume that hung at
# its gradient all-reduces in 3 of 7 runs on 2-core hosts (never past 600 s). A few
# threads per device leave room.
CPU_THREADS, THREADS_PER_CPU_DEVICE = "PJRT_NPROC", 4


def setup_devices(args: argparse.Namespace | int | None) -> None:
    """Must run before anything asks JAX for devices: simulated CPU devices, then
    joining a multi-process run (explicit flags on `args`, or SLURM / Open MPI)."""
    cpu_devices = (
        getattr(args, "cpu_devices", None) if isinstance(args, argparse.Namespace) else args
    )
    if cpu_devices is not None:
        if cpu_devices < 1:
            fail("--cpu-devices must be >= 1")
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", cpu_devices)
        os.environ.setdefault(CPU_THREADS, str(THREADS_PER_CPU_DEVICE * cpu_devices))
    try:
        distributed.initialize(args if isinstance(args, argparse.Namespace) else None)
    except config_lib.ConfigError as e:
        fail(str(e))


def device_count(args: argparse.Namespace) -> tuple[int | None, str]:
    """(devices, where the figure comes from) without joining a multi-process run.

    --cpu-devices N says it outright; one process starts only its local backend (with
    no GPU memory preallocated: a look must not take memory from a run on the same GPUs);
    the processes of a multi-process run are only known once it is joined."""
    if getattr(args, "cpu_devices", None) is not None:
        if args.cpu_devices < 1:
            fail("--cpu-devices must be >= 1")
        return args.cpu_devices, "cpu, --cpu-devices"
    try:
        joining = distributed.joining(
            getattr(args, "coordinator", None),
            getattr(args, "num_processes", None),
            getattr(args, "process_id", None),
        )
    except config_lib.ConfigError as e:
        fail(str(e))
    if joining is not None:
        return None, f"a {joining.num_processes}-process run ({joining.source}), not joined"
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    return jax.device_count(), jax.default_backend()


def check_picture(path: str | None, flag: str) -> None:
    """A picture a command writes at its end (matplotlib, in the format its suffix names):
    an image suffix and a directory that exists, checked before the work, not found
    missing after it."""
    if path is None:
        return
    if not path.lower().endswith((".png", ".pdf", ".svg")):
        raise config_lib.ConfigError(f"{flag}: {path!r} should end in .png, .pdf or .svg")
    if not Path(path).parent.is_dir():
        raise config_lib.ConfigError(f"{flag}: the directory {Path(path).parent} does not exist")


def load_config(args) -> config_lib.Config:
    """The config of the command line; in a multi-process run, also process 0's."""
    try:
        cfg = parse.load(args.config, args.overrides)
        distributed.check_same_config(parse.dump(cfg))
        return cfg
    except config_lib.ConfigError as e:
        fail(str(e))


def run(main: Callable[[], int | None]) -> None:
    """Call main; ConfigError anywhere below becomes a one-line error with status 2, a
    reader that left (`| head`) ends the command quietly, Ctrl-C with status 130."""
    try:
        code = main()
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's last flush
    except config_lib.ConfigError as e:
        fail(str(e))
    except BrokenPipeError:
        reader_gone()
    except KeyboardInterrupt:
        # os._exit inside: XLA may still be compiling on a thread of its own, and the
        # interpreter's teardown under it is a segmentation fault (train/preemption.py)
        preemption.exit_now("interrupted")
    except Exception:
        if not distributed.joined():
            raise
        traceback.print_exc()
        exit_failed(1)
    if code and code not in preemption.STOPPED:
        exit_failed(code)  # a failure exits at once
    distributed.shutdown()  # with the other processes: they finished, or stopped alike
    sys.exit(code or 0)


def reader_gone() -> NoReturn:
    """The output's reader closed the pipe (`| head` has its lines): stop without a
    traceback, with status 141 as if killed by SIGPIPE. Python ignores SIGPIPE, so the
    write raised BrokenPipeError instead; stdout now points at /dev/null, so the
    interpreter's last flush has nothing to fail on (the Python docs' advice)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # no descriptor to point: nothing buffered there either
        pass
    sys.exit(141)
