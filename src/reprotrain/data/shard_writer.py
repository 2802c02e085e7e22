"""Shard folders (:mod:`reprotrain.data.shards`, the format) written a chunk at a time.

:class:`ShardWriter` writes the format a chunk at a time, so a dataset never
has to fit in memory to be written: full shards as they fill, each file's
size and sha256 counted while it is written (never read back), then the
index. The folder appears whole (written beside it, then renamed) or not at
all. :func:`write_shards` writes splits already in memory.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from reprotrain.data.shards import FORMAT, INDEX, shard_name
from reprotrain.hashing import canonical_json


class _HashingWriter:
    """A binary file's ``write`` that also counts and hashes the bytes (no reading back)."""

    def __init__(self, handle: Any) -> None:
        self.handle, self.size, self._digest = handle, 0, hashlib.sha256()

    def write(self, data: bytes | memoryview) -> int:
        self._digest.update(data)
        self.size += len(memoryview(data).cast("B"))
        return self.handle.write(data)

    def hexdigest(self) -> str:
        return self._digest.hexdigest()


class ShardWriter:
    """Write a shard folder a chunk at a time (module doc).

    ``add(split, {field: array})`` appends samples (every field the same count
    along the first axis, the same dtype and trailing shape on every call);
    full shards of ``samples_per_shard`` are written as they fill. ``close()``
    writes the last shards and the index, then renames the folder into place
    (a folder already there is replaced). Used as a context manager, an
    exception leaves the previous folder as it was.
    """

    def __init__(
        self, folder: str | Path, samples_per_shard: int, meta: Mapping[str, Any] | None = None
    ) -> None:
        if samples_per_shard < 1:
            raise ValueError(f"samples_per_shard must be >= 1, got {samples_per_shard}")
        self.folder = Path(folder)
        self.samples_per_shard = samples_per_shard
        self.meta = dict(meta or {})
        self.folder.parent.mkdir(parents=True, exist_ok=True)
        self._work = Path(
            tempfile.mkdtemp(prefix=f".{self.folder.name}.tmp-", dir=self.folder.parent)
        )
        self._splits: dict[str, dict[str, Any]] = {}
        self._pending: dict[str, dict[str, list[np.ndarray]]] = {}

    def add(self, split: str, arrays: Mapping[str, np.ndarray]) -> None:
        arrays = {field: np.ascontiguousarray(a) for field, a in arrays.items()}
        counts = {len(a) for a in arrays.values()}
        if len(counts) != 1:
            raise ValueError(f"split {split!r}: fields differ in sample count ({counts})")
        entry = self._splits.setdefault(
            split,
            {
                "samples": 0,
                "fields": {
                    f: {"dtype": a.dtype.str, "shape": list(a.shape[1:])} for f, a in arrays.items()
                },
                "shards": [],
            },
        )
        for field, array in arrays.items():
            spec = entry["fields"].get(field)
            if spec is None or (array.dtype.str, list(array.shape[1:])) != (
                spec["dtype"],
                spec["shape"],
            ):
                raise ValueError(f"split {split!r}, field {field!r}: dtype or shape changed")
        pending = self._pending.setdefault(split, {f: [] for f in arrays})
        for field, array in arrays.items():
            pending[field].append(array)
        while self._pending_count(split) >= self.samples_per_shard:
            self._flush(split, self.samples_per_shard)

    def _pending_count(self, split: str) -> int:
        return sum(len(a) for a in next(iter(self._pending[split].values())))

    def _flush(self, split: str, count: int) -> None:
        entry, pending = self._splits[split], self._pending[split]
        shard = {"samples": count, "files": {}}
        for field, chunks in pending.items():
            joined = np.concatenate(chunks) if len(chunks) > 1 else chunks[0]
            name = shard_name(split, len(entry["shards"]), field)
            with (self._work / name).open("wb") as handle:
                hashed = _HashingWriter(handle)
                np.lib.format.write_array(hashed, joined[:count], allow_pickle=False)
            shard["files"][field] = {
                "name": name,
                "bytes": hashed.size,
                "sha256": hashed.hexdigest(),
            }
            pending[field] = [joined[count:]] if len(joined) > count else []
        entry["shards"].append(shard)
        entry["samples"] += count

    def close(self) -> dict[str, Any]:
        """Write what is left and the index; move the folder into place; the index."""
        for split in self._splits:
            if self._pending_count(split):
                self._flush(split, self._pending_count(split))
        index = {"format": FORMAT, "meta": self.meta, "splits": self._splits}
        (self._work / INDEX).write_text(canonical_json(index), encoding="utf-8")
        for path in self._work.iterdir():
            with path.open("rb") as handle:
                os.fsync(handle.fileno())
        self._work.chmod(0o755)
        old = None
        if self.folder.exists():
            old = self.folder.with_name(f".{self.folder.name}.old-{os.getpid()}")
            self.folder.rename(old)
        self._work.rename(self.folder)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return index

    def abort(self) -> None:
        shutil.rmtree(self._work, ignore_errors=True)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, kind: object, *_: object) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()


def write_shards(
    folder: str | Path,
    splits: Mapping[str, Mapping[str, np.ndarray]],
    samples_per_shard: int,
    meta: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Write in-memory splits (``{split: {field: array}}``) as a shard folder; its index."""
    writer = ShardWriter(folder, samples_per_shard, meta)
    try:
        for split, arrays in splits.items():
            writer.add(split, arrays)
        return writer.close()
    except BaseException:
        writer.abort()
        raise
