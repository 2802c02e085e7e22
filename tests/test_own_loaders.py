"""A data module's own ``*_dataloader()``: rebuilt with the run's order, or kept and named.

The user's choices (batch size, workers, collate_fn, drop_last, pin_memory)
survive the rebuild; the order is drawn from the run's seed whatever
``generator`` the module gave (the control: another seed, another order);
``shuffle=False`` stays in order. A loader whose order cannot be replaced is
used as it is, and each guarantee that needs the pipeline's order is refused
by name (the control: the same loader with a plain sampler is rebuilt).
"""

from __future__ import annotations

import itertools
import time

import lightning as L
import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    IterableDataset,
    SequentialSampler,
    TensorDataset,
    WeightedRandomSampler,
)

from reprotrain.pipeline.config import Params
from reprotrain.pipeline.contract import order_refusal
from reprotrain.pipeline.data import PipelineLoaders, first_batches
from reprotrain.pipeline.own_loaders import ORDER_GUARANTEES
from reprotrain.pipeline.params_file import parse_params
from reprotrain.pipeline.resumable_loader import ResumableLoader
from tests.helpers import params_with

SAMPLES = 20


def _dataset() -> TensorDataset:
    return TensorDataset(torch.arange(SAMPLES, dtype=torch.float32).unsqueeze(1))


def _collate(items: list) -> torch.Tensor:
    return torch.cat([item[0] for item in items])


class Docs(L.LightningDataModule):
    """As Lightning's docs write one: own loaders, arguments kept by save_hyperparameters."""

    def __init__(self, batch_size: int = 6, shuffle: bool = True, generator_seed: int = 0):
        super().__init__()
        self.save_hyperparameters()

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            _dataset(),
            batch_size=self.hparams.batch_size,
            shuffle=self.hparams.shuffle,
            drop_last=True,
            collate_fn=_collate,
            generator=torch.Generator().manual_seed(self.hparams.generator_seed),
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(_dataset(), batch_size=4, collate_fn=_collate)


class Stream(IterableDataset):
    def __iter__(self):
        return iter(_dataset())


class Subclassed(DataLoader):
    pass


KEPT = {
    "iterable dataset": (lambda: DataLoader(Stream(), batch_size=4), "reads an IterableDataset"),
    "own sampler": (
        lambda: DataLoader(_dataset(), batch_size=4, sampler=WeightedRandomSampler([1.0] * 20, 20)),
        "samples with its own sampler (WeightedRandomSampler)",
    ),
    "own batch sampler": (
        lambda: DataLoader(
            _dataset(), batch_sampler=BatchSampler(SequentialSampler(range(SAMPLES)), 4, False)
        ),
        "batches with its own batch_sampler (BatchSampler)",
    ),
    "DataLoader subclass": (
        lambda: Subclassed(_dataset(), batch_size=4),
        "returns a Subclassed, a DataLoader subclass",
    ),
    "not a DataLoader": (lambda: [torch.zeros(4, 1)], "returns a list, not a torch DataLoader"),
}


class Kept(Docs):
    def __init__(self, case: str = "iterable dataset") -> None:
        super().__init__()
        self.case = case

    def train_dataloader(self) -> object:
        return KEPT[self.case][0]()


def _order(loader: object) -> list[list[float]]:
    return [batch.tolist() for batch in loader]  # type: ignore[attr-defined]


def _flat(batches: list[list[float]]) -> list[float]:
    return list(itertools.chain.from_iterable(batches))


def _params(**changes: object) -> Params:
    return parse_params(params_with(changes))


def test_a_rebuilt_training_loader_keeps_the_modules_arguments_and_draws_the_runs_order() -> None:
    clock = time.time_ns()
    loaders = PipelineLoaders(Docs(generator_seed=clock), seed=3)
    loader = loaders.train_dataloader()
    assert isinstance(loader, ResumableLoader) and loader.generator is loaders.train_generator
    assert (loader.batch_size, loader.drop_last, loader.collate_fn) == (6, True, _collate)
    first = _order(loader)
    assert len(first) == SAMPLES // 6 and sorted(_flat(first)) != _flat(first)
    # The module's clock-seeded generator decides nothing: another one gives the same order.
    assert (
        _order(PipelineLoaders(Docs(generator_seed=clock + 1), seed=3).train_dataloader()) == first
    )
    # Control: another run seed, another order.
    assert _order(PipelineLoaders(Docs(generator_seed=clock), seed=4).train_dataloader()) != first


def test_no_shuffle_stays_in_order_and_the_batch_size_is_the_loaders() -> None:
    loaders = PipelineLoaders(Docs(batch_size=5, shuffle=False), seed=3)
    assert loaders.batch_size == 5
    assert _flat(_order(loaders.train_dataloader())) == list(range(SAMPLES))


