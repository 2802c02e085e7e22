"""What a ``reprotrain`` verb declares, and a stage's command line read back from ``dvc.yaml``.

Every verb module (a stage in :mod:`reprotrain.pipeline.stages` or a command
in :mod:`reprotrain.commands`) defines ``add_arguments(parser)`` and
``COMMAND = Command(...)`` beside its ``PARAMS`` and ``run``; the CLI imports
each one to build its parser, so a verb module imports nothing heavier than
PyYAML at module level (torch and Lightning take seconds; tests/test_cli.py
checks every ``--help``). :func:`stage_arguments` parses a stage's command line
as ``dvc.yaml`` writes it with that stage's own ``add_arguments``: ``run-id``,
``checklist``, ``verify`` and ``compare`` look at the files the pipeline uses,
and ``dvc.yaml`` stays the one place where paths are written down.
"""

from __future__ import annotations

import argparse
import importlib
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import yaml

from reprotrain.pipeline.errors import DataError, yaml_line

#: Names the lock the env stage checks when ``--lock`` is not given; the Dockerfile sets it.
LOCK_VARIABLE = "REPROTRAIN_LOCK"
DEFAULT_LOCK = Path("requirements-cpu.lock")
DVC_YAML = Path("dvc.yaml")
#: The dvc.yaml stages in pipeline order, one module each in reprotrain.pipeline.stages.
STAGES = ("env", "prepare", "train", "evaluate")

AddArguments = Callable[[argparse.ArgumentParser], None]


@dataclass(frozen=True)
class Command:
    """One verb: its one-line summary and options, as the CLI shows and parses them."""

    summary: str
    #: Declares the verb's own options on its sub-parser.
    add_arguments: AddArguments
    #: Reads params.yaml (the module's ``PARAMS`` is not empty): gets --params/--seed/-S.
    takes_params: bool = False
    #: Trains or configures determinism: the CLI restarts the interpreter first, with
    #: PYTHONHASHSEED and the CPU profile's variables fixed, before torch is imported.
    restarts: bool = False


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


def add_param_options(parser: argparse.ArgumentParser) -> None:
    """``--params``, ``--seed``, ``--deterministic`` and ``-S``: a verb that reads params.yaml."""
    parser.add_argument("--params", type=Path, default=Path("params.yaml"), help="params file")
    parser.add_argument("--seed", type=int, help="override `seed`")
    parser.add_argument(
        "--deterministic", choices=("true", "false", "warn"), help="override `deterministic`"
    )
    add_override_option(
        parser, "override any key, e.g. -S model.init_args.lr=0.01 (as in `dvc exp run -S`)"
    )


def add_paths(parser: argparse.ArgumentParser, spec: dict[str, str], required: bool) -> None:
    """One ``--NAME PATH`` option per entry of ``spec`` (name -> help)."""
    for name, help_text in spec.items():
        parser.add_argument(f"--{name}", type=Path, required=required, help=help_text)


def add_data_files(parser: argparse.ArgumentParser, use: str) -> None:
    """``--data PATH``, repeatable: the files the data module reads; ``use`` says what for."""
    parser.add_argument(
        "--data",
        type=Path,
        action="append",
        default=[],
        metavar="PATH",
        help=f"a file or folder the data module reads (repeat for more): {use}",
    )


def add_dvc_yaml(parser: argparse.ArgumentParser) -> None:
    """``--dvc-yaml``: the pipeline file whose stage command lines say where the files are."""
    parser.add_argument("--dvc-yaml", type=Path, default=DVC_YAML, help="pipeline file")


class _StageParser(argparse.ArgumentParser):
    """Parses a ``dvc.yaml`` stage command; a bad one is a :class:`DataError`, not an exit."""

    def __init__(self, stage: str, dvc_yaml: Path) -> None:
        super().__init__(prog=f"reprotrain {stage}", add_help=False)
        self.where = f"{dvc_yaml}: stage {stage!r}"

    def error(self, message: str) -> NoReturn:
        raise DataError(f"{self.where}: {message}; fix its cmd")


def stage_command(stage: str, dvc_yaml: Path) -> list[str]:
    """The stage's command line from ``dvc_yaml``, split like a shell would.

    ``cmd`` may be a list, as DVC allows (commands run in order): the stage's
    command is then the one entry that runs ``reprotrain <stage>``. Anything
    unreadable is one :class:`DataError` that names ``dvc_yaml`` and the stage.
    """
    spec = _read_pipeline(dvc_yaml)
    try:
        cmd = spec["stages"][stage]["cmd"]
    except (KeyError, TypeError):
        detail = f"no stage {stage!r} with a cmd"
        raise DataError(f"{dvc_yaml}: {detail}; add it, or pass the pipeline's file") from None
    where = f"{dvc_yaml}: stage {stage!r}"
    commands = cmd if isinstance(cmd, list) else [cmd]
    if not commands or not all(isinstance(line, str) for line in commands):
        raise DataError(f"{where}: cmd must be a command line or a list of them; fix its cmd")
    try:
        lines = [shlex.split(line) for line in commands]
    except ValueError as err:  # an unclosed quote, a trailing backslash
        detail = f"cmd cannot be split as a shell would ({err})"
        raise DataError(f"{where}: {detail}; fix its quoting") from None
    ours = [argv for argv in lines if argv[:2] == ["reprotrain", stage]]
    if not ours:
        raise DataError(f"{where}: cmd does not run `reprotrain {stage}`; fix its cmd")
    if len(ours) > 1:
        raise DataError(f"{where}: cmd runs `reprotrain {stage}` {len(ours)} times; keep one")
    return ours[0]


