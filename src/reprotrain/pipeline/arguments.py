"""Every ``reprotrain`` sub-command's arguments, defined without importing torch.

The CLI builds its parser from :data:`COMMANDS` and imports a command's module
only to run it, so every ``--help`` and every argument error answers at once
(torch and Lightning take seconds to import). The same parsers read a stage's
command line back from ``dvc.yaml`` (:func:`stage_arguments`): ``run-id``,
``checklist``, ``verify`` and ``compare`` look at the files the pipeline uses,
and ``dvc.yaml`` stays the one place where paths are written down.

This module imports nothing heavier than PyYAML; tests/test_cli.py checks that
parsing any command leaves torch unimported.
"""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import yaml

from reprotrain.pipeline.errors import DataError

#: Names the lock the env stage checks when ``--lock`` is not given; the Dockerfile sets it.
LOCK_VARIABLE = "REPROTRAIN_LOCK"
DEFAULT_LOCK = Path("requirements-cpu.lock")
DVC_YAML = Path("dvc.yaml")
STAGES = ("env", "prepare", "train", "evaluate")

AddArguments = Callable[[argparse.ArgumentParser], None]


def add_override_option(parser: argparse.ArgumentParser, example: str) -> None:
    """``-S KEY=VALUE`` (repeatable, as in ``dvc exp run -S``) into ``args.overrides``."""
    parser.add_argument(
        "-S",
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=example,
    )


def _paths(parser: argparse.ArgumentParser, spec: dict[str, str], required: bool) -> None:
    for name, help_text in spec.items():
        parser.add_argument(f"--{name}", type=Path, required=required, help=help_text)


