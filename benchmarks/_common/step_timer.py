"""The benchmarks' one step timer: seconds per optimizer step of a Lightning fit, within an epoch.

A step is timed from one optimizer step's edge to the next one's in the same epoch,
so data loading, the forward and backward passes of all of a step's micro-batches
and every per-step hook of the other callbacks are in, while validation, an epoch's
DataLoader start and the fit's start are not. ``edge`` picks the hook:

* ``"end"`` (the default): the ``on_train_batch_end`` at which the step's optimizer
  ran (a micro-batch that did not end a step is skipped);
* ``"start"``: the ``on_train_batch_start`` of the step's first micro-batch. Placed
  before another callback, the timer holds that callback's batch-start hook of the
  same step: ``overhead/trace_overhead.py`` times the trace's hooks this way.

``from_epoch``: earlier epochs are warm-up, not timed. ``stop_after``: the fit stops
once that many steps are timed (warm-up steps the caller drops included).
"""

from __future__ import annotations

import time
from typing import Any, Literal

import lightning as L


class StepTimer(L.Callback):
    """``seconds``: one entry per timed optimizer step, in order."""

    def __init__(
        self,
        edge: Literal["end", "start"] = "end",
        from_epoch: int = 0,
        stop_after: int | None = None,
    ) -> None:
        if edge not in ("end", "start"):
            raise ValueError(f"StepTimer edge {edge!r}: give 'end' or 'start'")
        self.edge, self.from_epoch, self.stop_after = edge, from_epoch, stop_after
        self.seconds: list[float] = []
        self._last: float | None = None
        self._step: int | None = None

    def on_train_epoch_start(self, trainer: L.Trainer, *_: Any) -> None:
        # At a batch end a step has ended once global_step moved past the epoch's start;
        # at a batch start the epoch's first batch always begins a step.
        self._last = None
        self._step = trainer.global_step if self.edge == "end" else None

    def on_train_batch_start(self, trainer: L.Trainer, *_: Any) -> None:
        if self.edge == "start":
            self._mark(trainer)

    def on_train_batch_end(self, trainer: L.Trainer, *_: Any) -> None:
        if self.edge == "end":
            self._mark(trainer)

    def _mark(self, trainer: L.Trainer) -> None:
        if trainer.global_step == self._step:  # a micro-batch within the same step
            return
        now, self._step = time.perf_counter(), trainer.global_step
        if self._last is not None and trainer.current_epoch >= self.from_epoch:
            self.seconds.append(now - self._last)
        self._last = now
        if self.stop_after is not None and len(self.seconds) >= self.stop_after:
            trainer.should_stop = True
