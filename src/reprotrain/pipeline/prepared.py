"""The prepared dataset: one safetensors file, or a shard folder (stage ``prepare``).

The prepared data (stage ``prepare``) is one safetensors file holding
``x_<split>`` (float32, N x C x H x W, scaled to [0, 1]) and ``y_<split>``
(int64) for the train, val and test splits, with the class count in its
metadata. safetensors orders tensors by dtype and name, so identical tensors
give identical bytes; its metadata, though, is a hash map written in
arbitrary order, so we store exactly one metadata key whose value is
canonical JSON (see :func:`reprotrain.hashing.safetensors_metadata`).
The digits recipe (:mod:`reprotrain.recipes.digits`) reads it. With
``reprotrain prepare --samples-per-shard N`` the same splits are written as a
shard folder instead (:mod:`reprotrain.data.shards`, fields ``x`` and ``y``,
the class count in the index's ``meta``), read a batch at a time, never whole
(docs/data.md); :func:`load_prepared` opens either, and both give each split
as a dataset of ``(x, y)`` pairs.

Apart from :mod:`reprotrain.pipeline.data` (the loaders), so that ``prepare``
imports no Lightning: its start-up is a second, not five.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from torch.utils.data import Dataset, TensorDataset

from reprotrain.atomic import atomic_write_safetensors
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

    def dataset(self, name: str) -> Dataset:
        """Split ``name`` as ``(x, y)`` pairs, held in memory."""
        return TensorDataset(*self.split(name))

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.tensors["x_train"].shape[1:])


@dataclass(frozen=True)
class PreparedShards:
    """A prepared shard folder: each split read from disk a batch at a time."""

    folder: Path
    num_classes: int
    source: str
    input_shape: tuple[int, ...]

    def dataset(self, name: str) -> Dataset:
        """Split ``name`` as ``(x, y)`` pairs, read from the shards as they are asked for."""
        from reprotrain.data.shards import ShardedDataset, ShardError

        try:
            return ShardedDataset(self.folder, name)
        except ShardError as err:
            raise DataError(f"{err}; or rerun `dvc repro prepare`") from None


def save_prepared(
    path: str | Path, data: PreparedData, samples_per_shard: int | None = None
) -> None:
    """Write ``data`` atomically: one safetensors file, or a shard folder of
    ``samples_per_shard`` samples per shard."""
    meta = {"num_classes": data.num_classes, "source": data.source}
    if samples_per_shard is None:
        atomic_write_safetensors(path, data.tensors, safetensors_metadata(meta))
        return
    from reprotrain.data.shard_writer import write_shards

    splits = {s: {"x": x.numpy(), "y": y.numpy()} for s in SPLITS for x, y in [data.split(s)]}
    write_shards(path, splits, samples_per_shard, meta)


def load_prepared(path: str | Path) -> PreparedData | PreparedShards:
    """Open a prepared dataset file or shard folder; :class:`DataError` names what is wrong.

    A file is read whole; a folder's index and shard headers are checked
    (:func:`~reprotrain.data.shards.check_shards`), its samples stay on disk.
    """
    path = Path(path)
    if path.is_dir():
        return _open_shards(path)
    if not path.is_file():
        raise DataError(
            f"{path}: prepared data not found; if the path is right, `dvc repro prepare` makes "
            "it, else fix the path that names it (data.init_args.path)"
        )
    try:
        tensors, metadata = load_safetensors(path)
    except (SafetensorError, OSError, ValueError) as err:
        raise DataError(f"{path}: unreadable ({err}); rerun `dvc repro prepare`") from None
    expected = {f"{axis}_{split}" for axis in "xy" for split in SPLITS}
    if set(tensors) != expected or "num_classes" not in metadata:
        raise DataError(f"{path}: not a reprotrain prepared dataset; rerun `dvc repro prepare`")
    if problem := _layout_problem(tensors, metadata["num_classes"]):
        raise DataError(f"{path}: {problem}; rerun `dvc repro prepare`")
    return PreparedData(tensors, int(metadata["num_classes"]), str(metadata.get("source", "?")))


def _layout_problem(tensors: dict[str, Any], num_classes: Any) -> str | None:
    """What makes a prepared file's tensors no dataset prepare writes, if anything: images
    N x C x H x W in floats, as many integer labels in 0..num_classes-1, a sample to train on."""
    if type(num_classes) is not int or num_classes < 1:
        return f"num_classes {num_classes!r} is not a positive integer"
    shapes = set()
    for split in SPLITS:
        x, y = tensors[f"x_{split}"], tensors[f"y_{split}"]
        if x.dim() != 4 or not x.is_floating_point() or y.dim() != 1 or y.is_floating_point():
            return f"{split}: x is {tuple(x.shape)} {x.dtype}, y {tuple(y.shape)} {y.dtype}"
        if len(x) != len(y):
            return f"{split}: {len(x)} images but {len(y)} labels"
        if len(y) and (int(y.min()) < 0 or int(y.max()) >= int(num_classes)):
            return f"{split}: labels {int(y.min())}..{int(y.max())} outside 0..{num_classes - 1}"
        shapes.add(tuple(x.shape[1:]))
    if len(shapes) > 1:
        return f"the splits' images differ in shape ({sorted(shapes)})"
    if not len(tensors["y_train"]):
        return "the train split is empty"
    return None


def _open_shards(folder: Path) -> PreparedShards:
    from reprotrain.data.shards import ShardError, check_shards

    try:
        index = check_shards(folder)
    except ShardError as err:
        raise DataError(f"{err}; or rerun `dvc repro prepare`") from None
    splits, meta = index["splits"], index.get("meta", {})
    fields = {name: set(entry["fields"]) for name, entry in splits.items()}
    if set(splits) != set(SPLITS) or any(f != {"x", "y"} for f in fields.values()):
        raise DataError(
            f"{folder}: not a reprotrain prepared shard folder (splits {sorted(splits)}, "
            "fields x and y); rerun `dvc repro prepare`"
        )
    if "num_classes" not in meta:
        raise DataError(f"{folder}: its index has no num_classes; rerun `dvc repro prepare`")
    shape = tuple(splits["train"]["fields"]["x"]["shape"])
    return PreparedShards(folder, int(meta["num_classes"]), str(meta.get("source", "?")), shape)