def _dvc_yaml(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dvc-yaml", type=Path, default=DVC_YAML, help="pipeline file")


def _env(parser: argparse.ArgumentParser) -> None:
    what = parser.add_mutually_exclusive_group()
    what.add_argument(
        "--lock",
        type=Path,
        help=f"requirements lock the install should match (default: ${LOCK_VARIABLE}, "
        f"else {DEFAULT_LOCK})",
    )
    what.add_argument(
        "--diff",
        nargs=2,
        type=Path,
        metavar=("A", "B"),
        help="explain how two environment records differ and which changes void the guarantee",
    )
    parser.add_argument(
        "--out", type=Path, help="write the part that decides the bits here (default: print all)"
    )
    parser.add_argument(
        "--host-out", type=Path, help="with --out: write the informational host facts here"
    )
    parser.add_argument(
        "--raw-dir",
        type=Path,
        help="check params.yaml and the raw data in this folder first (what dvc.yaml does), "
        "so bad input stops `dvc repro` before any output is deleted",
    )
    parser.add_argument(
        "--params",
        type=Path,
        help="params file (its CPU profile is part of the record; checked with --raw-dir); "
        "default params.yaml, or when printing outside a repository, the default params",
    )


def _prepare(parser: argparse.ArgumentParser) -> None:
    _paths(
        parser,
        {"raw-dir": "folder of user raw data", "out": "prepared dataset file to write"},
        True,
    )


def _train(parser: argparse.ArgumentParser) -> None:
    _paths(
        parser,
        {
            "data": "prepared dataset file",
            "model": "weights to write",
            "metrics": "training metrics JSON",
            "plots": "folder for curve CSVs",
            "env": "environment record (env stage)",
            "run-record": "run.json to write",
            "checkpoints": "checkpoint folder",
        },
        True,
    )
    _paths(
        parser,
        {
            "trace": "per-step trace to write (read by compare)",
            "dvc-lock": "verify --data against this dvc.lock",
        },
        False,
    )
    parser.add_argument(
        "--evidence",
        action="store_true",
        help="record drift from the lock instead of refusing it, for measurements on a host "
        "not built from the lock (benchmarks/gpu_evidence.py); never used by dvc.yaml",
    )


def _evaluate(parser: argparse.ArgumentParser) -> None:
    _paths(
        parser,
        {
            "data": "prepared dataset file",
            "model": "trained weights",
            "metrics": "test metrics JSON",
            "plots": "folder for confusion CSV",
        },
        True,
    )
    _paths(parser, {"dvc-lock": "verify --data and --model against it"}, False)


def _run_id(parser: argparse.ArgumentParser) -> None:
    _dvc_yaml(parser)
    parser.add_argument("--json", action="store_true", help="print the inputs as JSON too")


def _checklist(parser: argparse.ArgumentParser) -> None:
    _dvc_yaml(parser)
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--strict", action="store_true", help="exit 1 if any item fails")


def _verify(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runs", type=int, default=2, help="fresh training runs (>= 2)")
    parser.add_argument(
        "--world-sizes",
        metavar="N",
        type=int,
        nargs="+",
        help="one run per world size N (train.devices=N, ddp above 1), instead of --runs: "
        "with train.world_size_invariant they must be identical",
    )
    parser.add_argument("--against", metavar="REV", help="compare a fresh run with REV's outputs")
    parser.add_argument(
        "--reference",
        metavar="REV",
        nargs="?",
        const="HEAD",
        help="one `dvc repro` in a clone of REV (default HEAD): are dvc.lock and reports/ as "
        "git holds them? Needs no DVC cache",
    )
    _dvc_yaml(parser)
    parser.add_argument(
        "--workdir", type=Path, help="keep the run folders here (default: a temporary folder)"
    )
    parser.add_argument("--json", action="store_true", help="print the comparisons as JSON")
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="runs trained side by side (default 1: on a small machine they compete for cores)",
    )
    add_override_option(parser, "params override for every run, e.g. -S train.accelerator=gpu")
    _any_command(parser, "verify")
    parser.add_argument(
        "--output",
        dest="outputs",
        action="append",
        default=[],
        metavar="PATH",
        help="with `-- CMD`: a file the command writes under {out} to compare (default: all)",
    )
    parser.add_argument(
        "--ops-step",
        type=int,
        default=0,
        help="with `-- CMD`: the step to record ops of when no trace names one (default 0)",
    )


def _any_command(parser: argparse.ArgumentParser, verb: str) -> None:
    """``-- CMD ARGS`` and the start-up pins of ``reprotrain run``."""
    parser.add_argument(
        "cmd",
        nargs=argparse.REMAINDER,
        help=f"the command to {verb}, after `--`; {{out}} in it becomes the run's own folder",
    )
    parser.add_argument(
        "--cpu-profile",
        choices=("portable", "native"),
        help="also pin the CPU kernels (docs/cpu-profile.md); default: leave them",
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="intra-op threads with --cpu-profile"
    )


def _run(parser: argparse.ArgumentParser) -> None:
    _any_command(parser, "run")


def _opdiff(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("a", help="recording A: a file or a folder of ops-rank<R>.safetensors")
    parser.add_argument("b", help="recording B")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def _status(parser: argparse.ArgumentParser) -> None:
    _dvc_yaml(parser)
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def _compare(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("a", help="run A: a folder, a safetensors file or a git revision")
    parser.add_argument("b", help="run B: a folder, a safetensors file or a git revision")
    parser.add_argument("--model", help="the weights file inside each folder (any script's)")
    parser.add_argument("--trace", help="the trace file inside each folder (any script's)")
    parser.add_argument("--json", action="store_true", help="print the comparison as JSON")
    parser.add_argument("--plot", type=Path, help="write a PNG of both losses and their difference")
    parser.add_argument(
        "--repo", type=Path, default=Path(), help="repository that revisions refer to"
    )


def _locate(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", type=Path, help="prepared dataset (default: the train stage's)")
    _dvc_yaml(parser)
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def _noise_floor(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runs", type=int, default=3, help="same-seed runs per mode (>= 2)")
    _dvc_yaml(parser)
    parser.add_argument("--workdir", type=Path, help="keep the run folders here")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--out", type=Path, help="also write the JSON report to this file")
    add_override_option(parser, "params override for every run, e.g. -S train.max_epochs=1")


def _bench(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", choices=("pipeline", "conv", "both"), default="both")
    parser.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda if available")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    parser.add_argument("--repeats", type=int, default=5, help="runs per mode (paired)")
    parser.add_argument("--batch-size", type=int, default=32, help="conv: images per batch")
    parser.add_argument("--image-size", type=int, default=32, help="conv: image height = width")
    parser.add_argument("--channels", type=int, default=3, help="conv: input channels")
    parser.add_argument("--width", type=int, default=32, help="conv: first layer's channels")
    parser.add_argument("--data", type=Path, help="prepared data (default: from dvc.yaml)")
    _dvc_yaml(parser)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--out", type=Path, help="also write the JSON report here")


def _ops(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), help="device to probe (default: cuda if available)"
    )
    parser.add_argument("--repeats", type=int, default=5, help="calls per mode and op (>= 2)")
    parser.add_argument(
        "--only", action="append", default=[], metavar="NAME", help="probe only these ops"
    )
    parser.add_argument("--out-md", type=Path, help="write the markdown table here")
    parser.add_argument("--out-json", type=Path, help="write the results as JSON here")


@dataclass(frozen=True)
class Command:
    """One sub-command: the module whose ``run(params, args)`` it calls, and its options."""

    module: str
    summary: str
    add_arguments: AddArguments
    #: Reads params.yaml (the module's ``PARAMS`` is not empty): gets --params/--seed/-S.
    takes_params: bool = False


def _stage(name: str) -> str:
    return f"reprotrain.pipeline.stages.{name}"


def _command(name: str) -> str:
    return f"reprotrain.commands.{name}"


#: Sub-command -> what it runs. The stages are exactly dvc.yaml's; the rest are commands.
COMMANDS = {
    "env": Command(_stage("env"), "record the environment that decides the bits", _env),
    "prepare": Command(_stage("prepare"), "materialise and split the dataset", _prepare, True),
    "train": Command(_stage("train"), "train the model deterministically", _train, True),
    "evaluate": Command(_stage("evaluate"), "score the test split", _evaluate),
    "run-id": Command(
        _command("run_id"),
        "print the run ID the train stage would have now",
        _run_id,
        True,
    ),
    "checklist": Command(
        _command("checklist"), "reproducibility checklist: pass / warn / fail per item", _checklist
    ),
    "verify": Command(
        _command("verify"),
        "rerun training in fresh processes and check the bits are identical",
        _verify,
    ),
    "status": Command(
        _command("status"),
        "would `dvc repro` change anything that decides the bits? exit 0 when not",
        _status,
    ),
    "compare": Command(
        _command("compare"),
        "compare two runs (folders or git revisions): where and why they differ",
        _compare,
    ),
    "locate": Command(
        _command("locate"),
        "name the module whose output or gradient differs between two equal steps",
        _locate,
        True,
    ),
    "opdiff": Command(
        _command("opdiff"),
        "name the first op two op recordings (any processes or machines) disagree on",
        _opdiff,
    ),
    "run": Command(
        _command("run"),
        "run any command with the hash seed, cuBLAS and CPU pins fixed from its start",
        _run,
    ),
    "noise-floor": Command(
        _command("noise_floor"),
        "how far same-seed runs drift with determinism off and on",
        _noise_floor,
    ),
    "bench": Command(
        _command("bench"),
        "step-time cost of determinism and of cuDNN autotuning, paired and interleaved",
        _bench,
        True,
    ),
    "ops": Command(
        _command("ops"),
        "catalog of ops with non-deterministic default paths, measured on this device",
        _ops,
    ),
}


class _StageParser(argparse.ArgumentParser):
    """Parses a ``dvc.yaml`` stage command; a bad one is a :class:`DataError`, not an exit."""

    def __init__(self, stage: str, dvc_yaml: Path) -> None:
        super().__init__(prog=f"reprotrain {stage}", add_help=False)
        self.where = f"{dvc_yaml}: stage {stage!r}"

    def error(self, message: str) -> NoReturn:
        raise DataError(f"{self.where}: {message}; fix its cmd")


def stage_command(stage: str, dvc_yaml: Path) -> list[str]:
    """The stage's command line from ``dvc_yaml``, split like a shell would."""
    try:
        cmd = yaml.safe_load(dvc_yaml.read_text())["stages"][stage]["cmd"]
    except FileNotFoundError:
        raise DataError(f"{dvc_yaml}: not found; run from the repository root") from None
    except (KeyError, TypeError):
        raise DataError(f"{dvc_yaml}: no stage {stage!r} with a cmd") from None
    argv = shlex.split(cmd)
    if argv[:2] != ["reprotrain", stage]:
        raise DataError(f"{dvc_yaml}: stage {stage!r} does not run `reprotrain {stage}`")
    return argv


def stage_arguments(stage: str, dvc_yaml: Path) -> argparse.Namespace:
    """The options of ``reprotrain <stage> ...`` as written in ``dvc_yaml``, parsed."""
    parser = _StageParser(stage, dvc_yaml)
    COMMANDS[stage].add_arguments(parser)
    return parser.parse_args(stage_command(stage, dvc_yaml)[2:])
