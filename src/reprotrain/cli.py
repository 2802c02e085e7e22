"""The ``reprotrain`` command: one sub-command per pipeline stage, plus ``params``.

Stage commands first restart the interpreter with ``PYTHONHASHSEED`` fixed
(before torch is imported), then load ``params.yaml`` once, apply overrides
(``--seed 7``, ``--deterministic warn``, ``-S train.lr=0.01``) and run the
stage. Exit codes: 0 done; 2 bad input (params, data or model file), nothing
written; 3 the determinism guarantee cannot be honoured in this process.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from types import ModuleType

STAGES = ("prepare", "train", "evaluate")
EXIT_BAD_INPUT = 2
EXIT_NOT_DETERMINISTIC = 3


def _stage_module(name: str) -> ModuleType:
    return importlib.import_module(f"reprotrain.pipeline.{name}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="reprotrain", description="Bitwise-reproducible Lightning training with DVC."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in STAGES:
        module = _stage_module(name)
        sub = commands.add_parser(name, help=module.__doc__.splitlines()[0])
        if module.PARAMS:
            _add_param_options(sub)
        module.add_arguments(sub)
    params = commands.add_parser("params", help="print the resolved params, or the defaults")
    _add_param_options(params)
    params.add_argument("--defaults", action="store_true", help="print a default params.yaml")
    return parser


def _add_param_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--params", type=Path, default=Path("params.yaml"), help="params file")
    parser.add_argument("--seed", type=int, help="override `seed`")
    parser.add_argument(
        "--deterministic", choices=("true", "false", "warn"), help="override `deterministic`"
    )
    parser.add_argument(
        "-S",
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override any key, e.g. -S train.lr=0.01 (as in `dvc exp run -S`)",
    )


def _overrides(args: argparse.Namespace) -> list[str]:
    extra = [] if args.seed is None else [f"seed={args.seed}"]
    if args.deterministic is not None:
        extra.append(f"deterministic={args.deterministic}")
    return [*args.overrides, *extra]


def main(argv: list[str] | None = None) -> int:
    """Entry point. ``argv=None`` means a real process start (may re-exec itself)."""
    if argv is None:
        from reprotrain.determinism import reexec_with_fixed_hash_seed

        if len(sys.argv) > 1 and sys.argv[1] in STAGES:
            reexec_with_fixed_hash_seed()
        argv = sys.argv[1:]
    args = build_parser().parse_args(argv)

    from reprotrain.determinism import DeterminismError
    from reprotrain.pipeline.config import ConfigError, load_params, render_defaults
    from reprotrain.pipeline.data import DataError

    try:
        if args.command == "params":
            if args.defaults:
                print(render_defaults(), end="")
            else:
                print(load_params(args.params, _overrides(args)))
            return 0
        module = _stage_module(args.command)
        params = load_params(args.params, _overrides(args)) if module.PARAMS else None
        print(f"reprotrain {args.command}: {module.run(params, args)}")
        return 0
    except (ConfigError, DataError) as err:
        print(f"reprotrain: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except DeterminismError as err:
        print(f"reprotrain: error: {err}", file=sys.stderr)
        return EXIT_NOT_DETERMINISTIC
