"""The curves the train stage writes: the module's own metric names, and the clash rule.

A module may log anything under any name; the pipeline's ``train_loss`` (the
loss each step returned) stays its own, and a module's metric of that name is
written as ``module/train_loss`` (the control: Lightning alone merges the two
into one value, silently). Under manual optimization ``train_loss`` is the mean of
what each step passed to ``manual_backward``; a batch ``training_step`` skips
(returns ``None``) has none (the control: Lightning alone writes the step
before's value again).
"""

from __future__ import annotations

import warnings

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from reprotrain.pipeline.curves import EPOCH, STEP, MemoryLogger, MetricLevels, TrainLossLogger


class Logs(L.LightningModule):
    """Logs its own ``train_loss`` (100 x the loss it returns) and ``val/acc``."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
        loss = self.layer(batch[0]).pow(2).mean()
        self.log("train_loss", 100 * loss)
        self.log("train/mean", loss, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: list[torch.Tensor], index: int) -> None:
        self.log("val/acc", torch.tensor(0.5))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class TwoBackwards(Logs):
    """Manual optimization with two ``manual_backward`` calls a step, as a GAN's two losses;
    keeps what it passed."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.passed: list[list[float]] = []

    def training_step(self, batch: list[torch.Tensor], index: int) -> None:
        opt = self.optimizers()
        opt.zero_grad()
        first = self.layer(batch[0]).pow(2).mean()
        second = 3 * self.layer(batch[0]).abs().mean()
        self.manual_backward(first)
        self.manual_backward(second)
        opt.step()
        self.passed.append([first.item(), second.item()])


class Skips(Logs):
    """Returns None for the second batch of each epoch: Lightning's "skip this batch"."""

    def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor | None:
        loss = super().training_step(batch, index)
        return None if index == 1 else loss


class Sparse(Logs):
    """Logs ``sparse`` (its global step) at each epoch's first batch only."""

    def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
        if index == 0:
            self.log("sparse", float(self.global_step))
        return super().training_step(batch, index)


def _fit(
    callbacks: list[L.Callback], logger: MemoryLogger, module: L.LightningModule | None = None
) -> None:
    torch.manual_seed(0)
    loader = DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=4)
    trainer = L.Trainer(
        max_epochs=2, logger=logger, callbacks=callbacks, log_every_n_steps=1,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's note on a step that returned None
        trainer.fit(module or Logs(), loader, loader)


def test_the_modules_names_are_kept_and_its_own_train_loss_goes_under_module() -> None:
    logger = MemoryLogger()
    _fit([MetricLevels(logger), TrainLossLogger()], logger)
    assert logger.names(STEP) == ["module/train_loss", "train_loss"]
    assert logger.names(EPOCH) == ["val/acc", "train/mean"]
    ours, theirs = logger.rows("train_loss"), logger.rows("module/train_loss")
    assert [s for s, _ in ours] == [s for s, _ in theirs] == [0, 1, 2, 3]
    for (_, loss), (_, hundredfold) in zip(ours, theirs, strict=True):
        assert abs(hundredfold - 100 * loss) < 1e-4 * hundredfold
    columns, rows = logger.table(EPOCH)
    assert columns == ["val/acc", "train/mean"] and [row[0] for row in rows] == [0, 1]


def test_without_the_rule_lightning_merges_two_train_losses_into_one() -> None:
    class Merged(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, index) -> None:  # type: ignore[no-untyped-def]
            module.log("train_loss", outputs["loss"].detach())

    logger = MemoryLogger()
    _fit([MetricLevels(logger), Merged()], logger)
    assert logger.names(STEP) == ["module/train_loss"]  # one value of two: the other is lost


def test_manual_optimization_logs_the_mean_of_what_each_step_passed_to_manual_backward() -> None:
    logger, module = MemoryLogger(), TwoBackwards()
    _fit([MetricLevels(logger), TrainLossLogger()], logger, module)
    logged = [loss for _, loss in logger.rows("train_loss")]
    assert len(logged) == len(module.passed) == 4
    for loss, (first, second) in zip(logged, module.passed, strict=True):
        assert abs(loss - (first + second) / 2) <= 1e-6 * loss
        assert abs(loss - first) > 1e-3 * loss  # the mean, not the first


def test_a_skipped_batch_has_no_train_loss_where_lightning_alone_repeats_the_step_before() -> None:
    logger = MemoryLogger()
    _fit([MetricLevels(logger), TrainLossLogger()], logger, Skips())
    columns, rows = logger.table(STEP, first=("train_loss",))
    assert columns == ["train_loss", "module/train_loss"] and [r[0] for r in rows] == [0, 1, 2, 3]
    assert [row[1] == "" for row in rows] == [False, True, False, True]

    class Logged(L.Callback):  # the loss logged whenever there is one, and nothing else done
        def on_train_batch_end(self, trainer, module, outputs, batch, index) -> None:  # type: ignore[no-untyped-def]
            if outputs.get("loss") is not None:
                module.log("reprotrain/train_loss", outputs["loss"].detach())

    control = MemoryLogger()  # and no MetricLevels, which forgets each step's values
    _fit([Logged()], control, Skips())
    repeated = control.rows("train_loss")
    assert [step for step, _ in repeated] == [0, 1, 2, 3] and repeated[1][1] == repeated[0][1]


def test_a_metric_logged_at_some_steps_has_rows_at_those_steps_where_lightning_repeats_it() -> None:
    logger = MemoryLogger()
    _fit([MetricLevels(logger), TrainLossLogger()], logger, Sparse())
    assert logger.rows("sparse") == [(0, 0.0), (2, 2.0)]
    _, rows = logger.table(STEP, first=("train_loss",))
    assert [row[2] for row in rows] == [0.0, "", 2.0, ""]  # an empty cell where not logged
    # Control: Lightning alone flushes the last value again at every later step.
    control = MemoryLogger()
    _fit([], control, Sparse())
    assert control.rows("sparse") == [(0, 0.0), (1, 0.0), (2, 2.0), (3, 2.0)]


class OwnStep(Logs):
    """Logs a metric named ``step`` (Lightning's x-axis override): the batch's index."""

    def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
        self.log("step", float(index))
        return super().training_step(batch, index)


def test_a_metric_named_step_does_not_take_the_place_of_the_trainers_step() -> None:
    logger = MemoryLogger()
    _fit([MetricLevels(logger), TrainLossLogger()], logger, OwnStep())
    losses = logger.rows("train_loss")
    assert [step for step, _ in losses] == [0, 1, 2, 3]  # every step of both epochs
    # Control: the step Lightning passes is the module's (0, 1, 0, 1): the second epoch's
    # rows fell on the first's indexes and were dropped.
    control = MemoryLogger()
    _fit([TrainLossLogger()], control, OwnStep())
    assert [step for step, _ in control.rows("train_loss")] == [0, 1]
