"""Read a stage's arguments back from its ``dvc.yaml`` command line.

``fingerprint`` and ``checklist`` must look at the same files the pipeline
uses; parsing the stage's ``cmd`` with the stage's own argument parser keeps
``dvc.yaml`` the single place where paths are written down.
"""

from __future__ import annotations

import argparse
import importlib
import shlex
from pathlib import Path

import yaml

from reprotrain.pipeline.errors import DataError


def stage_arguments(stage: str, dvc_yaml: Path) -> argparse.Namespace:
    """The parsed arguments of ``reprotrain <stage> ...`` as written in ``dvc_yaml``."""
    try:
        cmd = yaml.safe_load(dvc_yaml.read_text())["stages"][stage]["cmd"]
    except FileNotFoundError:
        raise DataError(f"{dvc_yaml}: not found; run from the repository root") from None
    except (KeyError, TypeError):
        raise DataError(f"{dvc_yaml}: no stage {stage!r} with a cmd") from None
    argv = shlex.split(cmd)
    if argv[:2] != ["reprotrain", stage]:
        raise DataError(f"{dvc_yaml}: stage {stage!r} does not run `reprotrain {stage}`")
    module = importlib.import_module(f"reprotrain.pipeline.{stage}")
    parser = argparse.ArgumentParser(prog=f"{dvc_yaml}:{stage}", exit_on_error=False)
    module.add_arguments(parser)
    known, _ = parser.parse_known_args(argv[2:])
    return known
