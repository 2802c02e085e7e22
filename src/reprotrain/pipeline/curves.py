"""A Lightning logger that keeps metrics in memory for DVC plots and metrics.

Lightning's CSV and TensorBoard loggers write into ``version_N`` folders and
stamp wall-clock times; neither may reach a file whose hash DVC compares. This
one only collects ``(step, name, value)`` and lets the stage write them.
:class:`CurveCheckpoint` keeps the rows in checkpoints, so a resumed run's
curves are those of an uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import rank_zero_only

from reprotrain.distributed.worldsize import step_loss


class MemoryLogger(Logger):
    """Collects logged scalars; ``rows(name)`` returns ``[(step, value), ...]``."""

    def __init__(self) -> None:
        super().__init__()
        self._rows: list[tuple[int, str, float]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> str:
        return "0"

    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        """Hyperparameters are recorded by the stage itself, not here."""

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        for name, value in metrics.items():
            if name != "epoch":
                self._rows.append((int(step or 0), name, float(value)))

    def names(self) -> list[str]:
        """Every metric name logged, in the order first logged."""
        return list(dict.fromkeys(metric for _, metric, _ in self._rows))

    def rows(self, name: str) -> list[tuple[int, float]]:
        return [(step, value) for step, metric, value in self._rows if metric == name]


class CurveCheckpoint(L.Callback):
    """Saves a :class:`MemoryLogger`'s rows with each checkpoint and restores them on resume.

    Lightning logs a batch's step metrics after every ``on_train_batch_end``, so
    a checkpoint written there (at SIGTERM, ``InterruptCheckpoint``) would lack
    that batch's ``train_loss`` row: the row is kept at hand and added (under
    DDP the ranks' mean, one small all-reduce per batch).
    """

    def __init__(self, logger: MemoryLogger) -> None:
        self.logger = logger
        self._pending: tuple[int, str, float] | None = None

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
        batch_idx: int,
    ) -> None:  # fmt: skip
        if not (isinstance(outputs, Mapping) and "loss" in outputs):
            return
        loss = outputs["loss"].detach().clone()
        invariant_loss = step_loss(trainer)  # world-size invariant mode
        if invariant_loss is not None:
            loss = invariant_loss
        elif trainer.world_size > 1:  # the ranks' mean, as `self.log(..., sync_dist=True)` takes it
            torch.distributed.all_reduce(loss, op=torch.distributed.ReduceOp.SUM)
            loss = loss / trainer.world_size
        self._pending = (trainer.global_step - 1, "train_loss", float(loss))

    def state_dict(self) -> dict[str, Any]:
        rows = list(self.logger._rows)
        if self._pending is not None and self._pending[:2] not in {r[:2] for r in rows}:
            rows.append(self._pending)
        return {"rows": [list(row) for row in rows]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.logger._rows = [(int(s), str(n), float(v)) for s, n, v in state["rows"]]


class TrainLossLogger(L.Callback):
    """Logs ``train_loss``: the loss each training step returned, for any module.

    Under DDP the ranks' mean (each rank's own loss is in the trace); in
    world-size-invariant mode the step's loss over every micro-batch, added
    by the fixed tree (:func:`~reprotrain.distributed.worldsize.step_loss`),
    logged once the step's last backward ran. Modules return their loss and
    leave this name to the pipeline (docs/your-model.md).
    """

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
        batch_idx: int,
    ) -> None:  # fmt: skip
        if step_loss(trainer) is not None or not isinstance(outputs, Mapping):
            return
        loss = outputs["loss"].detach()
        pl_module.log("train_loss", loss, on_step=True, on_epoch=False, sync_dist=True)

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        loss = step_loss(trainer)
        if loss is not None:
            pl_module.log("train_loss", loss, on_step=True, on_epoch=False)
