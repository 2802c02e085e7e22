"""``reprotrain verify -- CMD``: prove any training command repeats its bits, or say where not.

Runs CMD ``--runs`` times, each in a fresh process started like ``reprotrain
run`` does (hash seed, cuBLAS workspace, optional CPU profile) with its own
scratch folder: ``{out}`` in CMD is replaced by it and ``REPROTRAIN_OUT``
names it; ``REPROTRAIN_RUN_INDEX`` is the run's number. The files the user
names with ``--output`` (default: every file the run wrote there) are
compared by sha256. On a difference it goes down a level at a time:

1. per tensor, for safetensors weights (:mod:`reprotrain.weightdiff`);
2. the first diverging step, when a trace (:class:`~reprotrain.trace.TraceCallback`)
   is among the outputs (:mod:`reprotrain.tracediff`);
3. the first diverging op: runs 0 and 1 again with ``REPROTRAIN_RECORD_OPS``
   set to that step (``--ops-step`` when there is no trace; default 0), which
   :class:`~reprotrain.oprecord.OpRecorder` and
   :func:`~reprotrain.oprecord.record_step` read, and aligns the two
   recordings (:mod:`reprotrain.opalign`).

Exit 0 identical; 1 different (the scratch folders are kept); 2 bad input
(no command, a run that failed: its log is named).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from reprotrain.commands._rundiff import OPS_FOLDER
from reprotrain.commands.run import command_of, launch_environment
from reprotrain.hashing import (
    canonical_json,
    load_safetensors,
    sha256_file,
)
from reprotrain.opalign import OpRecordError, compare_recordings
from reprotrain.oprecord import DIR_VARIABLE, WINDOW_VARIABLE
from reprotrain.pipeline.errors import DataError
from reprotrain.tracediff import compare_traces
from reprotrain.tracefile import is_trace_file, load_trace
from reprotrain.weightdiff import compare_weights

EXIT_DIFFERENT = 1


def _start(cmd: list[str], folder: Path, index: int, base: dict[str, str], extra: dict) -> None:
    """Run CMD once into ``folder``; a failed run is a DataError naming its log."""
    folder.mkdir(parents=True)
    argv = [part.replace("{out}", str(folder)) for part in cmd]
    env = {**base, "REPROTRAIN_OUT": str(folder), "REPROTRAIN_RUN_INDEX": str(index), **extra}
    log = folder.with_name(f"{folder.name}.log")
    with log.open("wb") as sink:
        try:
            done = subprocess.run(argv, env=env, stdout=sink, stderr=subprocess.STDOUT, check=False)
        except OSError as err:
            raise DataError(f"{cmd[0]}: {err.strerror}; check the command after `--`") from None
    if done.returncode != 0:
        text = log.read_text(errors="replace")
        tail = text.strip().splitlines()[-1:] or ["(no output)"]
        raise DataError(
            f"run {index} of `{shlex.join(cmd)}` exited {done.returncode} ({tail[0][:200]}); "
            f"see {log}{_interpreter_hint(text, argv[0], env)}"
        )


def _interpreter_hint(log: str, program: str, env: Mapping[str, str]) -> str:
    """Where a run could not import reprotrain: which interpreter ran, and which has it."""
    if "No module named 'reprotrain'" not in log:
        return ""
    found = shutil.which(program, path=env.get("PATH")) or program
    return (
        f"; `{program}` ran as {found}, which has no reprotrain: activate the environment that "
        f"has it (`source .venv/bin/activate`) or name its interpreter, `-- {sys.executable} ...`"
    )


def _outputs(folder: Path, named: list[str]) -> list[str]:
    if named:
        return named
    return sorted(
        str(p.relative_to(folder))
        for p in folder.rglob("*")
        if p.is_file() and p.relative_to(folder).parts[0] != OPS_FOLDER
    )


def _is_trace(path: Path) -> bool:
    try:
        return is_trace_file(path)
    except (OSError, ValueError):
        return False


def _tensor_lines(a: Path, b: Path) -> list[str]:
    try:
        diffs = compare_weights(load_safetensors(a)[0], load_safetensors(b)[0])
    except (OSError, ValueError):
        return []
    return [d.to_text() for d in diffs if not d.equal]


def verify_script(args: argparse.Namespace) -> int:
    cmd = command_of(args, "verify")
    if args.runs < 2:
        raise DataError(f"--runs {args.runs}: give 2 or more runs to compare")
    base = launch_environment(args, os.environ)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="reprotrain-verify-"))
    folders = [workdir / f"run-{i}" for i in range(args.runs)]
    if taken := [f for f in folders if f.exists() or f.with_name(f"{f.name}.log").exists()]:
        raise DataError(
            f"--workdir {workdir}: {taken[0].name} is already there from an earlier verify; "
            "name an empty or new folder (verify never deletes runs)"
        )
    for index, folder in enumerate(folders):
        _start(cmd, folder, index, base, {})
    names = _outputs(folders[0], args.outputs)
    report: dict[str, Any] = {"command": shlex.join(cmd), "runs": args.runs, "outputs": names}
    differing: dict[str, list[str]] = {}
    for name in names:
        paths = [f / name for f in folders]
        if missing := [str(p) for p in paths if not p.is_file()]:
            raise DataError(f"{missing[0]}: the command did not write {name}; fix --output")
        first = sha256_file(paths[0])
        for other in paths[1:]:
            if sha256_file(other) != first:
                differing[name] = _tensor_lines(paths[0], other)
                break
    report["identical"] = not differing
    report["differing"] = differing
    if differing:
        report.update(_locate(cmd, folders, names, base, args.ops_step))
    if args.json:
        print(canonical_json(report), end="")
    else:
        print(_text(report, workdir))
    return 0 if not differing else EXIT_DIFFERENT


def _locate(
    cmd: list[str], folders: list[Path], names: list[str], base: dict, ops_step: int
) -> dict[str, Any]:
    """Down to the step (a trace among the outputs) and the op (a recording of that step)."""
    out: dict[str, Any] = {}
    step = ops_step
    traces = [n for n in names if _is_trace(folders[0] / n)]
    if traces:
        diff = compare_traces(
            load_trace(folders[0] / traces[0]), load_trace(folders[1] / traces[0])
        )
        out["trace"] = diff.to_text()
        step = diff.first_step if diff.first_step is not None else step
    out["ops_step"] = step
    recorded = [f.with_name(f"{f.name}-ops") for f in folders[:2]]
    for index, folder in enumerate(recorded):
        extra = {WINDOW_VARIABLE: str(step), DIR_VARIABLE: str(folder / OPS_FOLDER)}
        _start(cmd, folder, index, base, extra)
    ops = [folder / OPS_FOLDER for folder in recorded]
    if not all(p.is_dir() for p in ops):
        out["ops"] = (
            f"no op recording was written (step {step}): add OpRecorder() to the Trainer's "
            "callbacks, or `with record_step(model, step, optimizer):` around each step"
        )
        return out
    try:
        result = compare_recordings(ops[0], ops[1])
    except OpRecordError as err:
        out["ops"] = str(err)
        return out
    out["ops"] = result.to_text()
    if result.identical:  # e.g. a kernel that races in one pair of runs and not in another
        out["ops"] += (
            f"; the reruns matched at step {step} although the runs differed: record another "
            "step (--ops-step), or add TraceCallback so verify finds the step"
        )
    out["op"] = result.to_dict()
    return out


def _text(report: dict[str, Any], workdir: Path) -> str:
    if report["identical"]:
        files = ", ".join(report["outputs"]) or "no files"
        return f"reprotrain verify: IDENTICAL: {report['runs']} runs, {files}"
    lines = [f"reprotrain verify: NOT REPRODUCIBLE: {report['command']}"]
    for name, tensors in report["differing"].items():
        lines.append(f"  {name} differs")
        lines += [f"    {t}" for t in tensors[:8]]
    if "trace" in report:
        lines += [f"  {line}" for line in report["trace"].splitlines()]
    lines.append(f"  ops of step {report['ops_step']}:")
    lines += [f"    {line}" for line in report["ops"].splitlines()]
    lines.append(f"  runs kept in {workdir}")
    return "\n".join(lines)
