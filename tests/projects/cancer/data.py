"""scikit-learn's breast-cancer table (bundled with scikit-learn: no file to read)."""

from __future__ import annotations

import lightning as L
import torch
from sklearn.datasets import load_breast_cancer
from torch.utils.data import DataLoader, TensorDataset, random_split


class CancerData(L.LightningDataModule):
    def __init__(self, batch_size: int = 32, num_workers: int = 0, pin_memory: bool = False):
        super().__init__()
        self.save_hyperparameters(logger=False)

    def setup(self, stage: str | None = None) -> None:
        x, y = load_breast_cancer(return_X_y=True)
        x = torch.tensor(x, dtype=torch.float32)
        x = (x - x.mean(0)) / x.std(0)
        full = TensorDataset(x, torch.tensor(y, dtype=torch.float32))
        self.data_train, self.data_val, self.data_test = random_split(
            full, [0.7, 0.15, 0.15], generator=torch.Generator().manual_seed(42)
        )

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.data_train,
            batch_size=self.hparams.batch_size,
            num_workers=self.hparams.num_workers,
            pin_memory=self.hparams.pin_memory,
            shuffle=True,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(
            self.data_val,
            batch_size=self.hparams.batch_size,
            num_workers=self.hparams.num_workers,
            pin_memory=self.hparams.pin_memory,
            shuffle=False,
        )

    def test_dataloader(self) -> DataLoader:
        return DataLoader(
            self.data_test,
            batch_size=self.hparams.batch_size,
            num_workers=self.hparams.num_workers,
            pin_memory=self.hparams.pin_memory,
            shuffle=False,
        )
