"""A two-layer MLP classifier for the 13 wine features, as a LightningModule.

Dropout is there on purpose: it draws from torch's global generator every
step, so a seeding or resume mistake shows up in the weights. The module does
not log ``train_loss``: the pipeline logs the mean loss ``training_step``
returns (also under world-size invariance, where it averages micro-batches).
"""

from __future__ import annotations

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F

Batch = tuple[torch.Tensor, torch.Tensor]


class WineMLP(L.LightningModule):
    """Linear, ReLU, dropout, linear; cross-entropy loss; Adam."""

    def __init__(
        self,
        num_features: int = 13,
        num_classes: int = 3,
        hidden: int = 32,
        dropout: float = 0.1,
        lr: float = 0.01,
    ) -> None:
        super().__init__()
        if not 0 <= dropout < 1:
            raise ValueError(f"dropout must be >= 0 and < 1, got {dropout}")
        if lr <= 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        self.lr = lr
        self.net = nn.Sequential(
            nn.Linear(num_features, hidden),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)  # the mean over the batch

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        self._log_scores(batch, "val")

    def test_step(self, batch: Batch, batch_idx: int) -> None:
        self._log_scores(batch, "test")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)

    def _log_scores(self, batch: Batch, prefix: str) -> None:
        x, y = batch
        logits = self(x)
        self.log(f"{prefix}_loss", F.cross_entropy(logits, y), on_epoch=True)
        self.log(f"{prefix}_acc", (logits.argmax(dim=1) == y).float().mean(), on_epoch=True)
