"""Align two op recordings from separate processes or machines and name the first culprit.

Two recordings (:mod:`reprotrain.ops.recorder`, read by :mod:`reprotrain.ops.opfile`)
of the same steps are walked op by op, rank by rank. The first op whose inputs
or outputs differ is classified:

- ``kernel``: every input equal, an output differs: the op itself is not
  deterministic here or runs another code path (thread count, ISA dispatch,
  atomics); the culprit is this op, at its module and source line.
- ``inputs``: an input differs that no earlier recorded op made: a parameter
  (weights from an earlier step or a checkpoint), the batch (data order,
  augmentation, worker seeding), optimizer state, the RNG state before a
  random op, a Python value passed to the op, or a tensor made outside torch
  ops (NumPy, Python lists). A Python value passed at this op puts the cause
  at this op's line; every other input was made upstream of the op.
- ``order``: the input was made by a recorded op whose output matched, but not
  by the same op in both runs: the same values consumed in another order
  (Python set or dict iteration under another hash seed).
- ``sequence``: the call sequences part (an extra or missing op, another
  branch); both sides' ops at that point are named.

Past the first difference, every op whose inputs are shown equal and whose
output differs is counted by name (``kernels``), up to where the call sequences
part (an op whose input already differed says nothing about its kernel, nor
does one downstream of any difference: the count is conservative, and an op
reading unwritten memory is not counted). Between two CPUs this names the
kernels that split them beyond the first (docs/cpu-profile.md).

Recordings of different models, different steps or different world sizes, a
file that is not a recording, and a newer format raise :class:`OpRecordError`
with one line naming the file.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from reprotrain.ops.opfile import (
    LABELLED,
    OUTSIDE,
    PYTHON_VALUE,
    RNG_STATE,
    LoadedRecording,
    OpRecordError,
    holds_unwritten_memory,
    load_recordings,
)

__all__ = ["OpDiff", "OpRecordError", "compare_recordings"]

_HINTS = {
    "parameter": "the weights before this step differed (an earlier step, or the checkpoint "
    "it resumed from)",
    "buffer": "a buffer differed before this step",
    "batch": "the batch differed (data order, augmentation, DataLoader worker seeding)",
    "optimizer state": "optimizer state differed before this step (resume, or an earlier step)",
}


@dataclass
class OpDiff:
    """Where two recordings first differ; ``identical`` when they never do."""

    identical: bool
    kind: str = "identical"
    diagnosis: str = "every recorded op has the same inputs and outputs"
    rank: int | None = None
    op: dict[str, Any] = field(default_factory=dict)
    other: dict[str, Any] = field(default_factory=dict)  # B's op, when the sequences part
    differing_inputs: list[str] = field(default_factory=list)
    ranks_diverging: list[int] = field(default_factory=list)
    ops_compared: int = 0
    #: Every op (by name) whose inputs agreed and whose output differed, and how often.
    kernels: dict[str, int] = field(default_factory=dict)
    #: How many ops had equal inputs and gave equal outputs (the kernels that agreed).
    kernels_agreeing: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_text(self) -> str:
        if self.identical:
            return f"op recordings identical ({self.ops_compared} ops)"
        op = self.op
        rank = "" if self.rank is None else f", rank {self.rank}"
        lines = [
            f"first differing op: {op['op']} ({op['phase']}), step {op['step']}{rank}, "
            f"op #{op['index']}",
            f"  module: {op['module']}",
            f"  source: {op['line']}"
            + (" (the forward call)" if op["phase"] == "backward" else ""),
        ]
        if self.other:
            lines.append(
                f"  B ran instead: {self.other['op']} ({self.other['phase']}) in "
                f"{self.other['module']} at {self.other['line']}"
            )
        lines.append(f"  {self.kind}: {self.diagnosis}")
        lines += [f"  differs: {text}" for text in self.differing_inputs]
        if len(self.ranks_diverging) > 1:
            lines.append(f"  ranks diverging: {', '.join(map(str, self.ranks_diverging))}")
        if self.kernels:
            counts = ", ".join(f"{op} x{n}" for op, n in sorted(self.kernels.items()))
            lines.append(
                f"  every op with equal inputs and another output: {counts} "
                f"({self.kernels_agreeing} with equal inputs gave equal outputs)"
            )
        else:
            lines.append(
                f"  no op gave another output from equal inputs ({self.kernels_agreeing} had "
                "equal inputs)"
            )
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"


def _check_pair(a: dict[int, LoadedRecording], b: dict[int, LoadedRecording]) -> None:
    ra, rb = next(iter(a.values())), next(iter(b.values()))
    what = f"{ra.path} and {rb.path}"
    if sorted(a) != sorted(b):
        raise OpRecordError(f"{what}: ranks {sorted(a)} vs {sorted(b)}; record the same world size")
    if ra.meta.get("version") != rb.meta.get("version"):
        raise OpRecordError(
            f"{what}: recorded by different reprotrain formats (version {ra.meta.get('version')} "
            f"vs {rb.meta.get('version')}), whose fingerprints do not compare; record both again "
            f"with one reprotrain"
        )
    if ra.meta.get("model") != rb.meta.get("model"):
        raise OpRecordError(
            f"{what}: different models (parameter shapes {ra.meta.get('model')} vs "
            f"{rb.meta.get('model')}); record the same model"
        )
    if ra.meta.get("steps") != rb.meta.get("steps"):
        raise OpRecordError(
            f"{what}: steps {ra.meta.get('steps')} vs {rb.meta.get('steps')}; record the same "
            f"window (REPROTRAIN_RECORD_OPS)"
        )


def _describe(rec: LoadedRecording, row: np.ndarray) -> str:
    origin, label = int(row[2]), int(row[3])
    if origin >= 0:
        producer = rec.op(origin)
        return f"output of op #{origin} {producer['op']} at {producer['line']}"
    if origin == LABELLED:
        text = rec.text(label)
        hint = next((h for k, h in _HINTS.items() if text.startswith(k)), "")
        return f"{text}: {hint}" if hint else text
    return {
        OUTSIDE: "a tensor made outside torch ops (NumPy, a Python list, torch.from_numpy, "
        "memory read before it was written)",
        PYTHON_VALUE: "a Python value passed to the op (a number, size or flag: time, the "
        "random module, set or dict order)",
        RNG_STATE: "the random generator's state before this random op (seeding, or another "
        "number of draws before it)",
    }[origin]


def _allocated(rec: LoadedRecording, row: np.ndarray) -> bool:
    """True when the input is memory no recorded op wrote (:func:`holds_unwritten_memory`)."""
    return row[2] >= 0 and holds_unwritten_memory(rec.op(int(row[2]))["op"])


def _signature(rec: LoadedRecording, i: int) -> tuple[Any, ...]:
    step, phase, name, module, _ = (int(x) for x in rec.ops[i])
    return step, phase, rec.text(name), rec.text(module)


def _inputs_diagnosis(passed_here: int, differing: int) -> str:
    """Where differing inputs come from: this op (a Python value passed to it) or before it."""
    if passed_here == differing:
        return (
            "a Python value passed to this op differs: the cause is here, at this op's source "
            "line, where that value is computed"
        )
    if passed_here:
        return (
            "a Python value passed to this op differs (the cause is at this op's source line), "
            "and so does an input made before it (upstream)"
        )
    return "the inputs already differed; the cause is upstream of this op"


def _differing_inputs(
    a: LoadedRecording, b: LoadedRecording, i: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Op ``i``'s input rows in each recording, and the positions whose fingerprints
    differ (None: the op took another number of inputs)."""
    ins_a, ins_b = a.op_inputs(i), b.op_inputs(i)
    if len(ins_a) != len(ins_b):
        return ins_a, ins_b, None
    return ins_a, ins_b, np.nonzero(a.values[ins_a[:, 1]] != b.values[ins_b[:, 1]])[0]


