"""A data module's own ``*_dataloader()`` loaders, taken apart so the pipeline can rebuild them.

Most data modules (Lightning's docs, the LightningCLI and Hydra templates)
build their own loaders. The user decides the dataset, the collate function,
the batch size, the workers, ``pin_memory`` and the transforms; the pipeline
needs only the training order to be its own, because bitwise mid-epoch
resume, DDP sharding and world-size invariance live there
(:mod:`reprotrain.pipeline.data`). So the loader a module returns is taken
apart with Lightning's own mechanism for re-creating a user's loader around
another sampler (``lightning.pytorch.utilities.data``, what Lightning does to
inject a distributed sampler), and :class:`~reprotrain.pipeline.data.PipelineLoaders`
rebuilds it with every argument the user chose and the pipeline's seeded
sampler in place of the module's shuffle (a shuffle drawn from the run's
seed, whatever ``generator`` the module gave; no shuffle stays no shuffle).

What cannot be taken apart keeps the module's own order (:attr:`OwnLoader.kept_order`
says why): an ``IterableDataset``, a custom sampler or batch sampler, a
``DataLoader`` subclass (its class may decide the batches), anything that is
not a ``DataLoader``. Such a loader is used as it is: reruns are still bitwise
(seeded global generators, seeded workers), while the guarantees that need the
order to be the pipeline's (:data:`ORDER_GUARANTEES`) are refused by name.

Validation and test loaders keep the module's sampler; a plain ``DataLoader``
is rebuilt only so its workers ignore stop signals (the run stops after the batch).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import lightning as L
from lightning.pytorch.utilities.data import _get_dataloader_init_args_and_kwargs
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

#: What only a training order the pipeline draws can give.
ORDER_GUARANTEES = ("mid-epoch resume", "DDP sharding (train.strategy: ddp)",
                    "world-size invariance (train.world_size_invariant)")  # fmt: skip
#: DataLoader arguments that make the order or the workers' seeds; the pipeline sets them.
ORDER_ARGUMENTS = ("sampler", "batch_sampler", "shuffle", "generator", "batch_size", "drop_last")
#: What the pipeline overrides in a rebuilt training loader: each epoch's workers are seeded
#: from the run's generator, so a resumed epoch replays the same augmentation.
TRAINING_OVERRIDES = {"persistent_workers": False}


def defines_own_loader(cls: type, split: str) -> bool:
    """Whether the data module class defines ``<split>_dataloader`` itself."""
    hook = f"{split}_dataloader"
    return getattr(cls, hook, None) is not getattr(L.LightningDataModule, hook, None)


def gives_dataset(cls: type, split: str) -> bool:
    """Whether the class gives ``split`` as a dataset: ``<split>_dataset()``, and no
    ``<split>_dataloader`` of its own (which would come first)."""
    return not defines_own_loader(cls, split) and callable(getattr(cls, f"{split}_dataset", None))


def gives_split(cls: type, split: str) -> bool:
    """Whether the class gives ``split`` at all: its own loader or a dataset."""
    return defines_own_loader(cls, split) or gives_dataset(cls, split)


@dataclass(frozen=True)
class OwnLoader:
    """A loader a data module returned, and what the pipeline may rebuild it from."""

    split: str
    #: Where it came from, for messages: ``CancerData.train_dataloader()``.
    where: str
    #: The loader exactly as the module returned it.
    loader: Any
    #: Why the module's own order is kept (the loader is used as it is); None: rebuilt.
    kept_order: str | None
    dataset: Dataset | None = None
    batch_size: int | None = None
    drop_last: bool = False
    #: Whether the module's sampler shuffles (a RandomSampler).
    shuffle: bool = False
    #: Every other argument the module gave the DataLoader (collate_fn, pin_memory, workers...).
    arguments: dict[str, Any] = field(default_factory=dict)

    @property
    def num_workers(self) -> int:
        return int(getattr(self.loader, "num_workers", 0))

    def refusal(self, guarantee: str) -> str:
        """One line: ``guarantee`` needs the pipeline's order, which this loader keeps."""
        return (
            f"{guarantee} needs the pipeline to draw the training order, but "
            f"{self.where} {self.kept_order}, so its order is its own; for {guarantee}, "
            "return a torch DataLoader over a map-style dataset with shuffle=True or False "
            "(docs/your-model.md)"
        )


def order_problem(loader: OwnLoader | None, shard: bool, invariant: bool) -> str | None:
    """Why sharding (DDP) or world-size invariance cannot draw this training loader's order;
    None when it can (or the data module gives datasets: the pipeline's order, shuffled)."""
    if loader is None:
        return None
    if loader.kept_order is not None:
        if invariant:
            return loader.refusal(ORDER_GUARANTEES[2])
        return loader.refusal(ORDER_GUARANTEES[1]) if shard else None
    if invariant and not loader.shuffle:
        return (
            f"{ORDER_GUARANTEES[2]} draws one seeded global order, but "
            f"{loader.where} asks for no shuffle; shuffle it or leave the mode off"
        )
    return None


def own_loader(datamodule: L.LightningDataModule, split: str) -> OwnLoader | None:
    """The set-up ``datamodule``'s own ``<split>_dataloader()`` taken apart; None without one."""
    if not defines_own_loader(type(datamodule), split):
        return None
    hook = f"{split}_dataloader"
    return take_apart(getattr(datamodule, hook)(), split, f"{type(datamodule).__name__}.{hook}()")


def take_apart(loader: Any, split: str, where: str) -> OwnLoader:
    """What ``loader`` was built from, or why its order has to stay its own."""
    if (why := _why_kept(loader)) is not None:
        return OwnLoader(split, where, loader, kept_order=why)
    args, kwargs = _get_dataloader_init_args_and_kwargs(loader, loader.sampler)
    named = inspect.signature(DataLoader).bind_partial(*args, **kwargs).arguments
    arguments = {k: v for k, v in named.items() if k not in ORDER_ARGUMENTS}
    dataset = arguments.pop("dataset")
    return OwnLoader(
        split, where, loader, kept_order=None, dataset=dataset,
        batch_size=loader.batch_size, drop_last=loader.drop_last,
        shuffle=isinstance(loader.sampler, RandomSampler), arguments=arguments,
    )  # fmt: skip


def _why_kept(loader: Any) -> str | None:
    """Why ``loader``'s order cannot be replaced by the pipeline's; None when it can."""
    if not isinstance(loader, DataLoader):
        return f"returns a {type(loader).__name__}, not a torch DataLoader"
    if type(loader) is not DataLoader:
        kind = type(loader).__name__
        return f"returns a {kind}, a DataLoader subclass that may decide its batches"
    if isinstance(loader.dataset, IterableDataset):
        return f"reads an IterableDataset ({type(loader.dataset).__name__}), which has no index"
    if loader.batch_size is None:
        batches = type(loader.batch_sampler).__name__ if loader.batch_sampler else "batch_size=None"
        return f"batches with its own batch_sampler ({batches})"
    if type(loader.batch_sampler) is not BatchSampler:
        return f"batches with its own batch_sampler ({type(loader.batch_sampler).__name__})"
    sampler = loader.sampler
    if type(sampler) is SequentialSampler:
        return None
    whole = type(sampler) is RandomSampler and not sampler.replacement
    if whole and sampler.num_samples == len(sampler.data_source):  # type: ignore[arg-type]
        return None
    return f"samples with its own sampler ({type(sampler).__name__})"
