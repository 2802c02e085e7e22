"""``reprotrain opdiff A B``: the first op two op recordings disagree on, and why.

A and B are files or folders written by :class:`reprotrain.ops.recorder.OpRecorder`
or :func:`reprotrain.ops.recorder.record_step` (one ``ops-rank<R>.safetensors``
per rank), from any two processes or machines. Prints the first op whose
inputs or outputs differ (aten op, phase, step, rank, module, source line)
and whether the op itself (same inputs, different output) or something
upstream of it is to blame (:mod:`reprotrain.ops.align`).

Exit codes: 0 identical, 1 different, 2 a recording could not be read or the
two cannot be compared (other model, steps or world size).
"""

from __future__ import annotations

import argparse

from reprotrain.commands._exit_codes import EXIT_CHECK_FAILED
from reprotrain.pipeline.command import Command
from reprotrain.pipeline.errors import DataError

PARAMS: tuple[str, ...] = ()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("a", help="recording A: a file or a folder of ops-rank<R>.safetensors")
    parser.add_argument("b", help="recording B")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


COMMAND = Command(
    "name the first op two op recordings (any processes or machines) disagree on", add_arguments
)


def run(_: object, args: argparse.Namespace) -> int:
    from reprotrain.ops.align import OpRecordError, compare_recordings  # torch

    try:
        result = compare_recordings(args.a, args.b)
    except OpRecordError as err:
        raise DataError(str(err)) from None
    if args.json:
        print(result.to_json(), end="")
    else:
        print(f"reprotrain opdiff: {result.to_text()}")
    return 0 if result.identical else EXIT_CHECK_FAILED