def _compare_rank(a: LoadedRecording, b: LoadedRecording) -> OpDiff | int:
    """The first difference in one rank's streams, or the number of ops compared."""
    n = min(len(a.ops), len(b.ops))
    for i in range(n):
        if _signature(a, i) != _signature(b, i):
            return _parted(a, b, i)
        ins_a, ins_b, differing = _differing_inputs(a, b, i)
        if differing is None:
            return _parted(a, b, i)
        if len(differing):
            order = [k for k in differing if ins_a[k, 2] >= 0 and ins_a[k, 2] != ins_b[k, 2]]
            texts = [_describe(a, ins_a[k]) for k in differing]
            if order and len(order) == len(differing):
                diagnosis = (
                    "the inputs were made by recorded ops whose outputs matched, but not by the "
                    "same ops: the same values consumed in another order (Python set or dict "
                    "iteration under another hash seed, a sort that is not stable)"
                )
                return OpDiff(False, "order", diagnosis, op=a.op(i), differing_inputs=texts)
            here = [k for k in differing if ins_a[k, 2] == PYTHON_VALUE]
            return OpDiff(False, "inputs", _inputs_diagnosis(len(here), len(differing)),
                          op=a.op(i), differing_inputs=texts)  # fmt: skip
        if not np.array_equal(a.op_outputs(i), b.op_outputs(i)):
            if unwritten := [_describe(a, row) for row in ins_a if _allocated(a, row)]:
                diagnosis = (
                    "same inputs, different output: it reads memory that was allocated and "
                    "never written (torch.empty, new_empty, empty_like without a fill; "
                    "set_ onto a storage filled outside torch ops)"
                )
                return OpDiff(False, "uninitialised", diagnosis, op=a.op(i),
                              differing_inputs=unwritten)  # fmt: skip
            diagnosis = (
                "same inputs, different output: this kernel is not deterministic here or took "
                "another code path (thread count, CPU ISA dispatch, atomics; "
                "see `reprotrain ops`)"
            )
            return OpDiff(False, "kernel", diagnosis, op=a.op(i))
    if len(a.ops) != len(b.ops):
        return _parted(a, b, n)
    return n


