"""The ``reprotrain`` command: the pipeline stages and the tools around them.

Every sub-command is a module in :mod:`reprotrain.pipeline` with ``PARAMS``,
``add_arguments`` and ``run``; only the chosen one is imported, so light
commands (``env``) never pay for importing torch. ``run`` returns a one-line
summary to print, or an exit code when it printed its own output. Commands
that train or configure determinism first restart the interpreter with
``PYTHONHASHSEED`` fixed, before torch is imported. Commands that read
``params.yaml`` load it once and apply overrides (``--seed 7``,
``--deterministic warn``, ``-S train.lr=0.01``).

Exit codes: 0 done; 1 a check failed (``checklist --strict``; ``verify``,
``compare`` or ``locate`` found a difference); 2 bad input
(params, data, model, lock or record file), nothing written; 3 the
determinism guarantee cannot be honoured in this process.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from types import ModuleType

from reprotrain.pipeline.config import add_override_option

#: Sub-command -> one-line help. Each is the module reprotrain.pipeline.<name> ("-" -> "_").
COMMANDS = {
    "env": "record the environment that decides the bits",
    "prepare": "materialise and split the dataset",
    "train": "train the model deterministically",
    "evaluate": "score the test split",
    "fingerprint": "print the run ID the train stage would have now",
    "checklist": "reproducibility checklist: pass / warn / fail per item",
    "verify": "rerun training in fresh processes and check the bits are identical",
    "compare": "compare two runs (folders or git revisions): where and why they differ",
    "locate": "name the module whose output or gradient differs between two equal steps",
    "noise-floor": "how far same-seed runs drift with determinism off and on",
    "bench": "step-time cost of determinism and of cuDNN autotuning, paired and interleaved",
    "ops": "catalog of ops with non-deterministic default paths, measured on this device",
}
#: Commands that need PYTHONHASHSEED fixed at interpreter start; `env` and
#: `checklist` too, so the variables they record are the ones the stages run with.
REEXEC = (
    "env",
    "prepare",
    "train",
    "evaluate",
    "fingerprint",
    "checklist",
    "verify",
    "locate",
    "noise-floor",
    "bench",
    "ops",
)
EXIT_CHECK_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_NOT_DETERMINISTIC = 3


def _module(name: str) -> ModuleType:
    return importlib.import_module(f"reprotrain.pipeline.{name.replace('-', '_')}")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The argument parser; with ``only``, just that sub-command's module is imported."""
    parser = argparse.ArgumentParser(
        prog="reprotrain", description="Bitwise-reproducible Lightning training with DVC."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, summary in COMMANDS.items():
        sub = commands.add_parser(name, help=summary, description=summary)
        if only in (None, name):
            module = _module(name)
            if module.PARAMS:
                add_param_options(sub)
            module.add_arguments(sub)
    params = commands.add_parser("params", help="print the resolved params, or the defaults")
    add_param_options(params)
    params.add_argument("--defaults", action="store_true", help="print a default params.yaml")
    return parser


def add_param_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--params", type=Path, default=Path("params.yaml"), help="params file")
    parser.add_argument("--seed", type=int, help="override `seed`")
    parser.add_argument(
        "--deterministic", choices=("true", "false", "warn"), help="override `deterministic`"
    )
    add_override_option(parser, "override any key, e.g. -S train.lr=0.01 (as in `dvc exp run -S`)")


def overrides(args: argparse.Namespace) -> list[str]:
    """The ``key=value`` overrides given on the command line, in order."""
    extra = [] if args.seed is None else [f"seed={args.seed}"]
    if args.deterministic is not None:
        extra.append(f"deterministic={args.deterministic}")
    return [*args.overrides, *extra]


def main(argv: list[str] | None = None) -> int:
    """Entry point. ``argv=None`` means a real process start (may re-exec itself)."""
    if argv is None:
        argv = sys.argv[1:]
        if argv and argv[0] in REEXEC:
            from reprotrain.determinism import reexec_with_fixed_hash_seed

            reexec_with_fixed_hash_seed()
    command = argv[0] if argv and argv[0] in COMMANDS else None
    args = build_parser(only=command).parse_args(argv)

    from reprotrain.determinism import DeterminismError
    from reprotrain.pipeline.config import ConfigError, load_params, render_defaults
    from reprotrain.pipeline.errors import DataError
    from reprotrain.provenance import ChecksumError

    def bad_input() -> tuple[type[Exception], ...]:
        # Evaluated when an exception is matched. reprotrain.resume imports Lightning
        # (seconds); a CheckpointError can only come from a command that imported it.
        resume = sys.modules.get("reprotrain.resume")
        extra = (resume.CheckpointError,) if resume is not None else ()
        return (ConfigError, DataError, ChecksumError, *extra)

    try:
        if args.command == "params":
            text = (
                render_defaults()
                if args.defaults
                else f"{load_params(args.params, overrides(args))}\n"
            )
            print(text, end="")
            return 0
        module = _module(args.command)
        params = load_params(args.params, overrides(args)) if module.PARAMS else None
        result = module.run(params, args)
        if isinstance(result, int):
            return result
        print(f"reprotrain {args.command}: {result}")
        return 0
    except bad_input() as err:
        print(f"reprotrain: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except DeterminismError as err:
        print(f"reprotrain: error: {err}", file=sys.stderr)
        return EXIT_NOT_DETERMINISTIC
