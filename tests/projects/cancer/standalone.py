"""The classifier with its data in the module itself, as Lightning's LightningModule docs
write one: ``setup`` splits the table, ``*_dataloader()`` return the loaders, and a
LightningCLI config for it has no ``data`` section (``trainer.fit(model)``)."""

from __future__ import annotations

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import nn
from torch.utils.data import DataLoader

from cancer.data import CancerData
from cancer.model import CancerClassifier


class StandaloneClassifier(CancerClassifier):
    def __init__(
        self,
        net: nn.Module,
        optimizer: OptimizerCallable = torch.optim.Adam,
        scheduler: LRSchedulerCallable | None = None,
        batch_size: int = 32,
    ) -> None:
        super().__init__(net, optimizer, scheduler)
        self.batch_size = batch_size
        self.setup_calls: list[str] = []

    def setup(self, stage: str) -> None:
        self.setup_calls.append(stage)
        # The same split as the data module's, so both ways train the same bits
        splits = CancerData()
        splits.setup(stage)
        self.data_train, self.data_val = splits.data_train, splits.data_val
        self.data_test = splits.data_test

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data_train, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.data_val, batch_size=self.batch_size)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.data_test, batch_size=self.batch_size)
