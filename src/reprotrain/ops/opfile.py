"""The op-recording file: every aten op of chosen steps, as the op recorder writes it.

One safetensors file per rank, named by :func:`recording_path` (``ops-rank<R>.safetensors``
in the recording's folder), written atomically (without fsync: a recording is made
again by rerunning) when the window's last step ends. Four int64 tables, their
columns in :data:`COLUMNS`:

- ``ops``: one row per op, in the order they ran: the step, the phase (an index
  into :data:`PHASES`), and the op's name, module and source line (indices into
  the metadata's ``strings``).
- ``inputs``: one row per input fingerprint of an op: the op, the fingerprint's
  index, its origin (the index of the recorded op that made it, or one of
  :data:`OUTSIDE`, :data:`PYTHON_VALUE`, :data:`RNG_STATE`, :data:`LABELLED`) and
  its label (a ``strings`` index, -1 for none).
- ``outputs``: one row per output of an op: the op and the fingerprint's index.
- ``fingerprints``: the int64 values the other tables point into.

The metadata (:data:`METADATA`) is packed in one key as canonical JSON, so equal
recordings give equal bytes. :func:`load_recordings` reads a file or a folder of
them into :class:`LoadedRecording` s, one per rank.

Guarantee: what :func:`write_recording` writes, :func:`load_recording` reads back
as the same tables; a file that is not a recording, a damaged one and one of a
newer format raise :class:`OpRecordError`, one line naming the file. This module
imports no Lightning and no ``torch._dynamo``, so tools that only read
recordings (``reprotrain opdiff``, ``compare``, ``verify``) start fast.
Limits: a version 1 file loads, but its fingerprints (:mod:`reprotrain.fingerprint`
on the CPU too) do not compare with version 2's; :mod:`reprotrain.ops.align` refuses that pair.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.numpy
import torch

from reprotrain.atomic import atomic_write_bytes
from reprotrain.hashing import load_safetensors, safetensors_metadata

__all__ = [
    "COLUMNS",
    "LoadedRecording",
    "OpRecordError",
    "load_recording",
    "load_recordings",
    "recording_path",
    "write_recording",
]

FORMAT = "reprotrain-ops"
VERSION = 2  # 2: CPU tensors fingerprinted by CRC-32 (1: reprotrain.fingerprint everywhere)
#: How fingerprints are computed, by the tensor's device (the file's ``hash``; the text
#: files carry: "devicehash" is :mod:`reprotrain.fingerprint`'s former name).
HASH = "crc32 on cpu, devicehash elsewhere"
#: Each table's columns, in the file's order; ``fingerprints`` is one column.
COLUMNS = {
    "ops": ("step", "phase", "op", "module", "line"),
    "inputs": ("op", "fingerprint", "origin", "label"),
    "outputs": ("op", "fingerprint"),
}
FINGERPRINTS = "fingerprints"
METADATA = ("format", "version", "rank", "world_size", "steps", "model", "strings", "torch",
            "hash")  # fmt: skip
PHASES = ("forward", "backward", "optimizer")
#: Origins of an input no recorded op produced (a producer op's index is >= 0).
OUTSIDE, PYTHON_VALUE, RNG_STATE, LABELLED = -1, -2, -3, -4
#: Ops whose output holds whatever the memory held: recorded by shape, and opdiff blames
#: the op that reads such an output unwritten.
ALLOCATING = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})


def holds_unwritten_memory(op: str) -> bool:
    """Whether op ``aten.<name>.<overload>``'s output is memory no recorded op wrote.

    Allocating ops, and ``set_`` onto a storage: a deep copy of a tensor (torchmetrics
    copies each metric state's default, Lightning makes one for every ``self.log``
    name) sets an empty tensor onto a fresh storage and fills that storage afterwards,
    outside the dispatcher, so at the ``set_`` its bytes are whatever the memory held.
    """
    _, name, overload = [*op.split("."), "", ""][:3]
    return name in ALLOCATING or (name == "set_" and overload.startswith("source_Storage"))


#: How ``reprotrain verify`` asks a recorder in another process for steps ("3" or "3-5")
#: and names the folder it writes to.
WINDOW_VARIABLE = "REPROTRAIN_RECORD_OPS"
DIR_VARIABLE = "REPROTRAIN_OPS_DIR"
DEFAULT_DIR = "ops"
_PREFIX, _SUFFIX = "ops-rank", ".safetensors"
_RANK_FILE = re.compile(rf"^{re.escape(_PREFIX)}(\d+){re.escape(_SUFFIX)}$")


class OpRecordError(ValueError):
    """A file that cannot be compared as an op recording; the message is one line."""


def recording_dir(out: str | Path | None = None) -> Path:
    """The folder recordings go to: ``out``, else ``REPROTRAIN_OPS_DIR``, else ``ops``."""
    return Path(out if out is not None else os.environ.get(DIR_VARIABLE, DEFAULT_DIR))


def recording_path(folder: str | Path, rank: int) -> Path:
    """The file one rank's recording is written to in ``folder``."""
    return Path(folder) / f"{_PREFIX}{rank}{_SUFFIX}"


