"""Record every aten op of chosen optimizer steps, to name the first op two runs disagree on.

For each step in a window (``steps``, optimizer steps counted from 0 like the
trace's ``step``), every aten op that runs in forward, backward and the
optimizer step is recorded: its name, the module that ran it, the user's
source line, and an integer fingerprint of every output and of every input
that no recorded op produced (:mod:`reprotrain.ops.recording`). Both runs of a
comparison fingerprint a tensor on the same kind of device, so CRC-32 (CPU)
and :mod:`reprotrain.fingerprint` (elsewhere) never meet; the file names them
(``hash``). An input that a recorded op produced keeps that op's index, so
:mod:`reprotrain.ops.align` can tell "same inputs, different output" (the
kernel) from "the inputs already differed" (and where they came from: a
parameter, the batch, optimizer state, the RNG state of a random op, a Python
value, or a tensor made outside torch ops). Backward ops carry the module and
line of the forward op that made their autograd node
(:mod:`reprotrain.ops.location`); the step trace's own fingerprint ops are
left out. One file per rank, in the format of :mod:`reprotrain.ops.opfile`,
written when the window's last step ends.

Use it with one line: ``OpRecorder()`` as a Lightning callback, or ``with
record_step(model, step, optimizer):`` around each step of a plain loop. The
callback lives in :mod:`reprotrain.ops.fit_recorder` and is imported from here on
first use, so a plain loop that records its steps imports no Lightning. With
no window given, both read ``REPROTRAIN_RECORD_OPS`` ("3" or "3-5") and
``REPROTRAIN_OPS_DIR`` (default ``ops``), which ``reprotrain verify -- CMD``
sets; when neither asks for a step they install nothing and cost nothing.
A step that raises (a fit that fails) leaves no dispatch mode or hook
installed (:mod:`reprotrain.ops.capture`) and writes no recording.

Limits: ops of other threads than the one that runs the step (DataLoader
workers) are not seen; their effect shows as a differing batch. A recorded
step is slower, every op being fingerprinted and located: see
``benchmarks/overhead/op_record_overhead.py`` and docs/any-script.md for the cost.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from reprotrain.ops.capture import label_all, label_batch, recording_step
from reprotrain.ops.opfile import (
    DIR_VARIABLE,
    WINDOW_VARIABLE,
    parse_window,
    recording_dir,
    recording_path,
    window_from_env,
)
from reprotrain.ops.recording import Recording

if TYPE_CHECKING:  # at run time, __getattr__ below imports it (and Lightning) on first use
    from reprotrain.ops.fit_recorder import OpRecorder

__all__ = ["DIR_VARIABLE", "WINDOW_VARIABLE", "OpRecorder", "parse_window", "record_step"]


def __getattr__(name: str) -> Any:
    """``OpRecorder`` (the documented ``reprotrain.ops.recorder.OpRecorder``), imported with
    Lightning only when asked for."""
    if name == "OpRecorder":
        from reprotrain.ops.fit_recorder import OpRecorder

        return OpRecorder
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: A plain loop's recording between the steps of its window ("recording" -> it).
_unfinished: dict[str, Recording] = {}


@contextlib.contextmanager
def record_step(
    model: torch.nn.Module,
    step: int,
    optimizer: Any = None,
    steps: tuple[int, int] | None = None,
    out: str | Path | None = None,
    batch: Any = None,
) -> Iterator[None]:
    """Around one step of a plain PyTorch loop: records it when ``step`` is in the window.

    The window and folder default to ``REPROTRAIN_RECORD_OPS`` / ``REPROTRAIN_OPS_DIR``;
    outside the window this is a null context. The file is written after the last step;
    a step that raises ends the window unwritten, with nothing left installed.
    """
    window = window_from_env(steps)
    if window is None or not window[0] <= step <= window[1]:
        yield
        return
    recording = _unfinished.get("recording")
    if recording is None or recording.step >= step:
        recording = _unfinished["recording"] = Recording(model)
    label_all(recording, model, [optimizer] if optimizer is not None else [])
    if batch is not None:
        label_batch(recording, batch)
    try:
        with recording_step(recording, step):
            yield
    except BaseException:
        _unfinished.clear()  # a failed window is neither continued nor written
        raise
    if step == window[1]:
        _unfinished.clear()
        recording.write(recording_path(recording_dir(out), 0))
