"""The curves the train stage writes: the module's own metric names, and the clash rule.

A module may log anything under any name; the pipeline's ``train_loss`` (the
loss each step returned) stays its own, and a module's metric of that name is
written as ``module/train_loss`` (the control: Lightning alone merges the two
into one value, silently).
"""

from __future__ import annotations

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


def _fit(callbacks: list[L.Callback], logger: MemoryLogger) -> None:
    torch.manual_seed(0)
    loader = DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=4)
    trainer = L.Trainer(
        max_epochs=2, logger=logger, callbacks=callbacks, log_every_n_steps=1,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(Logs(), loader, loader)


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
