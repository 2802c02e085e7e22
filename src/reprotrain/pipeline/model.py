"""The small CNN the pipeline trains, as a LightningModule.

Two 3x3 convolutions, a 2x2 max-pool, and a dropout-regularised two-layer
head. Dropout is there on purpose: it consumes the torch random stream every
step, so a seeding or resume mistake shows up in the weights.
"""

from __future__ import annotations

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F

from reprotrain.distributed.worldsize import step_loss
from reprotrain.pipeline.config import ModelConfig, TrainConfig


def build_network(config: ModelConfig, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """The bare ``nn.Module``; also used to load weights for evaluation."""
    channels, height, width = input_shape
    c = config.channels
    flat = 2 * c * (height // 2) * (width // 2)
    return nn.Sequential(
        nn.Conv2d(channels, c, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.Conv2d(c, 2 * c, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Dropout(config.dropout),
        nn.Linear(flat, config.hidden),
        nn.ReLU(),
        nn.Dropout(config.dropout),
        nn.Linear(config.hidden, num_classes),
    )


class Classifier(L.LightningModule):
    """Cross-entropy classifier; logs ``train_loss`` per step, ``val_*`` per epoch."""

    def __init__(
        self,
        model: ModelConfig,
        train: TrainConfig,
        input_shape: tuple[int, ...],
        num_classes: int,
    ) -> None:
        super().__init__()
        self.net = build_network(model, input_shape, num_classes)
        self.train_config = train

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        if not self.train_config.world_size_invariant:
            # Under DDP: the mean over the ranks (each rank's own loss is in the trace).
            self.log("train_loss", loss, on_step=True, on_epoch=False, sync_dist=True)
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        loss = step_loss(self.trainer)  # world-size invariant: every micro-batch's, tree-averaged
        if loss is not None:
            self.log("train_loss", loss, on_step=True, on_epoch=False)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y), on_epoch=True)
        self.log("val_acc", (logits.argmax(dim=1) == y).float().mean(), on_epoch=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        cfg = self.train_config
        params = self.parameters()
        if cfg.optimizer == "sgd":
            return torch.optim.SGD(params, lr=cfg.lr, momentum=0.9, weight_decay=cfg.weight_decay)
        optimizer = torch.optim.AdamW if cfg.optimizer == "adamw" else torch.optim.Adam
        return optimizer(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