def pipeline_stages(dvc_yaml: Path) -> dict[str, dict]:
    """``dvc_yaml``'s stages by name, each a mapping; none for a file that cannot be read
    (DVC refuses it before any stage runs) or a stage that is not a mapping."""
    try:
        spec = _read_pipeline(dvc_yaml)
    except DataError:
        return {}
    stages = spec.get("stages") if isinstance(spec, dict) else None
    if not isinstance(stages, dict):
        return {}
    return {str(name): stage for name, stage in stages.items() if isinstance(stage, dict)}


def pipeline_runs(verb: str, dvc_yaml: Path) -> bool:
    """Whether a stage of ``dvc_yaml``, under any name, runs ``reprotrain <verb>``."""
    for stage in pipeline_stages(dvc_yaml).values():
        cmd = stage.get("cmd")
        for line in cmd if isinstance(cmd, list) else [cmd]:
            try:
                if isinstance(line, str) and shlex.split(line)[:2] == ["reprotrain", verb]:
                    return True
            except ValueError:  # unclosed quotes: not a command DVC could run either
                continue
    return False


def stage_deps(stage: str, dvc_yaml: Path) -> list[Path] | None:
    """The paths ``stage`` of ``dvc_yaml`` lists under ``deps``, resolved against its
    ``wdir``; None where there is no such stage or a dep or the wdir is templated."""
    found = pipeline_stages(dvc_yaml).get(stage)
    if found is None:
        return None
    wdir = dvc_yaml.parent / str(found.get("wdir", "."))
    deps = [str(dep) for dep in found.get("deps") or []]
    if any("${" in part for part in (*deps, str(wdir))):
        return None
    return [(wdir / dep).resolve() for dep in deps]


def missing_params(dvc_yaml: Path) -> list[tuple[str, str, str]]:
    """``(stage, params file, key)`` for each key a stage of ``dvc_yaml`` lists under
    ``params`` and its YAML params file lacks: DVC would stop at that stage, after deleting
    its outputs. Files that cannot be read, other formats and templated keys are left to
    DVC."""
    missing = []
    for name, stage in pipeline_stages(dvc_yaml).items():
        wdir = dvc_yaml.parent / str(stage.get("wdir", "."))
        for entry in stage.get("params") or []:
            files = {"params.yaml": [entry]} if isinstance(entry, str) else entry
            for file, keys in (files if isinstance(files, dict) else {}).items():
                if not keys or not str(file).endswith((".yaml", ".yml")):
                    continue  # the whole file, or a format read by DVC alone
                try:
                    tree = yaml.safe_load((wdir / file).read_text(encoding="utf-8"))
                except (OSError, UnicodeDecodeError, yaml.YAMLError):
                    continue
                for key in keys:
                    if isinstance(key, str) and "${" not in key and not _has_key(tree, key):
                        missing.append((name, str(file), key))
    return missing


def _has_key(tree: object, dotted: str) -> bool:
    """Whether ``dotted`` (``train.max_epochs``) names a key of ``tree``; a null value is one."""
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return False
        tree = tree[part]
    return True


def _read_pipeline(dvc_yaml: Path) -> object:
    """``dvc_yaml`` parsed; a missing, unreadable or malformed file is a :class:`DataError`."""
    try:
        return yaml.safe_load(dvc_yaml.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DataError(f"{dvc_yaml}: not found; run from the repository root") from None
    except IsADirectoryError:
        raise DataError(
            f"{dvc_yaml}: is a folder; pass the pipeline file (--dvc-yaml FOLDER/dvc.yaml)"
        ) from None
    except UnicodeDecodeError:
        raise DataError(f"{dvc_yaml}: not UTF-8 text; restore it from git") from None
    except yaml.YAMLError as err:
        raise DataError(
            f"{dvc_yaml}: not valid YAML{yaml_line(err)}: fix the syntax or restore it from git"
        ) from None


def stage_arguments(stage: str, dvc_yaml: Path) -> argparse.Namespace:
    """The options of ``reprotrain <stage> ...`` as written in ``dvc_yaml``, parsed.

    The stage module is imported by name: it is light (see above), and an
    import statement here would put every stage in each stage's code hash.
    """
    parser = _StageParser(stage, dvc_yaml)
    module = importlib.import_module(f"reprotrain.pipeline.stages.{stage}")
    if module.COMMAND.takes_params:  # `--params pipelines/lm/params.yaml`, as the CLI takes it
        add_param_options(parser)
    module.add_arguments(parser)
    return parser.parse_args(stage_command(stage, dvc_yaml)[2:])
