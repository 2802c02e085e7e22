"""Two training runs compared: the same bytes, or where and why they differ.

``compare_runs`` says "identical" only when the weights and the traces are
the same bytes; otherwise it explains with the library's comparisons (first
diverging step and record, per-tensor weights, environment and run-input
differences). What it could not compare it says, with the reason: a
revision's weights missing from the DVC cache leave only the traces, and then
"identical" carries "weights not compared" and the JSON's ``weights_equal`` is
``null``.

The runs come from :mod:`reprotrain.commands._findrun` (a folder, a revision,
named files); fresh ones from :mod:`reprotrain.commands._rerun`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reprotrain.commands._findrun import RunFiles
from reprotrain.hashing import sha256_file
from reprotrain.pipeline.errors import DataError
from reprotrain.provenance.envdiff import EnvDiff, InputDiff, compare_environments, compare_inputs
from reprotrain.provenance.environment import HOST_FILE, HOST_KEY

if TYPE_CHECKING:  # torch and Lightning load only when two runs differ (verify stays fast)
    from reprotrain.compare.report import ComparisonReport
    from reprotrain.trace.tracefile import Trace


def _json(path: Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise DataError(f"{path}: unreadable JSON ({err})") from None
    return data if isinstance(data, dict) else {}


def _with_host(path: Path | None) -> dict[str, Any]:
    """An environment record with the host facts beside it (``host.json``), shown, not deciding."""
    record = _json(path)
    host = path.with_name(HOST_FILE) if path is not None else None
    if record and HOST_KEY not in record and host is not None and host.is_file():
        record[HOST_KEY] = _json(host)
    return record


def _trace(path: Path | None) -> Trace | None:
    from reprotrain.trace.tracefile import load_trace

    if path is None:
        return None
    try:
        return load_trace(path)
    except ValueError as err:
        raise DataError(str(err)) from None


@dataclass(frozen=True)
class RunComparison:
    """Two runs: identical bytes or not, and the library's report explaining the difference."""

    a: RunFiles
    b: RunFiles
    hashes: dict[str, tuple[str, str]]
    inputs: list[InputDiff]
    environment: list[EnvDiff]
    #: Traces and weights compared; only when the bytes differ or a plot was asked for.
    report: ComparisonReport | None = None
    run_ids: tuple[str | None, str | None] = (None, None)
    notes: list[str] = field(default_factory=list)
    #: What a run holds but could not be compared, and why; said on the "identical" line.
    not_compared: list[str] = field(default_factory=list)
    #: The first differing op, from op recordings of the first diverging step (ops.align).
    ops: dict[str, Any] | None = None
    ops_text: str | None = None

    @property
    def identical(self) -> bool:
        return bool(self.hashes) and all(a == b for a, b in self.hashes.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "a": self.a.label,
            "b": self.b.label,
            "identical": self.identical,
            "run_ids": list(self.run_ids),
            "sha256": {name: list(pair) for name, pair in self.hashes.items()},
            "notes": [*self.notes, *self.not_compared],
            "trace": None,
            "weights": [],
            "environment": [{**asdict(d), "voids": d.voids} for d in self.environment],
            "inputs": [asdict(d) for d in self.inputs],
            "guarantee_applies": not any(d.voids for d in self.environment),
            "ops": self.ops,
            **(self.report.to_dict() if self.report else {}),
            "weights_equal": self.weights_equal,
        }

    @property
    def weights_equal(self) -> bool | None:
        """The final weights: the same values (bits), or ``None`` when they were not compared."""
        if "model" not in self.hashes:
            return None
        a, b = self.hashes["model"]
        if a == b:
            return True
        weights = self.report.weights if self.report is not None else []
        return bool(weights) and all(d.equal for d in weights)  # only the metadata may differ

    def to_text(self) -> str:
        lines = [f"a: {self.a.label}", f"b: {self.b.label}"]
        if self.run_ids[0] or self.run_ids[1]:
            same = "same run ID" if self.run_ids[0] == self.run_ids[1] else "different run IDs"
            ids = " vs ".join(str(r)[:12] for r in self.run_ids)
            lines.append(f"run IDs: {ids} ({same})")
        lines += [f"note: {note}" for note in self.notes]
        if self.identical:  # the verdict line itself says what it did not compare
            compared = ", ".join(f"{name} {a[:12]}" for name, (a, _) in self.hashes.items())
            lines.append("; ".join([f"IDENTICAL: the same bits ({compared})", *self.not_compared]))
            return "\n".join(lines)
        lines += [f"note: {note}" for note in self.not_compared]
        unequal = [name for name, (a, b) in self.hashes.items() if a != b]
        lines.append(f"DIFFERENT: {', '.join(unequal)} differ")
        if self.report is not None:
            lines.append(self.report.to_text())
        if self.ops_text:
            lines.append(self.ops_text)
        return "\n".join(lines)


