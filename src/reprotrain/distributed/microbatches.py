"""The data side of world-size invariance: one global order of micro-batches, and per-sample keys.

:class:`MicroBatchSampler` cuts every global batch of one permutation (drawn
alike on every rank) into micro-batches and gives each rank its share, the same
at any world size; its items are ``(index, key)``, and a dataset's per-sample
random draws take their seed from the key (:func:`sample_integers`,
:func:`sample_rng`), so no draw depends on the rank or a DataLoader worker.
:func:`micro_batch_seed` seeds the global generators before each micro-batch
(:class:`~reprotrain.distributed.worldsize.WorldSizeInvariantStrategy`, the
gradient side, calls it). :func:`invariant_layout_problem` says why a batch
layout cannot be world-size invariant.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import Sampler

__all__ = [
    "MicroBatchSampler",
    "invariant_layout_problem",
    "micro_batch_seed",
    "sample_integers",
    "sample_rng",
    "sample_seed",
]


def invariant_layout_problem(batch_size: int, micro_batch_size: int, world_size: int) -> str | None:
    """Why this batch layout cannot be world-size invariant, or ``None`` when it can."""
    if micro_batch_size < 1 or batch_size % micro_batch_size:
        return f"micro_batch_size {micro_batch_size} does not divide batch_size {batch_size}"
    micro_batches = batch_size // micro_batch_size
    if world_size & (world_size - 1) or micro_batches % world_size:
        return (
            f"world size {world_size} is not a power of two that divides the "
            f"{micro_batches} micro-batches of a batch (batch_size / micro_batch_size)"
        )
    return None


def micro_batch_seed(seed: int, step: int, micro_batch: int) -> int:
    """A 63-bit seed for micro-batch ``micro_batch`` of optimizer step ``step``."""
    digest = hashlib.blake2b(f"{seed}/{step}/{micro_batch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def sample_rng(key: tuple[int, int]) -> np.random.Generator:
    """The generator for one sample's random draws (augmentation), from its sampler key.

    About 30 us to make; for a few small integers :func:`sample_integers` is cheaper.
    """
    return np.random.default_rng(list(key))


_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """SplitMix64's finaliser: a bijection of 64-bit integers that scatters every bit."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def sample_seed(key: tuple[int, int]) -> int:
    """A 64-bit seed for one sample's draws, from its sampler key (a hash of both parts)."""
    return _mix64(_mix64(key[0] & _MASK64) ^ (key[1] & _MASK64))


def sample_integers(key: tuple[int, int], low: int, high: int, size: int) -> list[int]:
    """``size`` integers in ``[low, high)`` for one sample, from its sampler key.

    A counter-based draw (draw ``i`` is a hash of the key and ``i``), so like
    :func:`sample_rng` it depends on the key alone; a few microseconds where
    making a numpy generator costs about 30. The modulo bias is below 2**-60
    for ranges under 16.
    """
    base = sample_seed(key)
    return [low + _mix64(base ^ _mix64(i)) % (high - low) for i in range(size)]


class MicroBatchSampler(Sampler[list[tuple[int, tuple[int, int]]]]):
    """A batch sampler: this rank's micro-batches of each global batch, the same at any world size.

    Each epoch draws one permutation and one epoch key from ``generator``
    (every rank's generator must be in the same state, as with a seeded
    shuffle); global batch ``s`` is ``order[s*B:(s+1)*B]``, micro-batch ``j``
    its ``j``-th slice of ``micro_batch_size``, and rank ``r`` takes
    micro-batches ``r*k .. r*k+k-1``. Items are ``(index, key)``: a dataset
    that draws at random per sample seeds :func:`sample_rng` with ``key``
    (the epoch key and the sample's position in the epoch's order). The last
    partial global batch is dropped.

    Setting :attr:`skip` makes the next epoch start at that many micro-batches of
    this rank in, without reading them: the order and key are drawn as ever, and
    no draw happened in the skipped samples that a later one depends on, so a
    resumed epoch goes on with the same micro-batches with any number of workers.
    """

    #: This rank's micro-batches to leave out at the start of the next epoch (then 0).
    skip: int = 0

    def __init__(
        self,
        size: int,
        batch_size: int,
        micro_batch_size: int,
        rank: int,
        world_size: int,
        generator: torch.Generator,
    ) -> None:
        problem = invariant_layout_problem(batch_size, micro_batch_size, world_size)
        if problem:
            raise ValueError(problem)
        if size < batch_size:
            raise ValueError(f"{size} samples do not fill one batch of {batch_size}")
        self.size, self.batch_size, self.micro_batch_size = size, batch_size, micro_batch_size
        self.rank, self.world_size, self.generator = rank, world_size, generator
        self.per_rank = batch_size // micro_batch_size // world_size

    def __len__(self) -> int:
        return self.size // self.batch_size * self.per_rank

    def __iter__(self) -> Iterator[list[tuple[int, tuple[int, int]]]]:
        order = torch.randperm(self.size, generator=self.generator).tolist()
        epoch_key = int(torch.randint(2**62, (), generator=self.generator))
        skip, self.skip = self.skip, 0
        m, n = self.micro_batch_size, 0
        for start in range(0, self.size - self.batch_size + 1, self.batch_size):
            for j in range(self.rank * self.per_rank, (self.rank + 1) * self.per_rank):
                n += 1
                if n > skip:
                    first = start + j * m
                    yield [(order[p], (epoch_key, p)) for p in range(first, first + m)]
