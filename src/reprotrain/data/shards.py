"""Datasets bigger than memory: a folder of shards, streamed a batch at a time, never whole.

The format (``reprotrain.shards/1``) is a folder: ``index.json`` and, per
split and field, plain ``.npy`` shards named ``<split>-<shard:05d>-<field>.npy``
(numpy, or any tool that reads ``.npy``, opens them). ``index.json`` is
canonical JSON::

    {"format": "reprotrain.shards/1", "meta": {...},
     "splits": {"train": {"samples": 1000,
                          "fields": {"x": {"dtype": "<f4", "shape": [1, 8, 8]}, ...},
                          "shards": [{"samples": 256,
                                      "files": {"x": {"name": ..., "bytes": ..., "sha256": ...},
                                                ...}}, ...]}}}

:class:`ShardedDataset` is a map-style dataset over one split: ``len`` and
``__getitem__`` (a tuple of tensors, in the index's field order, as a
``TensorDataset`` gives) and ``__getitems__`` (a list of them, which a
``DataLoader`` asks for a batch at a time). A field is either streamed or held.
Streamed (any field of a split over ``HELD_BYTES``, 16 MiB): a batch's rows
are read with ``os.preadv`` at their offsets in the field's shards, straight
into one array (a call per row, or per run of consecutive rows): no memory
map, nothing of the field kept, so that memory is what the batches need,
whatever the dataset's size. Held (a small field, such as the labels): its
rows are read a shard at a time, when a process first reads from that shard,
into one array of the split, and gathered from it, rather than a system call
per sample for a few bytes. What a process holds is therefore at
most ``HELD_BYTES`` per field, whatever the dataset's size.
Files open lazily in each process (a forked DataLoader worker opens its own).
Being map-style, it takes the order of whatever sampler reads it: the
pipeline's, which is one order for any worker count and, under world-size
invariance, any world size (docs/data.md).

:func:`check_shards` refuses, with a :class:`ShardError` naming the shard, a
missing or resized shard, one whose header disagrees with the index, an
index that names more samples than a shard holds, and (``hashes=True``,
reading every byte) a shard whose sha256 is not the index's.
:class:`~reprotrain.data.shard_writer.ShardWriter` writes the format.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

FORMAT = "reprotrain.shards/1"
INDEX = "index.json"


class ShardError(ValueError):
    """A shard folder that does not match its index: the message names the file."""


def shard_name(split: str, shard: int, field: str) -> str:
    return f"{split}-{shard:05d}-{field}.npy"


def read_index(folder: str | Path) -> dict[str, Any]:
    """The folder's index, its format checked; a ShardError if missing or unreadable."""
    path = Path(folder) / INDEX
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ShardError(f"{path}: no shard index; write the folder with ShardWriter") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ShardError(f"{path}: unreadable shard index ({err}); rewrite the folder") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        found = index.get("format") if isinstance(index, dict) else None
        raise ShardError(f"{path}: format {found!r}, expected {FORMAT!r}; rewrite the folder")
    return index


def _npy_layout(path: Path) -> tuple[int, np.dtype, tuple[int, ...]]:
    """(header bytes, dtype, shape) of an .npy file, from its header alone."""
    with path.open("rb") as handle:
        version = np.lib.format.read_magic(handle)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(handle)
        else:
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(handle)
        if fortran:
            raise ValueError("Fortran order")
        return handle.tell(), dtype, tuple(shape)


def check_shards(folder: str | Path, hashes: bool = False) -> dict[str, Any]:
    """The folder's index, once every shard it names matches it; else a ShardError.

    Without ``hashes`` it reads only headers and sizes (a missing, truncated or
    extended shard, a header that disagrees with the index, an index naming more
    samples than a shard holds); with it, every byte is hashed as well (an altered
    shard of the right size).
    """
    return _checked(Path(folder), hashes)[0]


def _checked(folder: Path, hashes: bool) -> tuple[dict[str, Any], dict[str, int]]:
    """:func:`check_shards`'s index, and each shard file's header size (where its rows start)."""
    index, headers = read_index(folder), {}
    for split, entry in index["splits"].items():
        counted = 0
        for shard in entry["shards"]:
            counted += shard["samples"]
            for field, spec in entry["fields"].items():
                file = shard["files"][field]
                headers[file["name"]] = _check_file(folder, file, shard["samples"], spec, hashes)
        if counted != entry["samples"]:
            raise ShardError(
                f"{folder / INDEX}: split {split!r} names {entry['samples']} samples but its "
                f"shards hold {counted}; rewrite the folder"
            )
    return index, headers


def _check_file(
    folder: Path, file: Mapping[str, Any], samples: int, spec: Mapping[str, Any], hashes: bool
) -> int:
    """The file's header size, once it matches its index entry; else a ShardError."""
    path = folder / file["name"]
    if not path.is_file():
        raise ShardError(f"{path}: shard missing (named in {INDEX}); restore it (dvc checkout)")
    try:
        header, dtype, shape = _npy_layout(path)
    except (OSError, ValueError) as err:
        raise ShardError(f"{path}: not a readable .npy shard ({err}); restore it") from None
    if dtype != np.dtype(spec["dtype"]) or tuple(shape[1:]) != tuple(spec["shape"]):
        raise ShardError(
            f"{path}: holds {dtype.str} x {list(shape[1:])}, the index says {spec['dtype']} x "
            f"{spec['shape']}; restore it"
        )
    if shape[0] < samples:
        raise ShardError(
            f"{path}: holds {shape[0]} samples, the index names {samples}; restore the shard"
        )
    size = path.stat().st_size
    if size != file["bytes"] or size != header + shape[0] * dtype.itemsize * _rows(shape[1:]):
        raise ShardError(
            f"{path}: {size} bytes, expected {file['bytes']} (truncated or extended); restore it"
        )
    if hashes and _sha256(path) != file["sha256"]:
        raise ShardError(f"{path}: sha256 differs from {INDEX}'s (altered); restore it")
    return header


