"""The prepared dataset file and the LightningDataModule that reads it.

The prepared data is one safetensors file holding ``x_<split>`` (float32,
N x C x H x W, scaled to [0, 1]) and ``y_<split>`` (int64) for the train, val
and test splits, with the class count in its metadata. safetensors orders
tensors by dtype and name, so identical tensors give identical bytes; its
metadata, though, is a hash map written in arbitrary order, so we store
exactly one metadata key whose value is canonical JSON (see
:func:`reprotrain.hashing.safetensors_metadata`).

Data order is pinned by a ``torch.Generator`` seeded from ``seed`` and owned
by the data module (``train_generator``), so it does not depend on how much
of the global random stream the model consumed, and a checkpoint can save it.
The shift augmentation draws from numpy's global generator inside the worker
processes: its output is reproducible only because every worker is seeded
(Lightning's worker init function, enabled by ``configure_determinism``),
which is why ``num_workers`` defaults to 2. Workers are not persistent: each
epoch's workers are seeded from ``train_generator``, so resuming at an epoch
boundary with that generator restored replays the same augmentation. The
training loader is a :class:`ResumableLoader`, so a checkpoint written in the
middle of an epoch (at SIGTERM) resumes there with the same bits.

Under DDP (``shard=True``) each rank trains on its own share of the training
split (:class:`ShardSampler`): every epoch, every rank draws the same
permutation from its ``train_generator`` (seeded alike, consumed alike) and
takes every ``world_size``-th sample from its rank on. Its state is the
generator's, which checkpoints carry. Not torch's ``DistributedSampler``:
that one shuffles by ``seed + epoch`` with the epoch Lightning passes to
``set_epoch``, and after resuming from an end-of-epoch checkpoint Lightning
passed the finished epoch again (seen with Lightning 2.6: the resumed run's
batches differed from the first step of the next epoch). Workers are seeded
per rank: Lightning's worker init function mixes in the global rank.
Validation runs over the whole split on every rank, so its metrics are exact
and equal on every rank, with no all-reduce.

With ``micro_batch_size`` (``train.world_size_invariant``) the training loader
takes :class:`~reprotrain.distributed.worldsize.MicroBatchSampler`'s micro-batches of one
global order instead, and each image's shift is drawn from its own key
(:func:`~reprotrain.distributed.worldsize.sample_integers`), not from a worker's generator, so
neither the rank nor the worker decides a draw; the last partial batch of an
epoch is dropped.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import numpy as np
import torch
from safetensors import SafetensorError
from torch.utils.data import DataLoader, Dataset, Sampler

from reprotrain.atomic import atomic_write_safetensors
from reprotrain.distributed.worldsize import MicroBatchSampler, sample_integers
from reprotrain.hashing import load_safetensors, safetensors_metadata
from reprotrain.pipeline.errors import DataError

SPLITS = ("train", "val", "test")


@dataclass(frozen=True)
class PreparedData:
    tensors: dict[str, torch.Tensor]
    num_classes: int
    source: str

    def split(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tensors[f"x_{name}"], self.tensors[f"y_{name}"]

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.tensors["x_train"].shape[1:])


def save_prepared(path: str | Path, data: PreparedData) -> None:
    """Write ``data`` atomically as one safetensors file."""
    metadata = safetensors_metadata({"num_classes": data.num_classes, "source": data.source})
    atomic_write_safetensors(path, data.tensors, metadata)


def load_prepared(path: str | Path) -> PreparedData:
    """Read and check a prepared dataset file; :class:`DataError` names what is wrong."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: prepared data not found; run `dvc repro prepare`")
    try:
        tensors, metadata = load_safetensors(path)
    except (SafetensorError, OSError, ValueError) as err:
        raise DataError(f"{path}: unreadable ({err}); rerun `dvc repro prepare`") from None
    expected = {f"{axis}_{split}" for axis in "xy" for split in SPLITS}
    if set(tensors) != expected or "num_classes" not in metadata:
        raise DataError(f"{path}: not a reprotrain prepared dataset; rerun `dvc repro prepare`")
    return PreparedData(tensors, int(metadata["num_classes"]), str(metadata.get("source", "?")))


