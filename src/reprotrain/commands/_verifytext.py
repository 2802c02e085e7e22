"""``verify -- CMD``'s verdict as text: the verdict, what differs file by file, down to the op.

:func:`verify_text` prints the report ``verify_script`` builds (the same report
``--json`` prints): each differing file's summary and its first rows, the
trace's first diverging step, and the op recording's culprit with the step it
was recorded at and why that step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from reprotrain.compare.files import FileVerdict


def _step_origin(report: dict[str, Any]) -> str:
    """Where the recorded step came from, when not from the default."""
    step, first = report["ops_step"], report.get("trace_step")
    if report["ops_step_from"] == "trace":
        return " (where the traces first differ)"
    if report["ops_step_from"] == "--ops-step":
        apart = f"; the traces first differ at step {first}" if first not in (None, step) else ""
        return f" (--ops-step {step}{apart})"
    return ""


#: Rows of a file's differences printed before "and N more".
ROWS = 8


def _binary_by_bytes(verdict: FileVerdict) -> bool:
    """A differing binary file of a kind not read as tensors (a pickle): it may hold some."""
    return verdict.status == "bytes" and not verdict.detail.startswith("text, ")


def verify_text(report: dict[str, Any], verdicts: list[FileVerdict], workdir: Path | None) -> str:
    """The verdict, what differs and where the runs are (``workdir`` None: removed)."""
    verdict = report["verdict"]
    if verdict == "IDENTICAL":
        lines = [
            f"reprotrain verify: IDENTICAL: {report['runs']} runs, {', '.join(report['outputs'])}"
        ]
        lines += [f"  {v.summary()}" for v in verdicts if v.detail]
        if workdir is not None:
            lines.append(f"  runs kept in {workdir}")
        return "\n".join(lines)
    lines = [f"reprotrain verify: {verdict}: {report['command']}"]
    if verdict == "DIFFERS OUTSIDE TENSORS":
        lines.append(
            "  no tensor read differs; these files differ outside tensors, or by their bytes "
            "where they are not read as tensors (safetensors, torch, NumPy files are):"
            if any(_binary_by_bytes(v) for v in verdicts)
            else "  every tensor is equal; these files differ outside tensors:"
        )
    for v in verdicts:
        if v.identical:
            continue
        lines.append(f"  {v.summary()}")
        rows = v.detail_lines()
        lines += [f"    {row}" for row in rows[:ROWS]]
        if len(rows) > ROWS:
            lines.append(f"    ... and {len(rows) - ROWS} more")
    if same := [v.name for v in verdicts if v.identical]:
        lines.append(f"  identical: {', '.join(same)}")
    if "trace" in report:
        lines += [f"  {line}" for line in report["trace"].splitlines()]
    if "ops_error" in report:
        lines.append(f"  {report['ops_error']}")
    if "ops" in report:
        lines.append(f"  ops of step {report['ops_step']}{_step_origin(report)}:")
        lines += [f"    {line}" for line in report["ops"].splitlines()]
    lines.append(f"  runs kept in {workdir}")
    return "\n".join(lines)
