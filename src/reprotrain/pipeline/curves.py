"""A Lightning logger that keeps metrics in memory for DVC plots and metrics.

Lightning's CSV and TensorBoard loggers write into ``version_N`` folders and
stamp wall-clock times; neither may reach a file whose hash DVC compares. This
one only collects rows and lets the stage write them: **step rows**, flushed
once per training step (the pipeline's ``train_loss``, and what a module logs
``on_step``), and **epoch rows**, flushed once per epoch (validation metrics,
and training metrics a module logs ``on_epoch``). :class:`MetricLevels` tells
the logger which kind Lightning flushes next.

Names are the module's own (``train/loss``, ``val/acc``, a torchmetrics
metric's name). The pipeline's ``train_loss`` (the loss each step returned)
is logged under :data:`LOGGED_LOSS`, so a module's own ``train_loss`` stays
apart (Lightning would merge two ``self.log`` calls of one name from two hooks,
silently); the rule: a module's metric named like one the pipeline writes
(:data:`PIPELINE_NAMES`) is written as ``module/<name>``.

The pipeline's ``train_loss`` of a step (:class:`TrainLossLogger`) is the loss
``training_step`` returned; under manual optimization
(``automatic_optimization = False``, where ``training_step`` need return
nothing) the mean of the losses the step passed to ``manual_backward``, in the
order passed (one call: that loss; a generator's and a discriminator's loss:
their mean). A step with no loss, a batch ``training_step`` skipped by
returning ``None`` (Lightning's "skip this batch") or a manual step that
called no ``manual_backward``, logs none: its ``train_loss`` cell in
``train_loss.csv`` is empty (not the step before's value, which Lightning would
flush again), and the step has no row when nothing else is logged per step. So
is any metric of the module's in a step that did not log it (:class:`MetricLevels`).
World-size-invariant training needs a loss from every
micro-batch, so it refuses a skipped batch by name (and the train stage
refuses manual optimization before it starts).

:class:`CurveCheckpoint` keeps the rows in checkpoints, so a resumed run's
curves are those of an uninterrupted one (and
:class:`~reprotrain.pipeline.epoch_metrics.EpochAccumulators` a module's own
epoch metrics).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import rank_zero_only

from reprotrain.distributed.worldsize import WorldSizeInvariantStrategy, step_loss
from reprotrain.pipeline.errors import DataError

#: The pipeline's own curve: the loss each training step returned.
TRAIN_LOSS = "train_loss"
#: Names the pipeline writes in train_metrics.json itself.
PIPELINE_NAMES = (TRAIN_LOSS, "epochs", "steps")
#: Where a module's metric named like one of :data:`PIPELINE_NAMES` goes.
MODULE_PREFIX = "module/"
#: The name the pipeline's loss is logged under inside Lightning (written as ``train_loss``).
LOGGED_LOSS = "reprotrain/train_loss"
STEP, EPOCH, SKIP = "step", "epoch", "skip"


def written_name(logged: str) -> str:
    """The name a logged metric is written under (module doc)."""
    if logged == LOGGED_LOSS:
        return TRAIN_LOSS
    return MODULE_PREFIX + logged if logged in PIPELINE_NAMES else logged


class MemoryLogger(Logger):
    """Collects logged scalars as ``(level, index, name, value)`` rows: ``level`` is
    ``"step"`` (index: the step) or ``"epoch"`` (index: the epoch).

    ``training_metrics=False`` (world-size-invariant mode) keeps what the module
    logs in training out: each rank logs its own share of the micro-batches, so
    those values follow the world size, which the mode promises the outputs do
    not. The pipeline's ``train_loss`` and validation (the whole split on every
    rank) stay.
    """

    def __init__(self, training_metrics: bool = True) -> None:
        super().__init__()
        self._rows: list[tuple[str, int, str, float]] = []
        self._held: set[tuple[str, int, str]] = set()  # each row's (level, index, name)
        self.training_metrics = training_metrics
        #: What Lightning flushes next (set by :class:`MetricLevels`), the epoch it is in,
        #: and the training loop whose step count indexes step rows.
        self.level, self.epoch, self.loop = STEP, 0, None

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
        if self.level == SKIP:
            return
        index = self.epoch
        if self.level == STEP:
            # The batches that stepped, as Lightning counts them for its own step; not
            # ``step``, which is a module's own where it logs a metric named "step"
            # (Lightning's x-axis override): rows of equal indexes would be dropped.
            index = self.loop._batches_that_stepped if self.loop is not None else int(step or 0)
        self.add(self.level, index, self.kept(self.level, metrics))

    def kept(self, level: str, metrics: Mapping[str, Any]) -> Mapping[str, Any]:
        """``metrics`` of a training flush at ``level``, less what ``training_metrics`` drops."""
        if level == STEP and not self.training_metrics:
            return {k: v for k, v in metrics.items() if k == LOGGED_LOSS}
        return metrics

    def add(self, level: str, index: int, metrics: Mapping[str, Any]) -> None:
        """Rows of ``metrics`` (logged names) at ``index``; a row already there stays."""
        for logged, value in metrics.items():
            row = (level, index, written_name(logged))
            if logged != "epoch" and row not in self._held:
                self._rows.append((*row, float(value)))
                self._held.add(row)

    @property
    def rows_held(self) -> list[tuple[str, int, str, float]]:
        """Every row, for a checkpoint."""
        return list(self._rows)

    def restore(self, rows: list[tuple[str, int, str, float]]) -> None:
        """Rows read back from a checkpoint, in place of these."""
        self._rows, self._held = list(rows), {row[:3] for row in rows}

    def names(self, level: str) -> list[str]:
        """Every name of ``level`` rows, in the order first logged."""
        return list(dict.fromkeys(name for lv, _, name, _ in self._rows if lv == level))

    def rows(self, name: str, level: str = STEP) -> list[tuple[int, float]]:
        return [(i, value) for lv, i, n, value in self._rows if lv == level and n == name]

    def table(self, level: str, first: tuple[str, ...] = ()) -> tuple[list[str], list[list[Any]]]:
        """Column names (``first`` first) and one row per index: ``[index, value or '', ...]``."""
        names = [*first, *(n for n in self.names(level) if n not in first)]
        cells: dict[int, dict[str, float]] = {}
        for lv, index, name, value in self._rows:
            if lv == level:
                cells.setdefault(index, {})[name] = value
        rows = [[i, *(cells[i].get(n, "") for n in names)] for i in sorted(cells)]
        return names, rows


class MetricLevels(L.Callback):
    """Tells a :class:`MemoryLogger` what Lightning flushes next: a training step's metrics
    (after each training batch), a validation batch's (not written: validation is written
    per epoch), or an epoch's (after validation and after the training epoch)."""

    def __init__(self, logger: MemoryLogger) -> None:
        self.logger = logger

    def _set(self, trainer: L.Trainer, level: str) -> None:
        self.logger.level, self.logger.epoch = level, trainer.current_epoch
        self.logger.loop = trainer.fit_loop.epoch_loop  # Lightning 2.6, as the locks pin

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._set(trainer, STEP)
        # Lightning flushes a step value again at every later step that does not log it
        # (Lightning 2.6, the version the locks pin; its CSVLogger writes the stale value):
        # forget the last batch's, so a step's row holds what that step logged, an empty
        # cell where it logged nothing (a skipped batch's train_loss too).
        for result in trainer.fit_loop.epoch_loop._results.values():
            for logged in result.values() if isinstance(result, dict) else (result,):
                if logged.meta.on_step:
                    logged._forward_cache = None

    def on_validation_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._set(trainer, SKIP)

    def on_validation_epoch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self._set(trainer, EPOCH)

    def on_train_epoch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self._set(trainer, EPOCH if self.logger.training_metrics else SKIP)