def with_op_diff(result: RunComparison, a: Path, b: Path, matched: str = "") -> RunComparison:
    """``result`` with opdiff's answer for the recordings ``a`` and ``b`` (imports torch).

    ``matched`` is added to the text when the recordings are identical.
    """
    from reprotrain.ops.align import OpRecordError, compare_recordings

    try:
        found = compare_recordings(a, b)
    except OpRecordError as err:
        return dataclasses.replace(result, ops_text=f"op recordings: {err}")
    from reprotrain.trace.diff import with_op_diagnosis

    text = found.to_text() + (matched if found.identical else "")
    report = result.report
    if report is not None and report.trace is not None:  # one diagnosis, the op recording's
        trace = with_op_diagnosis(report.trace, found.to_dict())
        report = dataclasses.replace(report, trace=trace)
    return dataclasses.replace(result, report=report, ops=found.to_dict(), ops_text=text)


def compare_runs(a: RunFiles, b: RunFiles, plot: Path | None = None) -> RunComparison:
    """Compare two runs' bytes; load and explain traces and weights only when they differ."""
    hashes, notes, not_compared = {}, [], []
    unread = "; ".join(dict.fromkeys(r.unread["model"] for r in (a, b) if "model" in r.unread))
    if a.model and b.model:
        hashes["model"] = (sha256_file(a.model), sha256_file(b.model))
    elif a.model or b.model:
        why = f" ({unread})" if unread else ""
        notes.append(f"only one run has weights: no weights comparison{why}")
    elif unread:  # two trace files compare as asked; a revision's weights were asked about too
        not_compared.append(
            f"weights not compared: {unread}; `dvc fetch --all-commits` (or check the "
            "revision out and `dvc pull`) to compare them"
        )
    if a.trace and b.trace:
        hashes["trace"] = (sha256_file(a.trace), sha256_file(b.trace))
    elif a.trace or b.trace:
        notes.append("only one run has a trace: no per-step comparison")
    else:
        notes.append("neither run has a trace: no per-step comparison")
    if not hashes:
        raise DataError(
            f"{a.label} and {b.label} hold nothing to compare with each other (weights against "
            "a trace?): give two weights files, two traces, or two run folders"
        )
    record_a, record_b = _json(a.record), _json(b.record)
    env_a, env_b = _with_host(a.environment), _with_host(b.environment)
    inputs = compare_inputs(record_a.get("inputs", {}), record_b.get("inputs", {}))
    environment = compare_environments(env_a, env_b) if env_a and env_b else []
    differ = any(x != y for x, y in hashes.values())
    report = None
    if differ or plot is not None:
        report = _explain(a, b, inputs, environment, differ, plot)
        weights = report.weights
        model_bytes_differ = len(set(hashes.get("model", ()))) == 2
        if weights and all(d.equal for d in weights) and model_bytes_differ:
            notes.append("the weights are the same bits; the model files differ in metadata only")
    run_ids = (record_a.get("run_id"), record_b.get("run_id"))
    return RunComparison(a, b, hashes, inputs, environment, report, run_ids, notes, not_compared)


def _explain(
    a: RunFiles,
    b: RunFiles,
    inputs: list[InputDiff],
    environment: list[EnvDiff],
    differ: bool,
    plot: Path | None,
) -> ComparisonReport:
    """The library's comparison of traces and weights (imports torch), and the loss plot."""
    from reprotrain.compare.report import ComparisonReport
    from reprotrain.compare.weights import compare_weights
    from reprotrain.hashing import load_safetensors
    from reprotrain.trace.diff import compare_traces, plot_losses

    trace_a, trace_b = _trace(a.trace), _trace(b.trace)
    if plot is not None and trace_a and trace_b:
        plot_losses(trace_a, trace_b, plot, labels=("a", "b"))
    weights = []
    if differ and a.model and b.model:
        weights = compare_weights(load_safetensors(a.model)[0], load_safetensors(b.model)[0])
    return ComparisonReport(
        trace=compare_traces(trace_a, trace_b) if trace_a and trace_b and differ else None,
        weights=weights,
        environment=environment,
        inputs=inputs,
    )
