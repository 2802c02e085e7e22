"""The loaders the pipeline builds around any data module.

The prepared dataset file is :mod:`reprotrain.pipeline.prepared` (no Lightning
there, so the ``prepare`` stage starts without it).

A user's data module gives datasets (``train_dataset()``, ``val_dataset()``,
``test_dataset()``, docs/your-model.md); :class:`PipelineLoaders` wraps it
and builds every loader, because the order of the training data is where
the guarantees live:

Data order is pinned by a ``torch.Generator`` seeded from ``seed`` and owned
by the wrapper (``train_generator``), so it does not depend on how much
of the global random stream the model consumed, and a checkpoint can save it.
Augmentation that draws from numpy's or torch's global generator inside the
worker processes is reproducible because every worker is seeded (Lightning's
worker init function, enabled by ``configure_determinism``). Workers are not
persistent: each epoch's workers are seeded from ``train_generator``, so
resuming at an epoch boundary with that generator restored replays the same
augmentation. The training loader is a :class:`ResumableLoader`, so a
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
takes :class:`~reprotrain.distributed.worldsize.MicroBatchSampler`'s micro-batches of one
global order instead, whose items are ``(index, key)``. A dataset that says
it takes such items (``accepts_sample_keys = True``) draws from the key
itself; any other is wrapped in :class:`SampleSeeded`, which seeds torch's,
numpy's and Python's global generators from the key around each
``__getitem__``: neither the rank nor the worker decides a draw. The last
partial batch of an epoch is dropped.
"""

from __future__ import annotations

import contextlib
import random
import signal
from collections.abc import Callable, Iterator

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

from reprotrain.distributed.worldsize import MicroBatchSampler, sample_seed
from reprotrain.pipeline.errors import DataError


class SampleSeeded(Dataset):
    """A dataset whose items are drawn with global generators seeded from the sample's key.

    Items are ``(index, key)`` (:class:`~reprotrain.distributed.worldsize.MicroBatchSampler`);
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
    """A user's data module's datasets in the loaders the guarantees need (module doc).

    ``source`` must be set up already (the train stage does it, to link its
    attributes to the model's arguments): this wrapper only builds loaders.
    """

    def __init__(
        self,
        source: L.LightningDataModule,
        seed: int,
        shard: bool = False,
        micro_batch_size: int | None = None,
    ) -> None:
        super().__init__()
        self.source = source
        self.batch_size = int(source.batch_size)  # type: ignore[attr-defined]
        self.num_workers = int(source.num_workers)  # type: ignore[attr-defined]
        self.collate_fn = getattr(source, "collate_fn", None)
        self.seed = seed
        self.shard = shard
        self.micro_batch_size = micro_batch_size
        self.train_generator = torch.Generator().manual_seed(seed)

    def train_dataloader(self) -> DataLoader:
        dataset = map_style(self.source.train_dataset(), "train")  # type: ignore[attr-defined]
        if self.micro_batch_size is not None:
            if not getattr(dataset, "accepts_sample_keys", False):
                dataset = SampleSeeded(dataset)
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
        return self._loader(map_style(self.source.val_dataset(), "val"))  # type: ignore[attr-defined]

    def test_dataloader(self) -> DataLoader:
        return self._loader(map_style(self.source.test_dataset(), "test"))  # type: ignore[attr-defined]

    def _loader(
        self,
        dataset: Dataset,
        shuffle: bool = False,
        sampler: Sampler[int] | None = None,
        batch_sampler: Sampler[list] | None = None,
    ) -> DataLoader:
        """Training loaders (shuffled or sharded) take ``train_generator``, which seeds workers."""
        common = {"num_workers": self.num_workers, "collate_fn": self.collate_fn}
        if batch_sampler is not None:
            return ResumableLoader(
                dataset,
                consumed=self._batches_trained,
                batch_sampler=batch_sampler,
                generator=self.train_generator,
                **common,
            )
        if shuffle or sampler is not None:
            return ResumableLoader(
                dataset,
                consumed=self._batches_trained,
                batch_size=self.batch_size,
                shuffle=shuffle,
                sampler=sampler,
                generator=self.train_generator,
                **common,
            )
        return WorkersIgnoreStopSignals(dataset, batch_size=self.batch_size, **common)

    def _batches_trained(self) -> int:
        """Training batches of the current epoch whose step has run (Lightning's count)."""
        return self.trainer.fit_loop.epoch_loop.batch_progress.current.processed


def first_batches(source: L.LightningDataModule, count: int) -> list[object]:
    """The first ``count`` training batches in dataset order (no shuffle, no workers).

    For measurements on a step (``reprotrain bench``, ``reprotrain locate``):
    real batches of the data module, the same on every call.
    """
    dataset = map_style(source.train_dataset(), "train")  # type: ignore[attr-defined]
    loader = DataLoader(
        dataset, batch_size=int(source.batch_size), collate_fn=getattr(source, "collate_fn", None)
    )  # type: ignore[attr-defined]
    batches = []
    for batch in loader:
        if len(batches) == count:
            break
        batches.append(batch)
    return batches


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
    worker's augmentation stream is where it was. With a batch sampler that
    skips by itself (:class:`~reprotrain.distributed.worldsize.MicroBatchSampler`,
    whose samples draw from their own keys) nothing is loaded again: the sampler
    starts past them, and the number of workers may differ from the interrupted run's.
    """

    def __init__(self, *args: object, consumed: Callable[[], int], **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._consumed = consumed
        self._epoch_start: torch.Tensor | None = None
        self._skip = 0

    def __iter__(self) -> Iterator:
        if self.generator is not None:
            self._epoch_start = self.generator.get_state()
        if self._skip and isinstance(self.batch_sampler, MicroBatchSampler):
            self.batch_sampler.skip, self._skip = self._skip, 0
        iterator = super().__iter__()
        with self._global_streams_kept():
            for _ in range(self._skip):
                next(iterator)
        self._skip = 0
        return iterator

    @contextlib.contextmanager
    def _global_streams_kept(self) -> Iterator[None]:
        """Without workers, replaying the consumed batches runs the dataset's draws in
        this process, after the checkpoint restored torch's, numpy's and Python's
        generators to where the interrupted run left them: keep them there."""
        if self.num_workers > 0 or not self._skip:
            yield
            return
        numpy_state, python_state = np.random.get_state(), random.getstate()
        with torch.random.fork_rng(devices=[]):
            yield
        np.random.set_state(numpy_state)
        random.setstate(python_state)

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
