"""``reprotrain reference-note``: after ``make repro``, one line when the committed reference
was made on a machine whose deciding record moves the bits away from this one's.

A fresh clone's ``make repro`` on another kind of machine (a GPU model, a CPU
under ``cpu.profile: native``; under ``portable`` no CPU fact decides) rewrites
``dvc.lock`` and ``reports/`` with the bits of this machine, and ``git status``
shows a dozen changed files with no word of why. This compares each pipeline's
environment record in the workspace with the one committed at ``HEAD``
(:func:`~reprotrain.provenance.envdiff.compare_environments`) and, where fields
that decide the bits differ, prints one line naming them, that the reference
was made elsewhere, and ``make check-reference`` for the verdict. Nothing is
printed when the records agree in those fields (exit 0 either way: a note, not
a check). No torch import.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from reprotrain.commands._git import git_show
from reprotrain.commands._reference import tracked_pipelines
from reprotrain.pipeline.command import Command
from reprotrain.pipeline.errors import DataError
from reprotrain.provenance.envdiff import compare_environments

PARAMS: tuple[str, ...] = ()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "records",
        nargs="*",
        type=Path,
        default=None,
        metavar="RECORD",
        help="environment records to compare with HEAD's (default: every pipeline's git holds)",
    )


COMMAND = Command(
    "after make repro: say when the committed reference was made elsewhere", add_arguments
)


def run(_: object, args: argparse.Namespace) -> str | int:
    records = args.records or environment_records(Path.cwd())
    lines = [line for record in records if (line := reference_note(Path.cwd(), record))]
    if lines:
        print("\n".join(lines))
    return 0


def environment_records(repo: Path) -> list[Path]:
    """The env stage's record of every pipeline git holds in ``repo`` (none outside git)."""
    try:
        pipelines = tracked_pipelines(repo)
    except DataError:  # not a git repository: nothing committed to compare with
        return []
    return [Path(record) for p in pipelines.values() for record in sorted(p.environments)]


def reference_note(repo: Path, record: Path) -> str | None:
    """One line if ``record`` differs from HEAD's in fields that move the bits; else None."""
    committed = git_show(repo, "HEAD", record.as_posix())
    if committed is None or not (repo / record).is_file():
        return None
    try:
        old, new = json.loads(committed), json.loads((repo / record).read_text())
    except (json.JSONDecodeError, OSError):
        return None
    moving = [d for d in compare_environments(old, new) if d.voids]
    if not moving:
        return None
    fields = ", ".join(f"{d.key} {d.a} -> {d.b}" for d in moving)
    return (
        f"reprotrain: note: {record}: the committed reference was made under another deciding "
        f"record ({fields}, which moves the bits: another kind of machine, or a change to the "
        "kernels or the lock not committed yet), so this run's dvc.lock and reports/ differ "
        "from it; `make check-reference` gives the verdict (docs/cpu-profile.md)"
    )
