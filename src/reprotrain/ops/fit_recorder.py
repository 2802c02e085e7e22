"""The op recorder as a Lightning callback: ``OpRecorder()`` in a Trainer's callbacks.

What it records, and the plain-loop form, are in :mod:`reprotrain.ops.recorder`,
which also exports this class by name (``reprotrain.ops.recorder.OpRecorder``,
what a LightningCLI or Hydra config names) and imports this module, and so
Lightning, only when that name is first read.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback

from reprotrain.ops.capture import label_all, label_batch, recording_step
from reprotrain.ops.opfile import recording_dir, recording_path, window_from_env
from reprotrain.ops.recording import Recording


class OpRecorder(Callback):
    """Lightning callback: records the ops of the window's optimizer steps, per rank.

    A recorded step is entered in ``on_train_batch_start`` and left in
    ``on_train_batch_end``; a fit that raises leaves it through ``on_exception``
    (and ``teardown`` covers any other way out), unwritten.
    """

    def __init__(self, steps: tuple[int, int] | None = None, out: str | Path | None = None):
        self.window = window_from_env(steps)
        self.out = recording_dir(out)
        self.recording: Recording | None = None
        self._step: contextlib.ExitStack | None = None  # the recorded step, while it runs

    def _active(self, trainer: Any) -> bool:
        return self.window is not None and self.window[0] <= trainer.global_step <= self.window[1]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._leave_step()  # none should be open; if one is, it goes first
        if not self._active(trainer):
            return
        if self.recording is None:
            self.recording = Recording(pl_module, trainer.global_rank, trainer.world_size)
        label_all(self.recording, pl_module, trainer.optimizers)
        label_batch(self.recording, batch)
        step = contextlib.ExitStack()
        step.enter_context(recording_step(self.recording, trainer.global_step))
        self._step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._step is None:
            return
        self._leave_step()
        if trainer.global_step > self.window[1]:  # the window's last optimizer step is done
            self._write()

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self._leave_step()  # left open by a batch the module skipped (on_train_batch_start: -1)

    def on_train_end(self, trainer, pl_module) -> None:
        self._leave_step()
        self._write()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._leave_step(exception)
        self.recording = None  # a fit that failed writes no recording

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if self._step is not None:  # left by a way out that no other hook saw
            self._leave_step()
            self.recording = None

    def _leave_step(self, error: BaseException | None = None) -> None:
        step, self._step = self._step, None
        if step is None:
            return
        if error is None:
            step.close()
        else:
            step.__exit__(type(error), error, error.__traceback__)

    def _write(self) -> None:
        if self.recording is not None and self.recording.ops:
            self.recording.write(recording_path(self.out, self.recording.rank))
        self.recording = None
