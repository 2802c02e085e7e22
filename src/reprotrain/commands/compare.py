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

Exit codes: 0 identical, 1 different, 2 a run could not be read.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from reprotrain.commands._exit_codes import EXIT_CHECK_FAILED
from reprotrain.commands._rundiff import OPS_FOLDER, compare_runs, find_run, with_op_diff
from reprotrain.hashing import canonical_json
from reprotrain.pipeline.command import Command

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
    with tempfile.TemporaryDirectory(prefix="reprotrain-compare-") as scratch:
        a = find_run(args.a, args.repo, Path(scratch) / "a", args.model, args.trace)
        b = find_run(args.b, args.repo, Path(scratch) / "b", args.model, args.trace)
        result = compare_runs(a, b, plot=args.plot)
    recordings = [_recording_of(Path(spec)) for spec in (args.a, args.b)]
    if not result.identical and all(folder is not None for folder in recordings):
        result = with_op_diff(result, *recordings)
    if args.json:
        print(canonical_json(result.to_dict()), end="")
    else:
        print(result.to_text())
        if args.plot:
            print(f"loss plot: {args.plot}")
    return 0 if result.identical else EXIT_CHECK_FAILED


def _recording_of(run: Path) -> Path | None:
    """A run's op recording: ``RUN/ops``, or ``RUN-ops/ops`` beside it (where verify keeps it)."""
    run = run.resolve()  # `compare . OTHER`: "." has no name to put "-ops" after
    for folder in (run / OPS_FOLDER, run.with_name(f"{run.name}-ops") / OPS_FOLDER):
        if folder.is_dir():
            return folder
    return None