def _rows(shape: tuple[int, ...] | list[int]) -> int:
    return int(np.prod(shape, dtype=np.int64))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


HELD_BYTES = 16 << 20


class ShardedDataset(Dataset):
    """One split of a shard folder as a map-style dataset (module doc).

    Sample ``i`` is a tuple of tensors, one per field, in the order of the
    fields' names (the index is canonical JSON: ``x`` before ``y``). The folder is
    checked (sizes and headers, :func:`check_shards`) when the dataset is made.
    """

    def __init__(self, folder: str | Path, split: str) -> None:
        self.folder = Path(folder)
        index, headers = _checked(self.folder, hashes=False)
        if split not in index["splits"]:
            raise ShardError(
                f"{self.folder / INDEX}: no split {split!r} (it has {sorted(index['splits'])})"
            )
        entry = index["splits"][split]
        self.fields = list(entry["fields"])
        self._specs = [
            (np.dtype(spec["dtype"]), tuple(spec["shape"])) for spec in entry["fields"].values()
        ]
        self._files = [[s["files"][f]["name"] for f in self.fields] for s in entry["shards"]]
        self._headers = [[headers[name] for name in names] for names in self._files]
        self._widths = [dtype.itemsize * _rows(shape) for dtype, shape in self._specs]
        counts = [s["samples"] for s in entry["shards"]]
        self._starts = np.cumsum([0, *counts]).tolist()
        self._samples = self._starts[-1]
        small = [
            field for field, width in enumerate(self._widths) if width * self._samples <= HELD_BYTES
        ]
        self._read = [field for field in range(len(self.fields)) if field not in small]
        self._held_fields = small
        self._pid: int | None = None
        self._plans: dict[int, list[tuple[int, int]]] = {}
        self._forget_held()

    @property
    def held(self) -> list[str]:
        """Names of the held fields: read into memory a shard at a time, not streamed."""
        return [self.fields[field] for field in self._held_fields]

    def _forget_held(self) -> None:
        """Empty held arrays, filled a shard at a time as this process opens it."""
        self._held = {
            field: np.empty((self._samples, *self._specs[field][1]), self._specs[field][0])
            for field in self._held_fields
        }

    def __len__(self) -> int:
        return self._samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[torch.Tensor, ...]]:
        """Samples ``indices``, as ``[self[i] for i in indices]`` (a DataLoader calls this
        with a whole batch). Each read field's rows go straight into one array, a run of
        consecutive samples of a shard by one call; held fields are gathered from memory."""
        indices = [int(index) for index in indices]
        if indices and (min(indices) < 0 or max(indices) >= self._samples):
            bad = next(i for i in indices if not 0 <= i < self._samples)
            raise IndexError(f"sample {bad} of {self._samples}")
        starts, plans = self._starts, self._process_plans()
        shards = [bisect.bisect_right(starts, index) - 1 for index in indices]
        for shard in set(shards).difference(plans):
            self._open(shard)
        arrays = [np.empty((len(indices), *shape), dtype) for dtype, shape in self._specs]
        for field in self._read:
            self._read_field(field, indices, shards, arrays[field])
        if self._held:
            where = np.asarray(indices, dtype=np.int64)
            for field, values in self._held.items():
                np.take(values, where, axis=0, out=arrays[field])
        columns = [torch.from_numpy(array).unbind(0) for array in arrays]
        return list(zip(*columns, strict=True))

    def _read_field(
        self, field: int, indices: list[int], shards: list[int], array: np.ndarray
    ) -> None:
        """One field's rows of ``indices`` (in ``shards``) into ``array``: a ``preadv`` per
        run of consecutive samples of one shard (runs of one in a shuffled order)."""
        width, starts, plans = self._widths[field], self._starts, self._plans
        buffer = memoryview(array.reshape(-1).view(np.uint8))
        position, count = 0, len(indices)
        while position < count:
            first, shard, end = indices[position], shards[position], position + 1
            while end < count and indices[end] == first + end - position and shards[end] == shard:
                end += 1
            fd, start = plans[shard][field]
            target = buffer[position * width : end * width]
            if os.preadv(fd, [target], start + (first - starts[shard]) * width) != len(target):
                self._short(shard, field)
            position = end

    def _open(self, shard: int) -> None:
        """Open a shard's files in this process (its plan: ``(fd, where rows start)`` by
        field) and read its rows of the held fields."""
        files = [os.open(self.folder / name, os.O_RDONLY) for name in self._files[shard]]
        plan = self._plans[shard] = list(zip(files, self._headers[shard], strict=True))
        for field, values in self._held.items():
            rows = values[self._starts[shard] : self._starts[shard + 1]]
            target = memoryview(rows.reshape(-1).view(np.uint8))
            if os.preadv(plan[field][0], [target], plan[field][1]) != len(target):
                self._short(shard, field)

    def _short(self, shard: int, field: int) -> None:
        name = self._files[shard][field]
        raise ShardError(f"{self.folder / name}: shorter than {INDEX} says; restore it")

    def _process_plans(self) -> dict[int, list[tuple[int, int]]]:
        """This process's read plans by shard (``_open``; a forked worker opens its own)."""
        if self._pid != os.getpid():
            self._pid, self._plans = os.getpid(), {}
        return self._plans

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_pid": None, "_plans": {}, "_held": {}}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._forget_held()

    def __del__(self) -> None:
        if getattr(self, "_pid", None) == os.getpid():
            for plan in self._plans.values():
                for fd, _ in plan:
                    with contextlib.suppress(OSError):
                        os.close(fd)