class ShiftedImages(Dataset):
    """Images with labels; optionally shifted by up to one pixel in each direction."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, augment: bool) -> None:
        self.x, self.y, self.augment = x, y, augment

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(
        self, item: int | tuple[int, tuple[int, int]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        index, key = item if isinstance(item, tuple) else (item, None)
        image = self.x[index]
        if self.augment:
            if key is None:  # the worker's generator, seeded per worker (and rank)
                dy, dx = np.random.randint(-1, 2, size=2)
            else:  # the sample's own: the same in any worker, on any rank
                dy, dx = sample_integers(key, -1, 2, size=2)
            image = _shift(image, int(dy), int(dx))
        return image, self.y[index]


def _shift(image: torch.Tensor, dy: int, dx: int) -> torch.Tensor:
    out = torch.zeros_like(image)
    h, w = image.shape[-2:]
    out[..., max(dy, 0) : h + min(dy, 0), max(dx, 0) : w + min(dx, 0)] = image[
        ..., max(-dy, 0) : h + min(-dy, 0), max(-dx, 0) : w + min(-dx, 0)
    ]
    return out


class PreparedDataModule(L.LightningDataModule):
    """Train / val loaders over a :class:`PreparedData`, with a seeded shuffle."""

    def __init__(
        self,
        data: PreparedData,
        batch_size: int,
        num_workers: int,
        augment: bool,
        seed: int,
        shard: bool = False,
        micro_batch_size: int | None = None,
    ) -> None:
        super().__init__()
        self.data = data
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.augment = augment
        self.seed = seed
        self.shard = shard
        self.micro_batch_size = micro_batch_size
        self.train_generator = torch.Generator().manual_seed(seed)

    def train_dataloader(self) -> DataLoader:
        x, y = self.data.split("train")
        dataset = ShiftedImages(x, y, self.augment)
        if self.micro_batch_size is not None:
            rank, ranks = self.trainer.global_rank, self.trainer.world_size
            micro_batches = MicroBatchSampler(
                len(dataset), self.batch_size, self.micro_batch_size, rank, ranks,
                self.train_generator,
            )  # fmt: skip
            return self._loader(dataset, batch_sampler=micro_batches)
        if not self.shard:
            return self._loader(dataset, shuffle=True)
        rank, ranks = self.trainer.global_rank, self.trainer.world_size
        return self._loader(
            dataset, sampler=ShardSampler(len(dataset), rank, ranks, self.train_generator)
        )

    def val_dataloader(self) -> DataLoader:
        x, y = self.data.split("val")
        return self._loader(ShiftedImages(x, y, augment=False))

    def _loader(
        self,
        dataset: Dataset,
        shuffle: bool = False,
        sampler: Sampler[int] | None = None,
        batch_sampler: Sampler[list] | None = None,
    ) -> DataLoader:
        """Training loaders (shuffled or sharded) take ``train_generator``, which seeds workers."""
        if batch_sampler is not None:
            return ResumableLoader(
                dataset,
                consumed=self._batches_trained,
                batch_sampler=batch_sampler,
                num_workers=self.num_workers,
                generator=self.train_generator,
            )
        if shuffle or sampler is not None:
            return ResumableLoader(
                dataset,
                consumed=self._batches_trained,
                batch_size=self.batch_size,
                shuffle=shuffle,
                sampler=sampler,
                num_workers=self.num_workers,
                generator=self.train_generator,
            )
        return WorkersIgnoreStopSignals(
            dataset, batch_size=self.batch_size, num_workers=self.num_workers
        )

    def _batches_trained(self) -> int:
        """Training batches of the current epoch whose step has run (Lightning's count)."""
        return self.trainer.fit_loop.epoch_loop.batch_progress.current.processed


class WorkersIgnoreStopSignals(DataLoader):
    """A DataLoader whose worker processes start with SIGTERM and SIGINT blocked.

    The mask is inherited by the forked workers and torch's worker loop leaves
    it, so a signal to the whole process group (a cluster preempting the job,
    Ctrl-C in a terminal) reaches the training processes alone: they stop after
    the batch and shut their workers down, instead of a killed worker failing a
    fetch at a different moment on each DDP rank.
    """

    def __iter__(self) -> Iterator:
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
        try:
            return super().__iter__()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


class ResumableLoader(WorkersIgnoreStopSignals):
    """A seeded training DataLoader that resumes in the middle of an epoch, bit for bit.

    Each epoch's iterator draws the shuffle and the workers' base seed from
    ``generator``. :meth:`state_dict` (which Lightning stores in every
    checkpoint, as it does for any loader with one) holds the generator's
    state from just before that draw and ``consumed()``, the batches training
    has used. After :meth:`load_state_dict` (Lightning calls it only when
    resuming mid-epoch) the next iterator rewinds the generator, draws the
    same order and seeds, and loads and drops the consumed batches, so every
    worker's augmentation stream is where it was.
    """

    def __init__(self, *args: object, consumed: Callable[[], int], **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._consumed = consumed
        self._epoch_start: torch.Tensor | None = None
        self._skip = 0

    def __iter__(self) -> Iterator:
        if self.generator is not None:
            self._epoch_start = self.generator.get_state()
        iterator = super().__iter__()
        for _ in range(self._skip):
            next(iterator)
        self._skip = 0
        return iterator

    def state_dict(self) -> dict[str, object]:
        return {"epoch_start": self._epoch_start, "consumed": int(self._consumed())}

    def load_state_dict(self, state: dict[str, object]) -> None:
        if self.generator is not None and state["epoch_start"] is not None:
            self.generator.set_state(state["epoch_start"])  # type: ignore[arg-type]
        self._skip = int(state["consumed"])  # type: ignore[call-overload]


class ShardSampler(Sampler[int]):
    """Rank ``rank``'s share of a permutation drawn from ``generator`` each epoch.

    Every rank must hold a generator in the same state: they then draw the
    same permutation and take disjoint shares. The permutation is padded with
    its first samples so every rank gets ``ceil(size / world_size)``.
    """

    def __init__(self, size: int, rank: int, world_size: int, generator: torch.Generator) -> None:
        self.size, self.rank, self.world_size = size, rank, world_size
        self.generator = generator
        self.per_rank = -(-size // world_size)

    def __len__(self) -> int:
        return self.per_rank

    def __iter__(self) -> Iterator[int]:
        order = torch.randperm(self.size, generator=self.generator).tolist()
        order += order[: self.per_rank * self.world_size - self.size]
        return iter(order[self.rank :: self.world_size])
