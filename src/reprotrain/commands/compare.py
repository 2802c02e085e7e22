"""``reprotrain compare A B``: are two training runs the same bits, and if not, why.

A and B are folders (a repository after ``dvc repro``, or a run folder that
``reprotrain verify`` kept), git revisions of the current repository, or any
script's outputs: folders with ``--model``/``--trace`` naming the files in
them, or two safetensors files (weights, or traces). When both folders hold
op recordings (``ops/``, from :mod:`reprotrain.ops.recorder`), the first op they
disagree on is added (:mod:`reprotrain.ops.align`). The
answer is "identical", or the first diverging step and record with its
diagnosis (batch: data pipeline; RNG: random consumption; gradients with the
same batch and parameters: a non-deterministic kernel, then run ``reprotrain
locate``; parameters with equal gradients: the optimizer), the run inputs and
environment fields that differ, and a per-tensor table of the final weights.

Exit codes: 0 identical, 1 different, 2 a run could not be read. Bad input is
refused in one line (exit 2) before anything is compared: ``--model``/``--trace``
must stay inside each folder (an absolute path would read one file for both
runs), ``--plot`` must name a file, a file to read must be a readable safetensors
file. "Identical" names what was compared, and a revision whose weights are not
in the DVC cache says so on the verdict line, with the reason DVC gave (in
``--json``: ``weights_equal`` is ``null`` and the reason is in ``notes``): the
same trace is not the same model.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from reprotrain.commands._exit_codes import EXIT_CHECK_FAILED
from reprotrain.commands._findrun import OPS_FOLDER, find_run
from reprotrain.commands._rundiff import compare_runs, with_op_diff
from reprotrain.commands._runfolders import leads_outside
from reprotrain.hashing import UnreadableSafetensors, canonical_json, read_safetensors_metadata
from reprotrain.pipeline.command import Command
from reprotrain.pipeline.errors import DataError

PARAMS: tuple[str, ...] = ()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("a", help="run A: a folder, a safetensors file or a git revision")
    parser.add_argument("b", help="run B: a folder, a safetensors file or a git revision")
    parser.add_argument("--model", help="the weights file inside each folder (any script's)")
    parser.add_argument("--trace", help="the trace file inside each folder (any script's)")
    parser.add_argument("--json", action="store_true", help="print the comparison as JSON")
    parser.add_argument("--plot", type=Path, help="write a PNG of both losses and their difference")
    parser.add_argument(
        "--repo", type=Path, default=Path(), help="repository that revisions refer to"
    )


COMMAND = Command(
    "compare two runs (folders or git revisions): where and why they differ", add_arguments
)


def run(_: object, args: argparse.Namespace) -> int:
    _refuse_unusable_paths(args)
    try:
        with tempfile.TemporaryDirectory(prefix="reprotrain-compare-") as scratch:
            a = find_run(args.a, args.repo, Path(scratch) / "a", args.model, args.trace)
            b = find_run(args.b, args.repo, Path(scratch) / "b", args.model, args.trace)
            result = compare_runs(a, b, plot=args.plot)
    except UnreadableSafetensors as err:  # weights, loaded only when the bytes differ
        raise _unreadable(err) from None
    recordings = [_recording_of(Path(spec)) for spec in (args.a, args.b)]
    if not result.identical and all(folder is not None for folder in recordings):
        result = with_op_diff(result, *recordings)
    if args.json:
        print(canonical_json(result.to_dict()), end="")
    else:
        print(result.to_text())
        if args.plot:
            plotted = all(run.trace is not None for run in (a, b))
            print(f"loss plot: {args.plot}" if plotted else "no loss plot: a run has no trace")
    return 0 if result.identical else EXIT_CHECK_FAILED


def _refuse_unusable_paths(args: argparse.Namespace) -> None:
    """Refuse, before any work, a path that would crash late or compare the wrong files."""
    if args.plot is not None and args.plot.is_dir():
        raise DataError(
            f"--plot {args.plot}: is a folder; pass the PNG file to write, "
            f"e.g. {args.plot / 'loss.png'}"
        )
    folders = [Path(spec) for spec in (args.a, args.b) if Path(spec).is_dir()]
    for option, rel in (("--model", args.model), ("--trace", args.trace)):
        if rel is not None:
            for folder in folders:
                _refuse_outside(option, rel, folder)
    for spec in (args.a, args.b):
        named = [Path(spec) / rel for rel in (args.model, args.trace) if rel]
        for path in [Path(spec)] if Path(spec).is_file() else named:
            if path.is_file():
                try:
                    read_safetensors_metadata(path)
                except UnreadableSafetensors as err:
                    raise _unreadable(err) from None


def _refuse_outside(option: str, rel: str, folder: Path) -> None:
    """``rel`` names a file inside ``folder``: relative, and not leaving it, by ``..`` or link.

    A path that leaves the folders compared reads the same file for both runs, so
    the answer would be "identical" whatever the runs wrote.
    """
    if Path(rel).is_absolute():
        raise DataError(
            f"{option} {rel}: an absolute path names one file for both runs; pass the path "
            f"relative to each compared folder, e.g. {option} {Path(rel).name}"
        )
    if (resolved := leads_outside(folder / rel, folder)) is not None:
        raise DataError(
            f"{option} {rel}: {folder / rel} leads outside {folder} (to {resolved}); pass "
            f"a path that stays inside each compared folder, e.g. {option} {Path(rel).name}"
        )


def _unreadable(err: UnreadableSafetensors) -> DataError:
    return DataError(
        f"{err.path}: not a readable weights/trace file ({err}); copy it again, or rerun "
        "the run that wrote it"
    )


def _recording_of(run: Path) -> Path | None:
    """A run's op recording: ``RUN/ops``, or ``RUN-ops/ops`` beside it (where verify keeps it)."""
    run = run.resolve()  # `compare . OTHER`: "." has no name to put "-ops" after
    for folder in (run / OPS_FOLDER, run.with_name(f"{run.name}-ops") / OPS_FOLDER):
        if folder.is_dir():
            return folder
    return None
