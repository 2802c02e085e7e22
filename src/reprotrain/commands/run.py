"""``reprotrain run -- CMD ARGS``: start any command with what only works from process start.

Sets ``PYTHONHASHSEED=0`` (Python's str hashing, so set and dict order),
``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (cuBLAS reads it when its first handle is
made) and, with ``--cpu-profile``, the profile's ATen ISA, MKL and thread
variables (:mod:`reprotrain.cpu.profile`), then replaces itself with CMD. A
user script then needs only ``configure_determinism(...)`` and the
callbacks; :func:`reprotrain.determinism.reexec_with_fixed_hash_seed` stays
for scripts that restart themselves instead. Exported values of these
variables are replaced, and a warning line names each one replaced.
``TORCHINDUCTOR_CACHE_DIR`` becomes a folder inside the exported one (or Inductor's
default) for this torch build and C++ compiler
(:func:`reprotrain.provenance.toolchain.keyed_cache_dir`), so a ``torch.compile``'d
CMD never loads kernels another torch or compiler built.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping

from reprotrain.cpu.profile import LAUNCHED, CpuProfile
from reprotrain.determinism import CUBLAS_DETERMINISTIC_CONFIGS, FIXED_HASH_SEED
from reprotrain.pipeline.command import Command
from reprotrain.pipeline.errors import DataError
from reprotrain.provenance.toolchain import keyed_cache_dir

PARAMS: tuple[str, ...] = ()


def add_launch_arguments(parser: argparse.ArgumentParser, verb: str) -> None:
    """``-- CMD ARGS`` and the start-up pins: ``reprotrain run``'s, and ``verify -- CMD``'s."""
    # only verify gives each run a folder of its own; `run` passes CMD on as written
    own_folder = "; {out} in it becomes the run's own folder" if verb == "verify" else ""
    parser.add_argument(
        "cmd", nargs=argparse.REMAINDER, help=f"the command to {verb}, after `--`{own_folder}"
    )
    parser.add_argument(
        "--cpu-profile",
        choices=("portable", "native"),
        help="also pin the CPU kernels (docs/cpu-profile.md); default: leave them",
    )
    parser.add_argument(
        "--threads",
        type=at_least(1, "--threads 1"),
        help="only with --cpu-profile: its threads (native: ATen's intra-op; portable: its "
        "GEMM's; default 1)",
    )


def at_least(minimum: int, example: str, noun: str = "a whole number") -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum``; anything else refused by argparse (exit 2),
    in one line that ends with ``example``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r}: give {noun} >= {minimum}, e.g. {example}")
        return value

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_launch_arguments(parser, "run")


#: Never restarts itself: it starts CMD with the variables fixed instead.
COMMAND = Command(
    "run any command with the hash seed, cuBLAS and CPU pins fixed from its start", add_arguments
)


def launch_variables(profile: str | None = None, threads: int = 1) -> dict[str, str]:
    """The variables ``reprotrain run`` fixes, for a CPU ``profile`` (None: leave the CPU be)."""
    fixed = {
        "PYTHONHASHSEED": FIXED_HASH_SEED,
        "CUBLAS_WORKSPACE_CONFIG": CUBLAS_DETERMINISTIC_CONFIGS[0],
    }
    if profile is not None:
        chosen = CpuProfile(profile, threads)
        if problem := chosen.unsupported_here(way_out="use --cpu-profile native"):
            raise DataError(problem)  # before CMD starts: its OpenBLAS would die of SIGILL
        fixed.update(chosen.variables())
        fixed[LAUNCHED] = f"{profile}:{threads}"  # configure_determinism applies it in-process
    return fixed


def command_of(args: argparse.Namespace, verb: str) -> list[str]:
    """The command after ``--``; a missing one is a one-line error."""
    cmd = list(args.cmd or [])
    if cmd[:1] == ["--"]:
        cmd = cmd[1:]
    if not cmd:
        raise DataError(
            f"no command given; put it after `--`: reprotrain {verb} -- python train.py"
        )
    if not cmd[0].strip():  # exec would fail with no name to say what is wrong
        raise DataError(
            f"the command after `--` is empty ({cmd[0]!r}); name the program to {verb} first: "
            f"reprotrain {verb} -- python train.py"
        )
    return cmd


def launch_threads(args: argparse.Namespace) -> int:
    """``--threads``, 1 when not given; refused without ``--cpu-profile``, the only reader."""
    if args.threads is None:
        return 1
    if args.cpu_profile is None:
        raise DataError(
            f"--threads {args.threads}: needs --cpu-profile, the only thing that reads it; add "
            "--cpu-profile portable (or native), or drop --threads"
        )
    return args.threads


def launch_environment(args: argparse.Namespace, environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` with the launch variables in place; warns about each exported one replaced."""
    fixed = launch_variables(args.cpu_profile, launch_threads(args))
    for name, value in fixed.items():
        if name in environ and environ[name] != value:
            print(
                f"reprotrain: warning: {name}={environ[name]} replaced by {value}", file=sys.stderr
            )
    # A folder inside the user's (or Inductor's default) cache: no warning, nothing replaced.
    return {**environ, **fixed, "TORCHINDUCTOR_CACHE_DIR": keyed_cache_dir(environ)}


def run(_: object, args: argparse.Namespace) -> int:
    cmd = command_of(args, "run")
    env = launch_environment(args, os.environ)
    try:
        os.execvpe(cmd[0], cmd, env)
    except OSError as err:
        raise DataError(f"{cmd[0]}: {err.strerror}; check the command after `--`") from None
    return 0  # not reached: exec replaced this process