def parse_window(text: str) -> tuple[int, int]:
    """``"3"`` -> (3, 3); ``"3-5"`` -> (3, 5). ValueError names the variable on bad text."""
    first, _, last = text.strip().partition("-")
    try:
        window = (int(first), int(last or first))
    except ValueError:
        raise ValueError(f"{WINDOW_VARIABLE}={text!r}: give a step or FIRST-LAST") from None
    if window[0] < 0 or window[1] < window[0]:
        raise ValueError(f"{WINDOW_VARIABLE}={text!r}: give 0 <= FIRST <= LAST")
    return window


def window_from_env(steps: tuple[int, int] | None) -> tuple[int, int] | None:
    """``steps`` when given, else the window :data:`WINDOW_VARIABLE` names (None: unset)."""
    if steps is not None:
        return steps
    text = os.environ.get(WINDOW_VARIABLE)
    return None if not text else parse_window(text)


def write_recording(
    path: str | Path,
    tables: dict[str, Sequence[tuple[int, ...]]],
    fingerprints: Sequence[int],
    *,
    rank: int,
    world_size: int,
    steps: list[int],
    model: str,
    strings: list[str],
) -> None:
    """Write one rank's recording: ``tables`` holds the rows of each of :data:`COLUMNS`."""
    arrays = {
        name: np.array(tables[name], dtype=np.int64).reshape(-1, len(columns))
        for name, columns in COLUMNS.items()
    }
    arrays[FINGERPRINTS] = np.array(fingerprints, dtype=np.int64)
    metadata = {
        "format": FORMAT,
        "version": VERSION,
        "rank": rank,
        "world_size": world_size,
        "steps": steps,
        "model": model,
        "strings": strings,
        "torch": torch.__version__,
        "hash": HASH,
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    data = safetensors.numpy.save(arrays, metadata=safetensors_metadata(metadata))
    atomic_write_bytes(path, data, sync=False)


@dataclass(frozen=True)
class LoadedRecording:
    """One rank's recording as read from its file: the tables as arrays, and the metadata."""

    path: Path
    meta: dict[str, Any]
    ops: np.ndarray
    inputs: np.ndarray
    outputs: np.ndarray
    values: np.ndarray

    def text(self, index: int) -> str:
        return self.meta["strings"][index] if index >= 0 else "-"

    def op(self, i: int) -> dict[str, Any]:
        step, phase, name, module, line = (int(x) for x in self.ops[i])
        return {
            "index": i,
            "step": step,
            "phase": PHASES[phase],
            "op": self.text(name),
            "module": self.text(module),
            "line": self.text(line),
        }

    def _rows(self, table: np.ndarray, i: int) -> np.ndarray:
        lo, hi = np.searchsorted(table[:, 0], [i, i + 1])
        return table[lo:hi]

    def op_inputs(self, i: int) -> np.ndarray:
        return self._rows(self.inputs, i)

    def op_outputs(self, i: int) -> np.ndarray:
        return self.values[self._rows(self.outputs, i)[:, 1]]


def load_recording(path: str | Path) -> LoadedRecording:
    """One recording file; OpRecordError (one line) for anything else."""
    from safetensors import SafetensorError

    try:
        tensors, meta = load_safetensors(path)
    except (OSError, SafetensorError, ValueError) as err:
        detail = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise OpRecordError(
            f"{path}: not a readable op recording ({detail}); pass a file OpRecorder wrote"
        ) from None
    if meta.get("format") != FORMAT or set(tensors) != {*COLUMNS, FINGERPRINTS}:
        raise OpRecordError(f"{path}: not an op recording; pass a file OpRecorder wrote")
    for key in ("version", "rank"):
        if not isinstance(meta.get(key, 0), int):
            raise OpRecordError(f"{path}: metadata {key!r} is damaged; record the run again")
    if meta.get("version", 0) > VERSION:
        raise OpRecordError(
            f"{path}: recorded by a newer reprotrain (format version {meta['version']}, this "
            f"one reads {VERSION}); upgrade reprotrain to compare it"
        )
    arrays = {k: v.numpy() for k, v in tensors.items()}
    for name, columns in COLUMNS.items():
        if arrays[name].ndim != 2 or arrays[name].shape[1] != len(columns):
            raise OpRecordError(f"{path}: column {name!r} is damaged; record the run again")
    if damaged := _out_of_range(meta, arrays):
        raise OpRecordError(f"{path}: {damaged} is damaged; record the run again")
    return LoadedRecording(path, meta, arrays["ops"], arrays["inputs"], arrays["outputs"],
                           arrays[FINGERPRINTS])  # fmt: skip


def _out_of_range(meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> str | None:
    """The first table column (or metadata key) whose indices point nowhere; None if none."""
    strings = meta.get("strings")
    if not isinstance(strings, list) or not all(isinstance(s, str) for s in strings):
        return "metadata 'strings'"
    ops, values = len(arrays["ops"]), len(arrays[FINGERPRINTS])
    bounds = {  # (table, column): the lowest and the highest index allowed
        ("ops", "phase"): (0, len(PHASES) - 1),
        **{("ops", c): (-1, len(strings) - 1) for c in ("op", "module", "line")},
        ("inputs", "op"): (0, ops - 1),
        ("inputs", "fingerprint"): (0, values - 1),
        ("inputs", "origin"): (LABELLED, ops - 1),
        ("inputs", "label"): (-1, len(strings) - 1),
        ("outputs", "op"): (0, ops - 1),
        ("outputs", "fingerprint"): (0, values - 1),
    }
    for (table, column), (low, high) in bounds.items():
        cells = arrays[table][:, COLUMNS[table].index(column)]
        if cells.size and (cells.min() < low or cells.max() > high):
            return f"column {table}.{column}"
    return None


def _rank_files(folder: Path) -> dict[int, Path]:
    """rank -> recording file in ``folder`` (none where it is not a folder)."""
    if not folder.is_dir():
        return {}
    return {int(m.group(1)): p for p in folder.iterdir() if (m := _RANK_FILE.match(p.name))}


def load_recordings(where: str | Path) -> dict[int, LoadedRecording]:
    """rank -> recording, from one file or a folder of the files :func:`recording_path` names."""
    path = Path(where)
    if path.is_dir() and not _rank_files(path) and _rank_files(path / "ops"):
        path = path / "ops"  # a run folder: `verify` keeps the recordings in RUN-ops/ops
    if path.is_dir():
        files = _rank_files(path)
        if not files:
            raise OpRecordError(
                f"{path}: no {_PREFIX}<R>{_SUFFIX} here or in its ops/ folder; pass a recording "
                "file, or the folder an OpRecorder or `reprotrain verify` wrote them to"
            )
    elif path.is_file():
        files = {-1: path}
    else:
        raise OpRecordError(f"{path}: not found; pass an op recording or its folder")
    recordings = {rank: load_recording(p) for rank, p in sorted(files.items())}
    return {int(r.meta.get("rank", 0)): r for r in recordings.values()}