class CheckpointPlace(L.Callback):
    """Where in the epoch a checkpoint is being written: inside a training batch (at SIGTERM,
    ``InterruptCheckpoint``), or at an epoch's end (after validation or the training epoch)."""

    def __init__(self) -> None:
        self._trainer: L.Trainer | None = None
        self._in_batch = False

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._trainer = trainer

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._in_batch = True

    def on_validation_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._in_batch = False

    def on_train_epoch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self._in_batch = False


class CurveCheckpoint(CheckpointPlace):
    """Saves a :class:`MemoryLogger`'s rows with each checkpoint and restores them on resume.

    Lightning flushes what was logged after the hooks in which checkpoints are
    written: a batch's step metrics after ``on_train_batch_end`` (where
    ``InterruptCheckpoint`` writes at SIGTERM), a training epoch's ``on_epoch``
    metrics after ``on_train_epoch_end`` and ``on_validation_end`` (where the
    epoch's checkpoint is written). So the rows not flushed yet are added to
    the checkpoint: the pipeline's ``train_loss`` (under DDP the ranks' mean, one
    small all-reduce per batch) and what the module logged, read from the
    training loop's results as Lightning will flush them (Lightning 2.6, the
    version the locks pin: ``fit_loop.epoch_loop._results``).
    """

    def __init__(self, logger: MemoryLogger, losses: TrainLossLogger) -> None:
        super().__init__()
        self.logger = logger
        self.losses = losses
        #: The latest batch's step index and its train_loss (None: a batch with no loss).
        self._pending: tuple[int, float | None] | None = None

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
        batch_idx: int,
    ) -> None:  # fmt: skip
        # The index Lightning flushes this batch's step rows under (Lightning 2.6: the batches
        # that stepped so far), which global_step - 1 is not with two manual optimizers.
        index = trainer.fit_loop.epoch_loop._batches_that_stepped
        local = self.losses.local_loss(pl_module, outputs)
        if local is None:
            self._pending = (index, None)
            return
        loss = local.clone()
        invariant_loss = step_loss(trainer)  # world-size invariant mode
        if invariant_loss is not None:
            loss = invariant_loss
        elif trainer.world_size > 1:  # the ranks' mean, as `self.log(..., sync_dist=True)` takes it
            torch.distributed.all_reduce(loss, op=torch.distributed.ReduceOp.SUM)
            loss = loss / trainer.world_size
        self._pending = (index, float(loss))

    def state_dict(self) -> dict[str, Any]:
        kept = MemoryLogger()
        kept.restore(self.logger.rows_held)
        if self._pending is not None and self._pending[1] is not None:
            kept.add(STEP, self._pending[0], {LOGGED_LOSS: self._pending[1]})
        if self._trainer is not None:
            results = self._trainer.fit_loop.epoch_loop._results
            if self._in_batch and self._pending is not None:
                step_rows = self.logger.kept(STEP, results.metrics(True)["log"])
                kept.add(STEP, self._pending[0], step_rows)
            elif not self._in_batch and self.logger.training_metrics:
                kept.add(EPOCH, self._trainer.current_epoch, results.metrics(False)["log"])
        return {"rows": [list(row) for row in kept.rows_held]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.logger.restore([(str(lv), int(i), str(n), float(v)) for lv, i, n, v in state["rows"]])


class TrainLossLogger(L.Callback):
    """Logs ``train_loss``: the loss of each training step, for any module (module doc).

    What ``training_step`` returned, or under manual optimization the mean of the
    losses passed to ``manual_backward`` in the step (Lightning calls
    ``on_before_backward`` for each); none for a skipped batch. Under DDP the
    ranks' mean (each rank's own loss is in the trace); in world-size-invariant
    mode the step's loss over every micro-batch, added by the fixed tree
    (:func:`~reprotrain.distributed.worldsize.step_loss`), logged once the
    step's last backward ran. Logged as :data:`LOGGED_LOSS`, written as
    ``train_loss`` (a module's own ``train_loss`` becomes ``module/train_loss``,
    docs/your-model.md).
    """

    def __init__(self) -> None:
        self._backward: list[torch.Tensor] = []  # this step's manual_backward losses

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._backward = []

    def on_before_backward(
        self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor
    ) -> None:
        if not pl_module.automatic_optimization:
            self._backward.append(loss.detach().mean())

    def local_loss(self, pl_module: L.LightningModule, outputs: Any) -> torch.Tensor | None:
        """This rank's loss of the batch that just ended, detached; None if it has none."""
        if not pl_module.automatic_optimization:
            # sum() starts from 0 and one division by the count: one loss is itself, to the bit
            return sum(self._backward) / len(self._backward) if self._backward else None
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else None
        return loss.detach() if isinstance(loss, torch.Tensor) else None

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
        batch_idx: int,
    ) -> None:  # fmt: skip
        loss = self.local_loss(pl_module, outputs)
        if isinstance(trainer.strategy, WorldSizeInvariantStrategy):
            if loss is None:
                raise DataError(_skipped_under_invariance(pl_module, trainer, batch_idx))
            return  # logged once per step, in on_before_optimizer_step
        if loss is not None:  # none: no train_loss cell (MetricLevels forgot the last one)
            pl_module.log(LOGGED_LOSS, loss, on_step=True, on_epoch=False, sync_dist=True)

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        loss = step_loss(trainer)
        if loss is not None:
            pl_module.log(LOGGED_LOSS, loss, on_step=True, on_epoch=False)


def _skipped_under_invariance(module: L.LightningModule, trainer: L.Trainer, batch: int) -> str:
    name = type(module).__name__
    return (
        f"train.world_size_invariant: true, but {name}.training_step returned no loss for "
        f"micro-batch {batch} of epoch {trainer.current_epoch} (a skipped batch): the mode "
        "adds every micro-batch's gradient and loss by one fixed tree, so each must have one; "
        "return a loss for every batch, or set train.world_size_invariant: false"
    )