def _kernels(a: LoadedRecording, b: LoadedRecording) -> tuple[dict[str, int], int]:
    """Ops whose inputs all agree and whose outputs differ, by name, until the sequences
    part, and the number of ops whose inputs and outputs both agree.

    An input counts as agreeing only when its fingerprint and its producer agree and
    nothing upstream of that producer differed: views and ``set_`` are fingerprinted
    by shape, so a differing value can pass through one with an equal fingerprint.
    """
    found: dict[str, int] = {}
    agreeing = 0
    tainted = np.zeros(min(len(a.ops), len(b.ops)), dtype=bool)
    for i in range(len(tainted)):
        if _signature(a, i) != _signature(b, i):
            break
        ins_a, ins_b, differing = _differing_inputs(a, b, i)
        same = (
            differing is not None
            and not len(differing)
            and np.array_equal(ins_a[:, 2], ins_b[:, 2])
        )
        producers = ins_a[:, 2][ins_a[:, 2] >= 0]
        if not same or tainted[producers].any():
            tainted[i] = True
        elif np.array_equal(a.op_outputs(i), b.op_outputs(i)):
            agreeing += 1
        elif any(_allocated(a, row) for row in ins_a):  # unwritten memory, not the kernel
            tainted[i] = True
        else:
            tainted[i] = True
            name = a.op(i)["op"]
            found[name] = found.get(name, 0) + 1
    return found, agreeing


def _parted(a: LoadedRecording, b: LoadedRecording, i: int) -> OpDiff:
    end = {"index": i, "step": "-", "phase": "forward", "op": "(end of recording)",
           "module": "-", "line": "-"}  # fmt: skip
    op_a = a.op(i) if i < len(a.ops) else end
    op_b = b.op(i) if i < len(b.ops) else end
    diagnosis = (
        "the call sequences part here: another code path (a branch on data, time or a Python "
        "set order, another library version)"
    )
    return OpDiff(False, "sequence", diagnosis, op=op_a, other=op_b)


def compare_recordings(a: str | Path, b: str | Path) -> OpDiff:
    """Compare two recordings (files or folders of per-rank files) rank by rank."""
    ranks_a, ranks_b = load_recordings(a), load_recordings(b)
    _check_pair(ranks_a, ranks_b)
    found: list[tuple[int, OpDiff]] = []
    compared = 0
    for rank in sorted(ranks_a):
        result = _compare_rank(ranks_a[rank], ranks_b[rank])
        if isinstance(result, OpDiff):
            result.rank = rank if len(ranks_a) > 1 else None
            result.kernels, result.kernels_agreeing = _kernels(ranks_a[rank], ranks_b[rank])
            found.append((rank, result))
        else:
            compared += result
    if not found:
        return OpDiff(True, ops_compared=compared)
    first = min(found, key=lambda f: (f[1].op["step"] if f[1].op["step"] != "-" else 1 << 62, f[0]))
    first[1].ranks_diverging = [rank for rank, _ in found]
    for _, other in found:
        if other is not first[1]:
            for name, count in other.kernels.items():
                first[1].kernels[name] = first[1].kernels.get(name, 0) + count
            first[1].kernels_agreeing += other.kernels_agreeing
    return first[1]