def test_validation_keeps_the_modules_own_loader_arguments() -> None:
    loader = PipelineLoaders(Docs(), seed=3).val_dataloader()
    assert _flat(_order(loader)) == list(range(SAMPLES)) and loader.batch_size == 4


def test_first_batches_come_from_the_own_loader_in_dataset_order() -> None:
    assert [b.tolist() for b in first_batches(Docs(), 2)] == [
        list(range(6)),
        list(range(6, 12)),
    ]


@pytest.mark.parametrize("case", sorted(KEPT))
def test_a_loader_whose_order_cannot_be_replaced_is_used_as_it_is_and_named(case: str) -> None:
    loaders = PipelineLoaders(Kept(case), seed=3)
    kept = loaders.kept_order
    assert kept is not None and KEPT[case][1] in kept.kept_order  # type: ignore[operator]
    assert loaders.train_dataloader() is kept.loader
    assert order_refusal(_params(), kept) is None  # bitwise reruns need no more
    ddp = order_refusal(_params(**{"train.strategy": "ddp", "train.devices": 2}), kept)
    invariant = order_refusal(_params(**{"train.world_size_invariant": True}), kept)
    for refusal, guarantee in ((ddp, ORDER_GUARANTEES[1]), (invariant, ORDER_GUARANTEES[2])):
        assert refusal and refusal.startswith(guarantee) and "Kept.train_dataloader()" in refusal
        assert KEPT[case][1] in refusal and "\n" not in refusal
    # Control: the module's plain loader is rebuilt, and both guarantees are open to it.
    plain = PipelineLoaders(Docs(), seed=3).own("train")
    assert plain is not None and plain.kept_order is None
    assert order_refusal(_params(**{"train.strategy": "ddp", "train.devices": 2}), plain) is None


def test_world_size_invariance_refuses_a_loader_without_shuffle_by_name() -> None:
    invariant = _params(**{"train.world_size_invariant": True, "train.micro_batch_size": 2})
    in_order = PipelineLoaders(Docs(shuffle=False), seed=3).own("train")
    assert "asks for no shuffle" in str(order_refusal(invariant, in_order))
    shuffled = PipelineLoaders(Docs(), seed=3).own("train")
    assert order_refusal(invariant, shuffled) is None  # control: 6 = 3 micro-batches of 2


class HparamsOnly(L.LightningDataModule):
    """Gives datasets and keeps its arguments only in ``self.hparams``."""

    def __init__(self, batch_size: int = 7, num_workers: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()

    def train_dataset(self) -> Dataset:
        return _dataset()

    val_dataset = test_dataset = train_dataset


def test_a_data_module_that_keeps_its_arguments_in_hparams_gives_them_to_the_loaders() -> None:
    loaders = PipelineLoaders(HparamsOnly(), seed=3)
    assert loaders.batch_size == 7 and loaders.train_dataloader().batch_size == 7


class Workers(Docs):
    """Its own loader with workers, pinned memory and a prefetch depth of its own."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            _dataset(),
            batch_size=4,
            shuffle=True,
            num_workers=2,
            pin_memory=True,
            prefetch_factor=3,
            persistent_workers=True,
            timeout=30.0,
        )


def test_a_rebuilt_loader_keeps_the_modules_workers_and_pinned_memory() -> None:
    own = Workers().train_dataloader()
    loader = PipelineLoaders(Workers(), seed=3).train_dataloader()
    assert (loader.num_workers, loader.pin_memory, loader.prefetch_factor, loader.timeout) == (
        own.num_workers, own.pin_memory, own.prefetch_factor, own.timeout,
    )  # fmt: skip
    # The one argument the pipeline overrides, and why: each epoch's workers are seeded anew.
    assert own.persistent_workers and not loader.persistent_workers
    # Control: the module's loader without workers gives a rebuilt one without them.
    assert PipelineLoaders(Docs(), seed=3).train_dataloader().num_workers == 0


class BatchSizeOnly(L.LightningDataModule):
    """Gives datasets, its batch size only in ``self.hparams`` and no workers argument."""

    def __init__(self, batch_size: int = 5) -> None:
        super().__init__()
        self.save_hyperparameters()

    def train_dataset(self) -> Dataset:
        return _dataset()

    val_dataset = test_dataset = train_dataset


def test_a_data_module_without_a_workers_argument_loads_in_the_main_process() -> None:
    loader = PipelineLoaders(BatchSizeOnly(), seed=3).train_dataloader()
    assert (loader.batch_size, loader.num_workers) == (5, 0)
    # Control: the same module with a workers argument gets its workers.
    assert PipelineLoaders(HparamsOnly(num_workers=1), seed=3).train_dataloader().num_workers == 1
