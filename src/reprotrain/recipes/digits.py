"""The digits recipe: a small CNN on 8x8 images, the pipeline's default.

``params.yaml`` names it as any user names their own classes
(``model.class_path: reprotrain.recipes.digits.Classifier``,
``data.class_path: reprotrain.recipes.digits.DigitsData``), so it follows
the contract in docs/your-model.md and nothing in the stages knows it.

:class:`Classifier`: two 3x3 convolutions, a 2x2 max-pool and a
dropout-regularised two-layer head. Dropout is there on purpose: it consumes
the torch random stream every step, so a seeding or resume mistake shows up
in the weights. Its input shape and class count come from the data
(``DigitsData.model_links``).

:class:`DigitsData` reads what the ``prepare`` stage writes, a tensor file
or a shard folder (:mod:`reprotrain.pipeline.data`), and gives its splits as datasets;
the pipeline builds the loaders. The training images are shifted by up to
one pixel: with the sampler's per-sample key (world-size-invariant mode)
the shift is drawn from that key (:func:`~reprotrain.distributed.microbatches.sample_integers`),
otherwise from numpy's global generator in the seeded worker processes.
"""

from __future__ import annotations

from typing import Literal

import lightning as L
import numpy as np
import torch
from jsonargparse.typing import (
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    restricted_number_type,
)
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

from reprotrain.distributed.microbatches import sample_integers
from reprotrain.pipeline.prepared import load_prepared

#: A dropout probability: >= 0 and < 1.
Probability = restricted_number_type("Probability", float, [(">=", 0), ("<", 1)])


def build_network(
    input_shape: tuple[int, ...], num_classes: int, channels: int, hidden: int, dropout: float
) -> nn.Module:
    """The bare ``nn.Module``."""
    in_channels, height, width = input_shape
    c = channels
    flat = 2 * c * (height // 2) * (width // 2)
    return nn.Sequential(
        nn.Conv2d(in_channels, c, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.Conv2d(c, 2 * c, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Dropout(dropout),
        nn.Linear(flat, hidden),
        nn.ReLU(),
        nn.Dropout(dropout),
        nn.Linear(hidden, num_classes),
    )


class Classifier(L.LightningModule):
    """Cross-entropy CNN classifier; logs ``val_loss``, ``val_acc``, ``test_loss``, ``test_acc``."""

    def __init__(
        self,
        input_shape: tuple[int, int, int],
        num_classes: int,
        channels: PositiveInt = 16,
        hidden: PositiveInt = 64,
        dropout: Probability = 0.25,  # type: ignore[valid-type]
        optimizer: Literal["adam", "adamw", "sgd"] = "adam",
        lr: PositiveFloat = 0.005,
        weight_decay: NonNegativeFloat = 0.0,
    ) -> None:
        """``channels``: of the first conv layer (the second has twice); ``hidden``: width of
        the hidden fully connected layer; ``dropout``: probability (makes random state matter)."""
        super().__init__()
        self.net = build_network(input_shape, num_classes, channels, hidden, dropout)
        self.optimizer, self.lr, self.weight_decay = optimizer, lr, weight_decay

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> None:
        self._score(batch, "val")

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> None:
        self._score(batch, "test")

    def _score(self, batch: tuple[torch.Tensor, torch.Tensor], split: str) -> None:
        x, y = batch
        logits = self(x)
        self.log(f"{split}_loss", F.cross_entropy(logits, y), on_epoch=True)
        self.log(f"{split}_acc", (logits.argmax(dim=1) == y).float().mean(), on_epoch=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = self.parameters()
        if self.optimizer == "sgd":
            return torch.optim.SGD(params, lr=self.lr, momentum=0.9, weight_decay=self.weight_decay)
        optimizer = torch.optim.AdamW if self.optimizer == "adamw" else torch.optim.Adam
        return optimizer(params, lr=self.lr, weight_decay=self.weight_decay)


class ShiftedImages(Dataset):
    """A dataset of ``(image, label)`` pairs; the images optionally shifted by up to one pixel."""

    #: Items may be ``(index, key)``: the shift is then drawn from the key (see module doc).
    accepts_sample_keys = True

    def __init__(self, pairs: Dataset, augment: bool) -> None:
        """``pairs``: in memory or read from shards (:mod:`reprotrain.pipeline.data`)."""
        self.pairs, self.augment = pairs, augment

    def __len__(self) -> int:
        return len(self.pairs)  # type: ignore[arg-type]

    def __getitem__(
        self, item: int | tuple[int, tuple[int, int]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.__getitems__([item])[0]

    def __getitems__(
        self, items: list[int | tuple[int, tuple[int, int]]]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A batch: read together (one call for shards), then shifted sample by sample."""
        keyed = [item if isinstance(item, tuple) else (item, None) for item in items]
        indices = [index for index, _ in keyed]
        read = getattr(self.pairs, "__getitems__", None)
        pairs = read(indices) if read else [self.pairs[i] for i in indices]
        return [self._augmented(pair, key) for pair, (_, key) in zip(pairs, keyed, strict=True)]

    def _augmented(
        self, pair: tuple[torch.Tensor, torch.Tensor], key: tuple[int, int] | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        image, label = pair
        if self.augment:
            if key is None:  # the worker's generator, seeded per worker (and rank)
                dy, dx = np.random.randint(-1, 2, size=2)
            else:  # the sample's own: the same in any worker, on any rank
                dy, dx = sample_integers(key, -1, 2, size=2)
            image = _shift(image, int(dy), int(dx))
        return image, label


def _shift(image: torch.Tensor, dy: int, dx: int) -> torch.Tensor:
    out = torch.zeros_like(image)
    h, w = image.shape[-2:]
    out[..., max(dy, 0) : h + min(dy, 0), max(dx, 0) : w + min(dx, 0)] = image[
        ..., max(-dy, 0) : h + min(-dy, 0), max(-dx, 0) : w + min(-dx, 0)
    ]
    return out


class DigitsData(L.LightningDataModule):
    """The prepared data's splits (``prepare`` stage) as datasets: a tensor file held in
    memory, or a shard folder read from disk a batch at a time (docs/data.md)."""

    #: Set by :meth:`setup`, passed to the model's arguments of the same names.
    model_links = ("input_shape", "num_classes")

    def __init__(
        self,
        path: str = "data/prepared/dataset.safetensors",
        batch_size: PositiveInt = 64,
        num_workers: NonNegativeInt = 2,
        augment: bool = True,
    ) -> None:
        """``path``: the prepared file or shard folder; ``num_workers``: DataLoader worker
        processes (each seeded); ``augment``: random one-pixel shifts of training images."""
        super().__init__()
        self.path, self.batch_size, self.num_workers = path, batch_size, num_workers
        self.augment = augment

    def setup(self, stage: str) -> None:
        self.prepared = load_prepared(self.path)
        self.input_shape = self.prepared.input_shape
        self.num_classes = self.prepared.num_classes

    def train_dataset(self) -> ShiftedImages:
        return ShiftedImages(self.prepared.dataset("train"), augment=self.augment)

    def val_dataset(self) -> ShiftedImages:
        return ShiftedImages(self.prepared.dataset("val"), augment=False)

    def test_dataset(self) -> ShiftedImages:
        return ShiftedImages(self.prepared.dataset("test"), augment=False)
