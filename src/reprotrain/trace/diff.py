"""Where two traces part: the first diverging step and record, and the likely cause.

``compare_traces`` finds the first training step at which two traces (from
:class:`reprotrain.trace.callback.TraceCallback`) differ and which record differed
first there, checked in the order the step computes them: batch, RNG state,
loss, gradients, parameters. From that it names a likely cause:

* batch first: the data pipeline (order or augmentation) changed;
* RNG first: something consumed random numbers differently;
* loss or gradients first, with the same batch, RNG state and parameters
  before the step: a non-deterministic kernel in forward or backward;
* parameters first, with equal gradients: the optimizer.

The loss of a manual-optimization trace covers every loss the step gave
backward (its ``backward_losses`` column, where both traces have one). Every
record is compared as bits (int64 fingerprints, the loss's float64 bits), so
two NaN losses with the same bits are equal.

Gradients and parameters are compared on the rows both traces traced them
(``weights_every``); when a loss differs first after untraced rows, the
diagnosis names the steps a backward or optimizer cause may hide in. It is a
diagnosis from fingerprints, not a proof: where the bits first part, and the
usual reason for that place. With ``detail="full"`` traces it also names the
first parameter tensor (or RNG source) that differs.

DDP traces hold one set of rows per rank: each rank is compared on its own,
and the report names the first diverging step and, at that step, the rank
whose first differing record comes earliest in the step (a batch or loss
difference on one rank points at that rank; gradients are traced after the
all-reduce, so a backward difference shows on every rank at once and the
lowest is named). Traces of different world sizes are not compared row by row.
``plot_losses`` draws both runs' losses and their difference. Weights are
compared by :mod:`reprotrain.compare.weights`, environments and run inputs by
:mod:`reprotrain.provenance.envdiff`, and :mod:`reprotrain.compare.report` puts them together.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from reprotrain.atomic import atomic_path
from reprotrain.trace.tracefile import FINAL_PARTS, RECORDS, Trace

__all__ = ["DIAGNOSES", "TraceDiff", "compare_traces", "plot_losses", "with_op_diagnosis"]

DIAGNOSES = {
    "schedule": "training schedule differs (step, epoch or batch numbering)",
    "batch": "data pipeline: data order or augmentation changed",
    "rng": "random consumption changed: something drew random numbers differently",
    "loss": "non-deterministic kernel in the forward pass (same batch, RNG and parameters)",
    "grads": "non-deterministic kernel in the backward pass (same batch, RNG, parameters, loss)",
    "params": "optimizer: same gradients, different update",
    "length": "runs have different step counts; all common steps are identical",
    "final": "every row matched, but the state the fits ended with differs",
    "initial": "the initial weights differ (traced before step 0): the runs did not start "
    "from the same weights, so all that follows differs too: the seed (unset, or another "
    "value) or the weights each run loaded",
    "world_size": "different world sizes: each rank trained on another share of the data, and "
    "gradients were averaged over another number of ranks; the runs are not comparable step "
    "by step (the run inputs name the change)",
}
#: The order a step computes its records in; at one step the earliest names the cause.
_STEP_ORDER = ("schedule", *RECORDS, "length", "final")


@dataclass(frozen=True)
class TraceDiff:
    """Where two traces first differ; ``identical`` when they never do."""

    identical: bool
    steps_a: int
    steps_b: int
    first_step: int | None = None
    first_row: int | None = None
    record: str | None = None
    diagnosis: str = "identical"
    tensor: str | None = None
    records_differing: tuple[str, ...] = ()
    initial_params_equal: bool = True
    #: Under DDP: the rank named, the world sizes, and every rank diverging at ``first_step``.
    rank: int | None = None
    world_sizes: tuple[int, int] = (1, 1)
    ranks_at_step: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["records_differing"] = list(self.records_differing)
        out["world_sizes"] = list(self.world_sizes)
        out["ranks_at_step"] = list(self.ranks_at_step)
        return out

    def to_text(self) -> str:
        ranks = "" if self.world_sizes == (1, 1) else f", {self.world_sizes[0]} ranks"
        if self.identical:
            return f"traces identical ({self.steps_a} steps{ranks})"
        if self.record == "world_size":
            sizes = " vs ".join(map(str, self.world_sizes))
            return f"traces of world size {sizes}\n  diagnosis: {self.diagnosis}"
        where = "" if self.rank is None else f" on rank {self.rank} of {self.world_sizes[0]}"
        lines = [
            f"traces diverge at step {self.first_step}{where} (row {self.first_row}): "
            f"{self.record} differs first",
            f"  diagnosis: {self.diagnosis}",
        ]
        if len(self.ranks_at_step) > 1:
            listed = ", ".join(map(str, self.ranks_at_step))
            lines.append(f"  ranks diverging at step {self.first_step}: {listed}")
        if len(self.ranks_at_step) == self.world_sizes[0] > 1:
            lines.append(
                "  every rank diverges here: the cause may be on any of them (DDP averages "
                "gradients over all ranks, so a backward difference on one reaches every rank)"
            )
        if self.tensor:
            final = self.record == "final"  # then ``tensor`` names parts, not a tensor
            label = "final state parts differing" if final else "first differing tensor"
            lines.append(f"  {label}: {self.tensor}")
        if self.records_differing:
            lines.append(f"  differing at that step: {', '.join(self.records_differing)}")
        if self.steps_a != self.steps_b:
            lines.append(f"  step counts: {self.steps_a} vs {self.steps_b}")
        return "\n".join(lines)


def _first_column(a: np.ndarray | None, b: np.ndarray | None, row: int) -> int | None:
    if a is None or b is None or a.shape[1:] != b.shape[1:]:
        return None
    columns = np.flatnonzero(a[row] != b[row])
    return int(columns[0]) if columns.size else None


def _columns(trace: Trace, rows: int) -> dict[str, np.ndarray]:
    """Per-row values of each check, in the order a step computes them."""
    schedule = np.stack([trace.step, trace.epoch, trace.batch_idx], axis=1)
    return {"schedule": schedule[:rows], **{n: trace.records[n][:rows] for n in RECORDS}}


def _rows_differ(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    unequal = a != b
    return unequal.any(axis=1) if unequal.ndim > 1 else unequal


def _compare_final(a: Trace, b: Trace, traced: np.ndarray, base: dict[str, Any]) -> TraceDiff:
    """Every row matched: does the state the fits ended with (a version 2 trace) match too?"""
    known = a.final_state[:1] and b.final_state[:1] and any(a.final_state[0])
    if not known or a.final_state[0] == b.final_state[0] or not a.num_steps:
        return TraceDiff(identical=True, **base)
    parts = [
        p for p, x, y in zip(FINAL_PARTS, a.final_state[0], b.final_state[0], strict=True) if x != y
    ]
    last = np.flatnonzero(traced)
    row = int(last[-1]) + 1 if last.size and last[-1] + 1 < a.num_steps else a.num_steps - 1
    since, end = int(a.step[row]), int(a.step[-1])
    diagnosis = (
        f"{DIAGNOSES['final']} ({', '.join(parts)}): a divergence after the last row that "
        f"traced weights (steps {since}-{end}; weights_every={a.weights_every}), or in a "
        "buffer or the optimizer state, which the rows do not trace"
    )
    return TraceDiff(
        False, **base, first_step=since, first_row=row, record="final", diagnosis=diagnosis,
        tensor=", ".join(parts), records_differing=("final",),
    )  # fmt: skip


def _kernel_diagnosis(
    a: Trace, record: str, row: int, traced: np.ndarray, params_differ: np.ndarray, initial: bool
) -> str:
    """A kernel is to blame only if the step started from the same parameters; say if unknown."""
    diagnosis = DIAGNOSES[record]
    if row == 0 or traced[row - 1]:
        before_equal = initial if row == 0 else not params_differ[row - 1]
        if before_equal:
            return diagnosis
        return "parameters differed before this step (initialisation or loading)"
    if record == "grads":  # the same loss bits at this step vouch for the same parameters
        return diagnosis
    earlier = np.flatnonzero(traced[:row])
    since = f"step {int(a.step[earlier[-1]]) + 1}" if earlier.size else "the start"
    return (
        f"{diagnosis}; or a backward kernel or the optimizer between {since} and this step, "
        "where weights were not traced (rerun with weights_every=1 to tell)"
    )


def compare_traces(a: Trace, b: Trace) -> TraceDiff:
    """First step (and rank) and record at which ``a`` and ``b`` differ, with a likely cause."""
    sizes = (a.world_size, b.world_size)
    if sizes != (1, 1):
        return _compare_ranks(a, b)
    return _compare_rank(a, b)


def _compare_ranks(a: Trace, b: Trace) -> TraceDiff:
    sizes = (a.world_size, b.world_size)
    if sizes[0] != sizes[1]:
        return TraceDiff(
            False,
            a.num_steps,
            b.num_steps,
            record="world_size",
            diagnosis=DIAGNOSES["world_size"],
            world_sizes=sizes,
        )
    diffs = [
        replace(_compare_rank(a.of_rank(r), b.of_rank(r)), rank=r, world_sizes=sizes)
        for r in range(sizes[0])
    ]
    diverging = [d for d in diffs if not d.identical]
    if not diverging:
        return replace(diffs[0], rank=None)
    first = min(diverging, key=lambda d: (d.first_step, _STEP_ORDER.index(d.record), d.rank))
    at_step = tuple(d.rank for d in diverging if d.first_step == first.first_step)
    return replace(first, ranks_at_step=at_step)


def _compare_rank(a: Trace, b: Trace) -> TraceDiff:
    common = min(a.num_steps, b.num_steps)
    initial_equal = a.initial_params == b.initial_params
    base = {"steps_a": a.num_steps, "steps_b": b.num_steps, "initial_params_equal": initial_equal}
    cols_a, cols_b = _columns(a, common), _columns(b, common)
    if a.backward_losses is not None and b.backward_losses is not None:
        cols_a["loss"] = np.stack([cols_a["loss"], a.backward_losses[:common]], axis=1)
        cols_b["loss"] = np.stack([cols_b["loss"], b.backward_losses[:common]], axis=1)
    differs = {name: _rows_differ(cols_a[name], cols_b[name]) for name in cols_a}
    traced = a.weights_traced[:common] & b.weights_traced[:common]
    differs["grads"] &= traced  # untraced rows hold 0 in both: nothing to compare
    differs["params"] &= traced
    any_row = np.logical_or.reduce(list(differs.values()))
    if not any_row.any():
        if a.num_steps == b.num_steps:
            return _compare_final(a, b, traced, base)
        longer = a if a.num_steps > common else b
        return TraceDiff(
            False,
            **base,
            first_step=int(longer.step[common]),
            first_row=common,
            record="length",
            diagnosis=DIAGNOSES["length"],
        )
    row = int(np.argmax(any_row))
    differing = tuple(name for name, rows in differs.items() if rows[row])
    record = differing[0]
    diagnosis = DIAGNOSES[record]
    if not initial_equal:
        diagnosis = DIAGNOSES["initial"]
    elif record in ("loss", "grads"):
        diagnosis = _kernel_diagnosis(a, record, row, traced, differs["params"], initial_equal)
    tensor = None
    if record in ("grads", "params") and a.param_names == b.param_names:
        per_param = "grads_per_param" if record == "grads" else "params_per_param"
        column = _first_column(getattr(a, per_param), getattr(b, per_param), row)
        tensor = None if column is None else a.param_names[column]
    elif record == "rng" and a.rng_sources == b.rng_sources:
        column = _first_column(a.rng_per_source, b.rng_per_source, row)
        tensor = None if column is None else a.rng_sources[column]
    return TraceDiff(
        False,
        **base,
        first_step=int(a.step[row]),
        first_row=row,
        record=record,
        diagnosis=diagnosis,
        tensor=tensor,
        records_differing=differing,
    )


def with_op_diagnosis(diff: TraceDiff, op: Mapping[str, Any]) -> TraceDiff:
    """``diff`` whose diagnosis is the op recording's, where that recording found the cause.

    ``op`` is :meth:`reprotrain.ops.align.OpDiff.to_dict` for the diverging step.
    The trace can only guess from fingerprints ("a kernel", when the loss
    differs first with the same batch); the op recording sees each op's
    inputs, so where it found a differing input (a Python value, the batch,
    a parameter), another order or another code path, that is the one
    diagnosis reported. It keeps a kernel diagnosis only where the op's
    inputs were equal, and a seed diagnosis always (initial weights differ).
    """
    if diff.identical or op.get("identical", True) or not diff.initial_params_equal:
        return diff
    where = op["op"]
    found = f"{where['op']} ({where['phase']}) at {where['line']}"
    if op["kind"] == "kernel":
        return replace(diff, diagnosis=f"non-deterministic kernel: {found}; {op['diagnosis']}")
    return replace(diff, diagnosis=f"{op['diagnosis']} (op recording: first differing op {found})")


def plot_losses(a: Trace, b: Trace, path: str | Path, labels: tuple[str, str] = ("a", "b")) -> None:
    """Write a PNG: both runs' per-step loss, and b - a over their common steps."""
    # Figure + Agg canvas, not pyplot: no global backend switch, no GUI needed.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 6))
    FigureCanvasAgg(figure)
    top, bottom = figure.subplots(2, 1, sharex=True)
    for trace, label in zip((a, b), labels, strict=True):
        top.plot(trace.step, trace.loss_value, label=label, linewidth=1)
    top.set_ylabel("loss")
    top.legend()
    common = min(a.num_steps, b.num_steps)
    bottom.plot(a.step[:common], b.loss_value[:common] - a.loss_value[:common], linewidth=1)
    bottom.set_ylabel(f"loss {labels[1]} - {labels[0]}")
    bottom.set_xlabel("step")
    with atomic_path(path) as tmp:
        figure.savefig(tmp, format="png", metadata={"Software": None})
