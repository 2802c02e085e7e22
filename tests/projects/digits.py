"""A user's own LightningModule and LightningDataModule (no reprotrain in them).

What the Hydra and LightningCLI example projects beside this file train:
an MLP on scikit-learn's bundled 8x8 digits, shuffled by a seeded
generator, with two DataLoader workers. ``fault=True`` plants a value that
differs between processes (the process ID) at one line, marked ``# FAULT``,
from step ``fault_step`` on, for the tests' "named at its line" cases.
"""

from __future__ import annotations

import os

import lightning as L
import torch
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset


class DigitsMLP(L.LightningModule):
    def __init__(
        self, hidden: int = 32, lr: float = 0.01, fault: bool = False, fault_step: int = 3
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Flatten(),
            torch.nn.Linear(64, hidden),
            torch.nn.BatchNorm1d(hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(hidden, 10),
        )

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        x, y = batch
        scale = 1.0
        if self.hparams.fault and self.global_step >= self.hparams.fault_step:
            scale = 1.0 + (os.getpid() % 4093 + 1) * 1e-5  # unequal unless pids 4093k apart
        logits = self.net(x) * scale  # FAULT
        loss = torch.nn.functional.cross_entropy(logits, y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


class DigitsData(L.LightningDataModule):
    def __init__(self, batch_size: int = 64, num_workers: int = 2, seed: int = 0) -> None:
        super().__init__()
        self.batch_size, self.num_workers, self.seed = batch_size, num_workers, seed

    def setup(self, stage: str) -> None:
        x, y = load_digits(return_X_y=True)
        self.train_set = TensorDataset(
            torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y, dtype=torch.long)
        )

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_set,
            batch_size=self.batch_size,
            shuffle=True,
            num_workers=self.num_workers,
            generator=torch.Generator().manual_seed(self.seed),
            persistent_workers=False,
        )
