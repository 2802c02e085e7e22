"""The wine CSV as a LightningDataModule that hands its splits to the pipeline.

``setup`` reads the CSV (a header row, 13 feature columns, then ``target``),
splits the samples by a permutation drawn from a numpy generator seeded with
``split_seed`` (the split does not move with the training seed), and
standardises every split with the train split's mean and standard deviation.
The module returns datasets, not loaders: the pipeline builds the loaders, so
it owns the sample order, mid-epoch resume and sharding.

Training samples get Gaussian feature noise drawn from torch's global
generator in ``__getitem__``, so the run depends on random state the pipeline
must seed: in the main process with ``num_workers: 0``, in each worker
otherwise.
"""

from __future__ import annotations

import csv
from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset


class NoisyFeatures(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Features and labels; each access adds ``noise`` x N(0, 1) to the features."""

    def __init__(self, features: torch.Tensor, targets: torch.Tensor, noise: float) -> None:
        self.features = features
        self.targets = targets
        self.noise = noise

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.features[index]
        if self.noise > 0:
            x = x + self.noise * torch.randn(x.shape, dtype=x.dtype)
        return x, self.targets[index]


def read_wine_csv(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Features (float64, N x F) and integer targets (N,) from the CSV at ``path``."""
    with path.open(newline="") as f:
        rows = list(csv.reader(f))
    if len(rows) < 2 or rows[0][-1] != "target":
        raise ValueError(f"{path}: expected a header row ending in 'target' and data rows")
    features = np.array([[float(v) for v in row[:-1]] for row in rows[1:]], dtype=np.float64)
    targets = np.array([int(row[-1]) for row in rows[1:]], dtype=np.int64)
    return features, targets


class WineData(L.LightningDataModule):
    """Train/val/test splits of the wine CSV, standardised by the train split."""

    def __init__(
        self,
        path: str = "data/wine.csv",
        batch_size: int = 16,
        num_workers: int = 0,
        val_fraction: float = 0.2,
        test_fraction: float = 0.2,
        split_seed: int = 0,
        noise: float = 0.05,
    ) -> None:
        super().__init__()
        for name, fraction in (("val_fraction", val_fraction), ("test_fraction", test_fraction)):
            if not 0 < fraction < 1:
                raise ValueError(f"{name} must be > 0 and < 1, got {fraction}")
        if val_fraction + test_fraction >= 1:
            raise ValueError(
                f"val_fraction + test_fraction must be < 1 (some samples must train), "
                f"got {val_fraction} + {test_fraction}"
            )
        if noise < 0:
            raise ValueError(f"noise must be >= 0, got {noise}")
        self.path = path
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.val_fraction = val_fraction
        self.test_fraction = test_fraction
        self.split_seed = split_seed
        self.noise = noise
        self.splits: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def setup(self, stage: str | None = None) -> None:
        if self.splits:
            return  # Lightning calls setup once per stage; the splits never change
        features, targets = read_wine_csv(Path(self.path))
        count = len(targets)
        order = np.random.Generator(np.random.PCG64(self.split_seed)).permutation(count)
        n_val = round(count * self.val_fraction)
        n_test = round(count * self.test_fraction)
        indices = {
            "test": order[:n_test],
            "val": order[n_test : n_test + n_val],
            "train": order[n_test + n_val :],
        }
        mean = features[indices["train"]].mean(axis=0)
        std = features[indices["train"]].std(axis=0)
        std[std == 0] = 1.0  # a constant column stays 0 instead of becoming NaN
        standardised = ((features - mean) / std).astype(np.float32)
        self.splits = {
            name: (torch.from_numpy(standardised[idx]), torch.from_numpy(targets[idx]))
            for name, idx in indices.items()
        }

    def train_dataset(self) -> Dataset[tuple[torch.Tensor, torch.Tensor]]:
        return NoisyFeatures(*self._split("train"), noise=self.noise)

    def val_dataset(self) -> Dataset[tuple[torch.Tensor, torch.Tensor]]:
        return TensorDataset(*self._split("val"))

    def test_dataset(self) -> Dataset[tuple[torch.Tensor, torch.Tensor]]:
        return TensorDataset(*self._split("test"))

    def _split(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.splits:
            raise RuntimeError("WineData: call setup() before asking for a dataset")
        return self.splits[name]
