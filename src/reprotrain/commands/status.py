"""``reprotrain status``: would ``dvc repro`` change anything that decides the bits?

``dvc status`` is never clean here: the ``env`` stage is ``always_changed``
(it must run first on every repro to check params and data before DVC
deletes anything). This answers the question a CI gate asks instead: the
environment record this host would write (the part that decides the bits:
:func:`reprotrain.provenance.environment.bit_deciding`) against the one in the
workspace, each difference classified; then every other stage's changed
params, data, code or outputs from ``dvc status``. Exit 0 when nothing would
change, 1 otherwise (what would, one line each).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import Any

from reprotrain.commands._exit_codes import EXIT_CHECK_FAILED
from reprotrain.hashing import canonical_json
from reprotrain.pipeline.command import Command, add_dvc_yaml, stage_arguments
from reprotrain.pipeline.errors import DataError
from reprotrain.pipeline.run_record import load_environment
from reprotrain.pipeline.stages.env import record_environment, stage_params
from reprotrain.provenance.envdiff import compare_environments

PARAMS: tuple[str, ...] = ()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_dvc_yaml(parser)
    parser.add_argument("--json", action="store_true", help="machine-readable output")


#: Restarts so that the record it takes is the one the env stage would write.
COMMAND = Command(
    "would `dvc repro` change anything that decides the bits? exit 0 when not",
    add_arguments,
    restarts=True,
)


def run(_: object, args: argparse.Namespace) -> int:
    env_args = stage_arguments("env", args.dvc_yaml)
    here = record_environment(env_args.lock, stage_params(env_args.params)[0])
    changes = [f"env: {d.to_text()}" for d in _environment_changes(env_args.out, here)]
    changes += [f"{stage}: {what}" for stage, what in _dvc_changes()]
    if args.json:
        print(canonical_json({"up_to_date": not changes, "changes": changes}), end="")
    elif changes:
        print("\n".join(changes))
        print(f"reprotrain status: dvc repro would change {len(changes)} thing(s) above")
    else:
        print("reprotrain status: up to date; dvc repro would change nothing that decides the bits")
    return EXIT_CHECK_FAILED if changes else 0


def _environment_changes(recorded_path: Any, here: dict[str, Any]) -> list[Any]:
    if recorded_path is None or not recorded_path.is_file():
        raise DataError(f"{recorded_path}: no environment record yet; run `dvc repro` once")
    return compare_environments(load_environment(recorded_path), here)


def _dvc_changes() -> list[tuple[str, str]]:
    """``(stage, what changed)`` from ``dvc status --json``, the always-changed env stage aside."""
    try:
        done = subprocess.run(
            [sys.executable, "-m", "dvc", "status", "--json"],
            capture_output=True,
            text=True,
            check=True,
            timeout=300,
        )
        report = json.loads(done.stdout or "{}")
    except (OSError, subprocess.CalledProcessError, ValueError) as err:
        detail = getattr(err, "stderr", "") or err
        raise DataError(
            f"`dvc status` failed ({str(detail).strip()}); run it for details"
        ) from None
    out = []
    for stage, entries in sorted(report.items()):
        # another pipeline's stage keeps DVC's name for it: pipelines/lm/dvc.yaml:train
        if stage.split(":")[-1] == "env":
            continue
        for entry in entries:
            if isinstance(entry, str):
                out.append((stage, entry))
                continue
            for kind, paths in entry.items():
                listed = ", ".join(f"{p} ({state})" for p, state in sorted(paths.items()))
                out.append((stage, f"{kind}: {listed}"))
    return out
