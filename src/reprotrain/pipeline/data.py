"""The loaders the pipeline builds around any data module.

The prepared dataset file is :mod:`reprotrain.pipeline.prepared` (no Lightning
there, so the ``prepare`` stage starts without it).

A user's data module builds its own loaders (``train_dataloader()``...), or
gives datasets (``train_dataset()``, ``val_dataset()``, ``test_dataset()``);
:class:`PipelineLoaders` wraps it and rebuilds or builds every loader with the
user's arguments (:mod:`reprotrain.pipeline.own_loaders`) and the pipeline's
order, because the order of the training data is where the guarantees live:

Data order is pinned by a ``torch.Generator`` seeded from ``seed`` and owned
by the wrapper (``train_generator``), so it does not depend on how much
of the global random stream the model consumed, and a checkpoint can save it.
Augmentation that draws from numpy's or torch's global generator inside the
worker processes is reproducible because every worker is seeded (Lightning's
worker init function, enabled by ``configure_determinism``). Workers are not
persistent: each epoch's workers are seeded from ``train_generator``, so
resuming at an epoch boundary with that generator restored replays the same
augmentation. The training loader is a
:class:`~reprotrain.pipeline.resumable_loader.ResumableLoader`, so a
checkpoint written in the middle of an epoch (at SIGTERM) resumes there with
the same bits.

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
takes :class:`~reprotrain.distributed.microbatches.MicroBatchSampler`'s micro-batches of one
global order instead, whose items are ``(index, key)``. A dataset that says
it takes such items (``accepts_sample_keys = True``) draws from the key
itself; any other is wrapped in :class:`SampleSeeded`, which seeds torch's,
numpy's and Python's global generators from the key around each
``__getitem__``: neither the rank nor the worker decides a draw. The last
partial batch of an epoch is dropped.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

from reprotrain.distributed.ddp import worker_start
from reprotrain.distributed.microbatches import MicroBatchSampler, sample_seed
from reprotrain.pipeline.errors import DataError
from reprotrain.pipeline.own_loaders import (
    ORDER_GUARANTEES,
    TRAINING_OVERRIDES,
    OwnLoader,
    gives_split,
    order_problem,
    own_loader,
)
from reprotrain.pipeline.resumable_loader import ResumableLoader, WorkersIgnoreStopSignals


class SampleSeeded(Dataset):
    """A dataset whose items are drawn with global generators seeded from the sample's key.

    Items are ``(index, key)`` (:class:`~reprotrain.distributed.microbatches.MicroBatchSampler`);
    torch's CPU, numpy's and Python's global generators are seeded from the key for
    the inner ``dataset[index]`` and restored after it, so the draw is the
    sample's own and the caller's streams (dropout's, in a loader without
    workers) do not move.
    """

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, item: tuple[int, tuple[int, int]]) -> object:
        index, key = item
        seed = sample_seed(key)
        numpy_state, python_state = np.random.get_state(), random.getstate()
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)  # the CPU's, which fork_rng restores
            np.random.seed(seed & 0xFFFFFFFF)
            random.seed(seed)
            try:
                return self.dataset[index]
            finally:
                np.random.set_state(numpy_state)
                random.setstate(python_state)


class PipelineLoaders(L.LightningDataModule):
    """A user's data module's loaders, rebuilt with the order the guarantees need (module doc).

    ``source`` is the data module, or the LightningModule itself where it defines its own
    ``*_dataloader()`` methods and params.yaml names no data module (``data: null``). It must
    be set up already (the train stage does it, to link its
    attributes to the model's arguments): this wrapper only builds loaders.
    For each split it takes the module's own ``<split>_dataloader()`` apart
    (:mod:`reprotrain.pipeline.own_loaders`) or, where the module gives
    ``<split>_dataset()`` instead, builds the loader with its ``batch_size``
    and ``num_workers`` (attributes or ``hparams``).
    """

    def __init__(
        self,
        source: L.LightningDataModule | L.LightningModule,
        seed: int,
        shard: bool = False,
        micro_batch_size: int | None = None,
    ) -> None:
        super().__init__()
        self.source = source
        self.seed = seed
        self.shard = shard
        self.micro_batch_size = micro_batch_size
        self.train_generator = torch.Generator().manual_seed(seed)
        self._own: dict[str, OwnLoader | None] = {}

    def own(self, split: str) -> OwnLoader | None:
        """The source's own ``<split>_dataloader()`` taken apart (asked once); None without."""
        if split not in self._own:
            self._own[split] = own_loader(self.source, split)
        return self._own[split]

    @property
    def batch_size(self) -> int:
        """The training batch size: the own loader's, else the data module's ``batch_size``
        (read for world-size invariance and the loaders the pipeline builds, never for a
        loader kept as it is)."""
        own = self.own("train")
        if own is not None:
            if own.batch_size is None:
                raise DataError(own.refusal(ORDER_GUARANTEES[2]))
            return own.batch_size
        return _argument(self.source, "batch_size")

    @property
    def kept_order(self) -> OwnLoader | None:
        """The own training loader whose order stays the module's (used as it is), if so."""
        own = self.own("train")
        return own if own is not None and own.kept_order is not None else None

    def train_dataloader(self) -> DataLoader:
        own = self.own("train")
        invariant = self.micro_batch_size is not None
        if problem := order_problem(own, self.shard, invariant):
            raise DataError(problem)
        if own is not None and own.kept_order is not None:
            return own.loader
        if own is None:
            dataset = map_style(self.source.train_dataset(), "train")  # type: ignore[attr-defined]
            chosen = _chosen(self.source)
            shuffle, drop_last = True, False
        else:
            dataset, chosen = own.dataset, {**own.arguments, **TRAINING_OVERRIDES}
            shuffle, drop_last = own.shuffle, own.drop_last
        if invariant:
            if not getattr(dataset, "accepts_sample_keys", False):
                dataset = SampleSeeded(dataset)
            rank, ranks = self.trainer.global_rank, self.trainer.world_size
            micro_batches = MicroBatchSampler(
                len(dataset), self.batch_size, self.micro_batch_size, rank, ranks,
                self.train_generator,
            )  # fmt: skip
            return self._loader(dataset, chosen, batch_sampler=micro_batches)
        if not self.shard:
            return self._loader(dataset, chosen, shuffle=shuffle, drop_last=drop_last, train=True)
        rank, ranks = self.trainer.global_rank, self.trainer.world_size
        sampler = ShardSampler(len(dataset), rank, ranks, self.train_generator, shuffle=shuffle)
        return self._loader(dataset, chosen, sampler=sampler, drop_last=drop_last)

    def val_dataloader(self) -> DataLoader | list:
        """The validation loader; none (an empty list: Lightning validates nothing) when the
        data module defines neither ``val_dataloader`` nor ``val_dataset``."""
        if not gives_split(type(self.source), "val"):
            return []
        return self._evaluation_loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._evaluation_loader("test")

    def _evaluation_loader(self, split: str) -> DataLoader:
        """The module's own loader with its own sampler (workers ignoring stop signals where it
        is a plain DataLoader), or one over its ``<split>_dataset()`` in order."""
        own = self.own(split)
        if own is None:
            dataset = map_style(getattr(self.source, f"{split}_dataset")(), split)
            return self._loader(dataset, _chosen(self.source))
        if own.kept_order is not None:
            return own.loader
        return WorkersIgnoreStopSignals(
            own.dataset, batch_size=own.batch_size, drop_last=own.drop_last,
            sampler=own.loader.sampler, generator=own.loader.generator,
            **_started(own.dataset, own.arguments),
        )  # fmt: skip

    def _loader(
        self,
        dataset: Dataset,
        chosen: dict[str, Any],
        shuffle: bool = False,
        sampler: Sampler[int] | None = None,
        batch_sampler: Sampler[list] | None = None,
        drop_last: bool = False,
        train: bool = False,
    ) -> DataLoader:
        """Training loaders (shuffled, in order or sharded) take ``train_generator``, which
        seeds workers; ``chosen`` is what the data module decided (workers, collate_fn...)."""
        chosen = _started(dataset, chosen)
        if batch_sampler is not None:
            return ResumableLoader(
                dataset,
                consumed=self._batches_trained,
                batch_sampler=batch_sampler,
                generator=self.train_generator,
                **chosen,
            )
        if train or sampler is not None:
            return ResumableLoader(
                dataset,
                consumed=self._batches_trained,
                batch_size=self.batch_size,
                shuffle=shuffle,
                sampler=sampler,
                drop_last=drop_last,
                generator=self.train_generator,
                **chosen,
            )
        return WorkersIgnoreStopSignals(dataset, batch_size=self.batch_size, **chosen)

    def _batches_trained(self) -> int:
        """Training batches of the current epoch whose step has run (Lightning's count)."""
        return self.trainer.fit_loop.epoch_loop.batch_progress.current.processed


def first_batches(source: L.LightningDataModule, count: int) -> list[object]:
    """The first ``count`` training batches in dataset order (no shuffle, no workers).

    For measurements on a step (``reprotrain bench``, ``reprotrain locate``):
    real batches of the data module, the same on every call (from its own
    loader as it is, where its order is its own).
    """
    own = own_loader(source, "train")
    if own is not None and own.kept_order is not None:
        loader: object = own.loader
    elif own is not None:
        collate = own.arguments.get("collate_fn")
        loader = DataLoader(own.dataset, batch_size=own.batch_size, collate_fn=collate)  # type: ignore[arg-type]
    else:
        dataset = map_style(source.train_dataset(), "train")  # type: ignore[attr-defined]
        batch_size = _argument(source, "batch_size")
        loader = DataLoader(dataset, batch_size=batch_size, **_chosen(source, workers=False))
    batches = []
    for batch in loader:  # type: ignore[attr-defined]
        if len(batches) == count:
            break
        batches.append(batch)
    return batches


def _argument(source: L.LightningDataModule, name: str, default: int | None = None) -> int:
    """A data module's integer ``name``: its attribute, else ``self.hparams`` (what
    ``save_hyperparameters()`` keeps), else ``default``; a DataError naming it when it has
    none of them."""
    value = getattr(source, name, None)
    if value is None:
        value = getattr(source, "hparams", {}).get(name, default)
    if type(value) is not int:
        raise DataError(
            f"{type(source).__name__} has no integer {name} (attribute or hparams); a data "
            f"module that gives datasets needs a batch_size (num_workers: 0 if it has none), "
            "or build your own *_dataloader() (docs/your-model.md)"
        )
    return value


def _started(dataset: Dataset, chosen: dict[str, Any]) -> dict[str, Any]:
    """``chosen`` with how its workers start, where the module left it open (under a
    process group, from a fork server: :func:`~reprotrain.distributed.ddp.worker_start`)."""
    if not chosen.get("num_workers") or chosen.get("multiprocessing_context") is not None:
        return chosen
    context = worker_start(dataset, chosen.get("collate_fn"))
    return chosen if context is None else {**chosen, "multiprocessing_context": context}


def _chosen(source: L.LightningDataModule, workers: bool = True) -> dict[str, Any]:
    """The DataLoader arguments a data module that gives datasets decides."""
    chosen: dict[str, Any] = {"collate_fn": getattr(source, "collate_fn", None)}
    if workers:
        chosen["num_workers"] = _argument(source, "num_workers", default=0)
    return chosen


def map_style(dataset: object, split: str) -> Dataset:
    """``dataset`` if it is map-style (``__len__`` and ``__getitem__``); else a DataError.

    An iterable dataset has no index to resume from mid-epoch, to shard or to
    cut into micro-batches, so the pipeline cannot keep its promises with one.
    """
    if isinstance(dataset, IterableDataset) or not (
        hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")
    ):
        raise DataError(
            f"{split}_dataset() returned a {type(dataset).__name__}, not a map-style dataset "
            "(__len__ and __getitem__): mid-epoch resume, sharding and world-size invariance "
            "need an index; return a map-style torch Dataset (docs/your-model.md)"
        )
    return dataset  # type: ignore[return-value]


class ShardSampler(Sampler[int]):
    """Rank ``rank``'s share of a permutation drawn from ``generator`` each epoch.

    Every rank must hold a generator in the same state: they then draw the
    same permutation and take disjoint shares. The permutation is padded with
    its first samples so every rank gets ``ceil(size / world_size)``. With
    ``shuffle=False`` (a data module's own loader that asked for none) the
    order is the dataset's, shared out the same way.
    """

    def __init__(
        self, size: int, rank: int, world_size: int, generator: torch.Generator,
        shuffle: bool = True,
    ) -> None:  # fmt: skip
        self.size, self.rank, self.world_size = size, rank, world_size
        self.generator, self.shuffle = generator, shuffle
        self.per_rank = -(-size // world_size)

    def __len__(self) -> int:
        return self.per_rank

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            order = torch.randperm(self.size, generator=self.generator).tolist()
        else:
            order = list(range(self.size))
        order += order[: self.per_rank * self.world_size - self.size]
        return iter(order[self.rank :: self.world_size])
