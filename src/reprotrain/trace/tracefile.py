"""The trace file: per-step fingerprints of a run, as ``TraceCallback`` writes them.

One safetensors file (its metadata packed in one key, so identical rows give
identical bytes): a row per training batch and rank with ``step``, ``epoch``,
``batch_idx``, ``weights_traced``, the int64 fingerprint of each record in
:data:`RECORDS`, the loss's exact bits, and with ``detail="full"`` one
fingerprint per parameter tensor and per RNG source; a trace of manual
optimization adds ``backward_losses``, every loss a step gave backward as one
int64 (:mod:`reprotrain.trace.callback`). :func:`load_trace` reads
it into a read-only :class:`Trace`. This module imports no Lightning, so tools that only read
traces (``reprotrain compare``) start fast.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from reprotrain.hashing import (
    UnreadableSafetensors,
    load_safetensors,
    read_safetensors_metadata,
)

if TYPE_CHECKING:
    import torch

Detail = Literal["default", "full"]
#: Per-row records, in the order a step computes them (and compare checks them).
RECORDS = ("batch", "rng", "loss", "grads", "params")
#: The final state's parts, in the order of the ``final_state`` columns (finalstate).
FINAL_PARTS = ("parameters", "buffers", "optimizer")
#: Version 2 added ``final_state``; version 1 files still load (without it).
FORMAT, VERSION = "reprotrain.trace", 2
READABLE_VERSIONS = (1, 2)
#: A trace file's tensors: one row per batch (required, then optional), one per rank.
_ROWS = ("step", "epoch", "batch_idx", "loss_value", "weights_traced", *RECORDS)
_OPTIONAL_ROWS = (
    *("rank", "grads_per_param", "params_per_param", "rng_per_source"),
    "backward_losses",  # manual optimization only
)
_PER_RANK = ("initial_params", "final_state")
#: Their dtypes: int64 where not named here.
_DTYPES = {"loss_value": "float64", "weights_traced": "bool"}
_METADATA = {"detail": str, "weights_every": int, "param_names": list, "rng_sources": list}


@dataclass(frozen=True)
class Trace:
    """One row per training batch, read-only numpy arrays; ``records[name]`` is int64 per row.

    ``grads`` and ``params`` (and the per-tensor columns) are 0 where ``weights_traced`` is False.
    """

    detail: Detail
    weights_every: int
    step: np.ndarray
    epoch: np.ndarray
    batch_idx: np.ndarray
    loss_value: np.ndarray
    weights_traced: np.ndarray
    records: dict[str, np.ndarray]
    initial_params: int
    param_names: tuple[str, ...]
    rng_sources: tuple[str, ...]
    grads_per_param: np.ndarray | None = None
    params_per_param: np.ndarray | None = None
    rng_per_source: np.ndarray | None = None
    #: The rank that recorded each row (all 0 in a single process); rows are in rank order.
    rank: np.ndarray | None = None
    world_size: int = 1
    initial_per_rank: tuple[int, ...] = ()
    #: Per rank: fingerprints of the final parameters, buffers and optimizer state
    #: (:data:`FINAL_PARTS`), zeros for a trace written before fit
    #: ended; empty for a version 1 file.
    final_state: tuple[tuple[int, ...], ...] = ()
    #: Manual optimization: every loss each step gave backward, as one int64 per row.
    backward_losses: np.ndarray | None = None

    @property
    def num_steps(self) -> int:
        return len(self.step)

    def of_rank(self, rank: int) -> Trace:
        """The rows one rank recorded, as a single-process trace."""
        if self.rank is None:
            return self
        rows = self.rank == rank
        arrays = {
            f.name: getattr(self, f.name)[rows]
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), np.ndarray)
        }
        records = {name: values[rows] for name, values in self.records.items()}
        initial = self.initial_per_rank[rank] if self.initial_per_rank else self.initial_params
        final = self.final_state[rank : rank + 1]
        return dataclasses.replace(
            self, **arrays, records=records, world_size=1, initial_params=initial,
            initial_per_rank=(initial,), final_state=final,
        )  # fmt: skip


def is_trace_file(path: str | Path) -> bool:
    """Whether a safetensors file names itself a trace; OSError or ValueError if unreadable."""
    return read_safetensors_metadata(path).get("format") == FORMAT


def load_trace(path: str | Path) -> Trace:
    """Read a file written by :class:`TraceCallback`; ``ValueError`` naming it if it is not one."""
    try:
        tensors, meta = load_safetensors(path)
    except UnreadableSafetensors as err:
        raise ValueError(
            f"{path}: not a readable trace file ({err}); copy it again or rerun the training "
            "that wrote it"
        ) from None
    if meta.get("format") != FORMAT or meta.get("version") not in READABLE_VERSIONS:
        raise ValueError(f"{path}: not a reprotrain trace (version {VERSION}) file")
    if problem := _damage(tensors, meta):
        raise ValueError(
            f"{path}: a damaged reprotrain trace ({problem}); rerun the training that wrote it"
        )
    arrays = {name: tensor.numpy() for name, tensor in tensors.items()}
    for values in arrays.values():
        values.flags.writeable = False
    initial = arrays.pop("initial_params")
    final = arrays.pop("final_state", np.zeros((0, 3), np.int64))
    return Trace(
        detail=meta["detail"],
        weights_every=int(meta["weights_every"]),
        records={name: arrays.pop(name) for name in RECORDS},
        initial_params=int(initial[0]),
        param_names=tuple(meta["param_names"]),
        rng_sources=tuple(meta["rng_sources"]),
        world_size=int(meta.get("world_size", 1)),
        initial_per_rank=tuple(int(v) for v in initial),
        final_state=tuple(tuple(int(v) for v in row) for row in final),
        **arrays,
    )


def _damage(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> str | None:
    """What keeps a file that names itself a trace from loading as one; None if nothing.

    Checked before any array is built, so a damaged file is one line, not a traceback.
    """
    for key, kind in _METADATA.items():
        if not isinstance(meta.get(key), kind):
            return f"metadata {key!r} missing or not a {kind.__name__}"
    if missing := [name for name in (*_ROWS, "initial_params") if name not in tensors]:
        return f"no {missing[0]!r} tensor"
    if unknown := sorted(set(tensors) - {*_ROWS, *_OPTIONAL_ROWS, *_PER_RANK}):
        return f"an unknown tensor {unknown[0]!r}"
    for name, tensor in tensors.items():
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype != _DTYPES.get(name, "int64"):
            return f"{name!r} is {dtype}, not {_DTYPES.get(name, 'int64')}"
    columns = [tensors[name] for name in (*_ROWS, *_OPTIONAL_ROWS) if name in tensors]
    if len({tuple(column.shape[:1]) for column in columns}) > 1 or columns[0].ndim == 0:
        return "per-step columns of different lengths"
    ranks = tensors["initial_params"]
    if ranks.ndim != 1 or ranks.numel() == 0:
        return "'initial_params' is not one value per rank"
    if not isinstance(meta.get("world_size", 1), int):
        return "metadata 'world_size' is not an int"
    if "final_state" in tensors and tensors["final_state"].ndim != 2:
        return "'final_state' is not one row per rank"
    rank = tensors.get("rank")
    if (
        rank is not None
        and rank.numel()
        and not 0 <= int(rank.min()) <= int(rank.max()) < len(ranks)
    ):
        return "a 'rank' with no 'initial_params' value"
    return None
