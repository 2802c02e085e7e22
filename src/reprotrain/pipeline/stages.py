"""Read a stage's arguments back from its ``dvc.yaml`` command line.

``fingerprint``, ``checklist``, ``verify`` and ``compare`` must look at the
same files the pipeline uses; reading them from the stage's ``cmd`` keeps
``dvc.yaml`` the single place where paths are written down. The command is
read without importing the stage's module (``train`` imports Lightning, which
takes seconds): every stage option is ``--name PATH`` (tests/test_structure.py
parses each stage's command with the stage's own parser to keep that true).
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

import yaml

from reprotrain.pipeline.errors import DataError


class StageArguments(argparse.Namespace):
    """A stage's ``--name value`` options as paths; an option the command omits is None."""

    def __getattr__(self, name: str) -> None:
        if name.startswith("__"):
            raise AttributeError(name)
        return None


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


def stage_arguments(stage: str, dvc_yaml: Path) -> StageArguments:
    """The options of ``reprotrain <stage> ...`` as written in ``dvc_yaml``."""
    args = StageArguments()
    tokens = stage_command(stage, dvc_yaml)[2:]
    for option, value in zip(tokens[::2], tokens[1::2], strict=False):
        if not option.startswith("--") or value.startswith("--"):
            raise DataError(
                f"{dvc_yaml}: stage {stage!r}: expected `--option PATH` pairs, got {option!r}"
            )
        setattr(args, option[2:].replace("-", "_"), Path(value))
    if len(tokens) % 2:
        raise DataError(f"{dvc_yaml}: stage {stage!r}: option {tokens[-1]!r} has no value")
    return args
