"""Building blocks of a trace row (:mod:`reprotrain.trace.callback`): keys, mixing, leaves, bits.

A row's batch, grads and params columns each combine per-tensor fingerprints
with a key per tensor (its name, dtype and shape) into one int64
(:class:`Mixer`). On a device that is a few tensor ops; on CPU the same
int64 arithmetic runs on Python ints, which then wrap as torch's int64 does
(:func:`int64`), so a row has the same values wherever it was built.
"""

from __future__ import annotations

import operator
import struct
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from reprotrain.trace.rngstate import hash_bytes

__all__ = [
    "DeviceBatch",
    "KeptBatch",
    "Mixer",
    "batch_leaves",
    "chain",
    "chain_losses",
    "float64_bits",
    "float64_value",
    "int64",
    "leaves",
    "tensor_key",
]


def tensor_key(*parts: object) -> int:
    """A tensor's key from its name, dtype and shape (any parts, joined as text)."""
    return hash_bytes("\0".join(map(str, parts)).encode())


def int64(value: int) -> int:
    """``value`` wrapped to a signed int64, as torch's int64 arithmetic wraps it."""
    return (value + (1 << 63)) % (1 << 64) - (1 << 63)


class Mixer:
    """Combines per-tensor fingerprints with their keys into one int64.

    Called with a tensor of fingerprints it works on their device; :meth:`host`
    does the same int64 arithmetic on Python ints.
    """

    def __init__(self, keys: Sequence[int], device: torch.device) -> None:
        # Odd multipliers below 2**31 keep each product inside int64 before the sum wraps.
        self._mult = [(k & 0x7FFFFFFF) | 1 for k in keys]
        self._offset = sum(k >> 32 for k in keys)
        self._device_mult = torch.tensor(self._mult, dtype=torch.int64, device=device)

    def __call__(self, fps: torch.Tensor) -> torch.Tensor:
        return (fps * self._device_mult).sum() + self._offset

    def rows(self, fps: torch.Tensor) -> torch.Tensor:
        """What calling it on each row of ``fps`` (rows x tensors) gives, for all rows at once."""
        return (fps * self._device_mult).sum(dim=1) + self._offset

    def host(self, fps: Sequence[int]) -> int:
        return int64(sum(map(operator.mul, fps, self._mult)) + self._offset)


class KeptBatch(NamedTuple):
    """A CPU batch's bits (copies), until the row's batch column is fingerprinted."""

    mix: Mixer
    leaves: list[bytes]


class DeviceBatch(NamedTuple):
    """A device batch's bits (one copy of all its tensors, side by side), until a flush."""

    layout: tuple[Any, ...]
    data: torch.Tensor


def chain(first: Any, then: Any) -> Any:
    """``first * 3 + then`` in int64 arithmetic: of two tensors, or of two lists of ints."""
    if isinstance(first, torch.Tensor):
        return first * 3 + then
    return [int64(a * 3 + b) for a, b in zip(first, then, strict=True)]


def chain_losses(losses: Sequence[torch.Tensor], device: torch.device | None) -> Any:
    """0-d float64 losses as one int64: their count ``h``, then ``h = h * 3 + bits`` for each.

    ``device`` None: a Python int (a CPU trace's row); else a 0-d tensor there, built
    with no copy from the host, so the step does not wait for the device.
    """
    if device is None:
        chained = len(losses)
        for loss in losses:
            chained = int64(chained * 3 + float64_bits(loss.item()))
        return chained
    chained_on_device = torch.full((), len(losses), dtype=torch.int64, device=device)
    for loss in losses:
        chained_on_device = chained_on_device * 3 + loss.to(device).view(torch.int64)
    return chained_on_device


def float64_value(loss: torch.Tensor) -> float:
    """The loss as float64, exactly: float64 holds every float loss, bits and value."""
    if loss.dtype not in (torch.float32, torch.float64):  # item() widens these exactly
        loss = loss.detach().to(torch.float64)
    return loss.item()


def float64_bits(value: float) -> int:
    """A float's bits as an int64: what a device row holds for the loss."""
    return struct.unpack("<q", struct.pack("<d", value))[0]


def batch_leaves(batch: Any) -> list[tuple[str, torch.Tensor]]:
    """:func:`leaves` of a batch, with a shortcut for the usual flat tuple or list of tensors."""
    if type(batch) in (tuple, list) and all(type(t) is torch.Tensor for t in batch):
        return [(f".{index}", t) for index, t in enumerate(batch)]
    return list(leaves(batch))


def leaves(obj: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(path, tensor) for every tensor in nested tuples, lists and mappings, in a fixed order."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, Mapping):
        for key in sorted(obj, key=str):
            yield from leaves(obj[key], f"{path}.{key}")
    elif isinstance(obj, (list, tuple)):
        for index, item in enumerate(obj):
            yield from leaves(item, f"{path}.{index}")
