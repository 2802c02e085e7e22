"""A binary classifier: any ``net`` (given by class_path), BCE loss, torchmetrics accuracy,
optimizer and scheduler as callables (LightningCLI's types; Hydra's ``_partial_`` in the
template this follows)."""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import nn
from torchmetrics.classification import BinaryAccuracy


class MLP(nn.Module):
    def __init__(self, in_features: int = 30, hidden: int = 16, dropout: float = 0.1) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(in_features, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, 1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x).squeeze(-1)


class CancerClassifier(L.LightningModule):
    def __init__(
        self,
        net: nn.Module,
        optimizer: OptimizerCallable = torch.optim.Adam,
        scheduler: LRSchedulerCallable | None = None,
    ) -> None:
        super().__init__()
        # As the Hydra template does: every argument, the net and the callables included.
        self.save_hyperparameters(logger=False)
        self.net = net
        self.train_acc = BinaryAccuracy()
        self.val_acc = BinaryAccuracy()
        self.test_acc = BinaryAccuracy()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def model_step(self, batch: tuple[torch.Tensor, torch.Tensor]):
        x, y = batch
        logits = self(x)
        return F.binary_cross_entropy_with_logits(logits, y), logits, y

    def training_step(self, batch, batch_idx):
        loss, logits, y = self.model_step(batch)
        self.train_acc(logits, y.int())
        self.log("train/loss", loss, on_step=False, on_epoch=True, prog_bar=True)
        self.log("train/acc", self.train_acc, on_step=False, on_epoch=True, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        loss, logits, y = self.model_step(batch)
        self.val_acc(logits, y.int())
        self.log("val/loss", loss, on_step=False, on_epoch=True, prog_bar=True)
        self.log("val/acc", self.val_acc, on_step=False, on_epoch=True, prog_bar=True)

    def test_step(self, batch, batch_idx):
        loss, logits, y = self.model_step(batch)
        self.test_acc(logits, y.int())
        self.log("test/loss", loss, on_step=False, on_epoch=True)
        self.log("test/acc", self.test_acc, on_step=False, on_epoch=True)

    def configure_optimizers(self):
        optimizer = self.hparams.optimizer(params=self.trainer.model.parameters())
        if self.hparams.scheduler is None:
            return {"optimizer": optimizer}
        scheduler = self.hparams.scheduler(optimizer=optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler}}
