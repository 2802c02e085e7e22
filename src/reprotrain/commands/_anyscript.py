"""``reprotrain verify -- CMD``: prove any training command repeats its bits, or say where not.

Runs CMD ``--runs`` times, each in a fresh process started like ``reprotrain
run`` does (hash seed, cuBLAS workspace, optional CPU profile) with its own
scratch folder: ``{out}`` in CMD is replaced by its absolute path and
``REPROTRAIN_OUT`` names it; ``REPROTRAIN_RUN_INDEX`` is the run's number; a
line on stderr says when each run starts and how long it took. The files the
user names with ``--output`` (each once; a folder: every file any run wrote under
it; default: every file any run wrote there) each get a verdict from
:func:`reprotrain.compare.files.compare_files` (tensors, checkpoints, any other
file by bytes with the run's folder as ``{out}``);
every other run is compared with run 0. When a tensor differs it goes down a level at a time:

1. which tensors differ, by how much (a trace's fingerprints: which differ);
2. the first diverging step, when a trace (:class:`~reprotrain.trace.callback.TraceCallback`)
   is among the outputs (:mod:`reprotrain.trace.diff`);
3. the first diverging op: runs 0 and 1 again with ``REPROTRAIN_RECORD_OPS``
   set to a step (``--ops-step`` when given, else the trace's step, else 0), which
   :class:`~reprotrain.ops.recorder.OpRecorder` and
   :func:`~reprotrain.ops.recorder.record_step` read, and aligns the two
   recordings (:mod:`reprotrain.ops.align`). A rerun that fails leaves the verdict
   as it is, with one line saying the op was not named: the rerun's error, its log.
   Recordings that match although the runs differed get advice that offers only
   what was not done (another step than the one given, a trace where none is).

Exit codes (:data:`EXIT_CODES`), worst file first: 1 NOT REPRODUCIBLE (a
tensor differs; the scratch folders are kept); 5 UNREADABLE (a file cannot be
read as its kind, named with the reader's error); 4 DIFFERS OUTSIDE TENSORS
(every tensor equal; a log, a config or a checkpoint's other field differs);
0 IDENTICAL. 2 bad input, one line: no command; an option that only the
pipeline's runs take; a run that failed (its error line and its log); a
command that wrote nothing under ``{out}``; an ``--output`` a run did not write
(or a folder with no file in it), or one that is not a relative path inside the
run's folder; a compared file that is a link resolving outside its run's folder
(not that run's output: another file's bytes would be judged); a ``--workdir``
that is a file, or that holds an earlier verify's runs, whatever their number
(the line names them and how to delete them).

A verify that ends with no verdict removes what it made (the temporary folder;
in ``--workdir`` the run folders, logs and folders it created, never what was
there before), so the same command can be run again, unless a failed run left
something to look at: its log, or files in its folder, which the error line names.
Output is printed as stdout can encode it: a file name's bytes that are not
UTF-8 as ``\\xNN``.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path, PurePath
from typing import Any

from reprotrain.atomic import atomic_write_text
from reprotrain.commands._children import run_child
from reprotrain.commands._exit_codes import (
    EXIT_CHECK_FAILED,
    EXIT_DIFFERS_OUTSIDE_TENSORS,
    EXIT_UNREADABLE,
)
from reprotrain.commands._findrun import OPS_FOLDER
from reprotrain.commands._rerun import ready_workdir
from reprotrain.commands._runfolders import (
    VERIFIED_FILE,
    RunFailed,
    discard,
    missing_folders,
    printable,
    refuse_earlier_runs,
    refuse_links_out,
    refuse_outside_output,
)
from reprotrain.commands._runlog import explained_alert, failure_line, interpreter_hint
from reprotrain.commands._verifytext import verify_text
from reprotrain.commands.run import (
    command_of,
    launch_environment,
    launch_threads,
    launch_variables,
)
from reprotrain.compare.files import FileVerdict, compare_files, one_sided
from reprotrain.hashing import canonical_json
from reprotrain.pipeline.command import DVC_YAML
from reprotrain.pipeline.errors import DataError
from reprotrain.provenance.environment import git_state
from reprotrain.trace.tracefile import is_trace_file, load_trace


def _start(
    cmd: list[str], folder: Path, index: int, base: dict[str, str], extra: dict, what: str
) -> None:
    """Run CMD once into ``folder``; a failed run is a :class:`RunFailed` naming its log."""
    folder.mkdir(parents=True)
    argv = [part.replace("{out}", str(folder)) for part in cmd]
    env = {**base, "REPROTRAIN_OUT": str(folder), "REPROTRAIN_RUN_INDEX": str(index), **extra}
    log = folder.with_name(f"{folder.name}.log")
    with log.open("wb") as sink:
        try:
            done = run_child(argv, env=env, stdout=sink, stderr=subprocess.STDOUT)
        except OSError as err:
            raise RunFailed(
                f"{cmd[0]}: {err.strerror}; check the command after `--`", log, folder
            ) from None
    if done.returncode != 0:
        text = log.read_text(errors="replace")
        head = f"{what} {index} of `{shlex.join(cmd)}` exited {done.returncode}"
        if explained := explained_alert(text):  # the whole line: op, where, choices
            raise RunFailed(f"{head}: {explained}", log, folder)
        if not text.strip():
            raise RunFailed(f"{head} and printed nothing", log, folder)
        hint = interpreter_hint(text, argv[0], env)
        raise RunFailed(f"{head} ({failure_line(text)[:200]})", log, folder, hint)


def _outputs(folders: list[Path], named: list[str]) -> tuple[list[str], set[str]]:
    """The files to compare, and those of them each run must have written (named files).

    Without names: every file any run wrote (a log named by its pid is in one). A named
    folder stands for every file any run wrote under it, at any depth, as with no names.
    """
    if not named:
        return _files_under(folders, ""), set()
    names: dict[str, None] = {}  # in the order named, each once
    for name in named:
        paths = [folder / name for folder in folders]
        if any(p.is_file() for p in paths) or not any(p.is_dir() for p in paths):
            names[name] = None
            continue
        if not (found := _files_under(folders, name)):
            raise DataError(
                f"--output {name}: a folder with no file in it in any run, so nothing was "
                "compared; name a folder the command writes files in, or the files themselves"
            )
        names.update(dict.fromkeys(found))
    return list(names), {name for name in named if name in names}


def _files_under(folders: list[Path], under: str) -> list[str]:
    """Every file any run wrote under ``under`` (``""``: its whole folder, less op recordings)."""
    return sorted(
        {
            str(p.relative_to(folder))
            for folder in folders
            for p in (folder / under).rglob("*")
            if p.is_file() and (under or p.relative_to(folder).parts[0] != OPS_FOLDER)
        }
    )


def _is_trace(path: Path) -> bool:
    try:
        return is_trace_file(path)
    except (OSError, ValueError):
        return False


def refuse_pipeline_options(args: argparse.Namespace) -> None:
    """Options that set up the pipeline's own runs mean nothing to a command: one line, exit 2."""
    given = {
        "--jobs": args.jobs != 1,
        "-S": bool(args.overrides),
        "--against": args.against is not None,
        "--world-sizes": args.world_sizes is not None,
        "--reference": args.reference is not None,
        "--dvc-yaml": args.dvc_yaml != DVC_YAML,
    }
    if named := [flag for flag, on in given.items() if on]:
        raise DataError(
            f"{', '.join(named)}: not with `-- CMD` (they set up the pipeline's own runs); "
            "drop them, or pass the command's own options after `--`"
        )


def _timed_start(
    cmd: list[str], folder: Path, index: int, base: dict[str, str], extra: dict, what: str
) -> None:
    """``_start``, with a line when the run starts and one when it ends (stderr: --json stays)."""
    began = time.monotonic()
    print(
        f"reprotrain verify: {what} {index} started at {time.strftime('%H:%M:%S')} ({folder})",
        file=sys.stderr,
        flush=True,
    )
    _start(cmd, folder, index, base, extra, what)
    print(
        f"reprotrain verify: {what} {index} finished in {time.monotonic() - began:.1f} s",
        file=sys.stderr,
        flush=True,
    )


def verify_script(args: argparse.Namespace) -> int:
    cmd = command_of(args, "verify")
    refuse_pipeline_options(args)
    if args.runs < 2:
        raise DataError(f"--runs {args.runs}: give 2 or more runs to compare")
    for name in args.outputs:
        refuse_outside_output(name)
    # each file once, in the order named: `--output a --output ./a` compares (and prints) a once
    outputs = list(dict.fromkeys(str(PurePath(name)) for name in args.outputs))
    base = launch_environment(args, os.environ)
    # absolute: {out} and REPROTRAIN_OUT must name the folder wherever the command cd's to
    if args.workdir is not None:
        workdir = args.workdir.absolute()
        made = missing_folders(workdir)
        ready_workdir(args.workdir)
        refuse_earlier_runs(args.workdir, workdir)
    else:
        workdir = Path(tempfile.mkdtemp(prefix="reprotrain-verify-")).absolute()
        made = [workdir]
    folders = [workdir / f"run-{i}" for i in range(args.runs)]
    try:
        for index, folder in enumerate(folders):
            _timed_start(cmd, folder, index, base, {}, "run")
        names, required = _outputs(folders, outputs)
        if not names:
            raise DataError(
                f"`{shlex.join(cmd)}` wrote nothing under {{out}} ({folders[0]}), so nothing was "
                "compared: pass {out} to it as its output folder (Hydra: hydra.run.dir={out})"
            )
        verdicts = [_worst_verdict(name, folders, name in required) for name in names]
    except BaseException as err:  # removed unless it left something to look at; re-raised
        if not (isinstance(err, RunFailed) and err.evidence is not None):
            discard(workdir, args.runs, made, temporary=args.workdir is None)
        raise
    verdict = overall_verdict(verdicts)
    differing = [v for v in verdicts if not v.identical]
    kept = verdict != "IDENTICAL" or args.workdir is not None
    report: dict[str, Any] = {
        "command": shlex.join(cmd),
        "runs": args.runs,
        "outputs": names,
        "verdict": verdict,
        "identical": verdict == "IDENTICAL",
        "files": [v.to_dict() for v in verdicts],
        "differing": {v.name: v.detail_lines() or [v.summary()] for v in differing},
        "workdir": str(workdir) if kept else None,
    }
    if verdict == "NOT REPRODUCIBLE":
        readable = [v.name for v in verdicts if v.status != "unreadable"]
        report.update(_locate(cmd, folders, readable, base, args.ops_step))
    if args.json:
        print(canonical_json(printable(report)), end="")
    else:
        print(printable(verify_text(report, verdicts, workdir if kept else None)))
    if not kept:  # a temporary folder of runs that proved identical: nothing left to look at
        shutil.rmtree(workdir, ignore_errors=True)
    elif verdict == "IDENTICAL":  # what `reprotrain attest --verified` states of these runs
        facts = {"command": cmd, "cwd": str(Path.cwd()), "runs": args.runs, "outputs": names}
        facts["launch"] = launch_variables(args.cpu_profile, launch_threads(args))
        facts["commit"] = git_state(Path.cwd())["commit"]
        atomic_write_text(workdir / VERIFIED_FILE, canonical_json(printable(facts, "utf-8")))
    return EXIT_CODES[verdict]


def _worst_verdict(name: str, folders: list[Path], named: bool) -> FileVerdict:
    """``name`` in every run against run 0; the worst verdict of those comparisons. A file
    ``named`` with ``--output`` that a run did not write is bad input, not a verdict."""
    paths = [f / name for f in folders]
    refuse_links_out(name, paths, folders)
    if missing := [i for i, p in enumerate(paths) if not p.is_file()]:
        if named:
            raise DataError(f"{paths[missing[0]]}: the command did not write {name}; fix --output")
        present = next(p for p in paths if p.is_file())
        return one_sided(name, present, ", ".join(f"run {i}" for i in missing))
    pairs = zip(paths[1:], folders[1:], strict=True)
    found = [compare_files(name, paths[0], path, (folders[0], folder)) for path, folder in pairs]
    return min(found, key=lambda v: STATUS_RANK.index(v.status))


#: File statuses, worst first; the worst of all files decides the verdict.
STATUS_RANK = ("tensors", "unreadable", "fields", "bytes", "identical")
#: Verdict -> exit code. 2 (bad input) and 3 (determinism) are the CLI's own.
EXIT_CODES = {
    "IDENTICAL": 0,
    "NOT REPRODUCIBLE": EXIT_CHECK_FAILED,
    "DIFFERS OUTSIDE TENSORS": EXIT_DIFFERS_OUTSIDE_TENSORS,
    "UNREADABLE": EXIT_UNREADABLE,
}


def overall_verdict(verdicts: list[FileVerdict]) -> str:
    """NOT REPRODUCIBLE if a tensor differs; else UNREADABLE; else DIFFERS OUTSIDE TENSORS."""
    statuses = {v.status for v in verdicts}
    if "tensors" in statuses:
        return "NOT REPRODUCIBLE"
    if "unreadable" in statuses:
        return "UNREADABLE"
    if statuses & {"fields", "bytes"}:
        return "DIFFERS OUTSIDE TENSORS"
    return "IDENTICAL"


def _locate(
    cmd: list[str], folders: list[Path], names: list[str], base: dict, ops_step: int | None
) -> dict[str, Any]:
    """Down to the step and the op (a recording of that step). The step is ``ops_step`` when
    given (None: not given), else the first diverging step of a trace among the outputs,
    else 0; ``ops_step_from`` says which."""
    # torch and Lightning: only when a tensor differs
    from reprotrain.ops.align import OpRecordError, compare_recordings
    from reprotrain.ops.opfile import DIR_VARIABLE, WINDOW_VARIABLE
    from reprotrain.trace.diff import compare_traces, with_op_diagnosis

    out: dict[str, Any] = {}
    diff = None
    traces = [n for n in names if _is_trace(folders[0] / n)]
    if traces:
        from safetensors import SafetensorError

        try:
            loaded = [load_trace(folder / traces[0]) for folder in folders[:2]]
        except (OSError, ValueError, KeyError, SafetensorError) as err:
            out["trace"] = f"{traces[0]}: not readable as a trace ({err}); no step found"
        else:
            diff = compare_traces(*loaded)
            out["trace"] = diff.to_text()
    first = diff.first_step if diff is not None else None
    if first is not None:
        out["trace_step"] = first
    if ops_step is not None:  # the user's step wins; the header says where the traces part
        step, out["ops_step_from"] = ops_step, "--ops-step"
    elif first is not None:
        step, out["ops_step_from"] = first, "trace"
    else:
        step, out["ops_step_from"] = 0, "default"
    out["ops_step"] = step
    recorded = [f.with_name(f"{f.name}-ops") for f in folders[:2]]
    for index, folder in enumerate(recorded):
        extra = {WINDOW_VARIABLE: str(step), DIR_VARIABLE: str(folder / OPS_FOLDER)}
        try:
            _timed_start(cmd, folder, index, base, extra, "ops rerun")
        except RunFailed as err:  # the runs' verdict stands; only the op is not named
            where = "" if err.evidence is not None else f"; see {err.log}"
            out["ops_error"] = f"op-level diagnosis not made (step {step}): {err}{where}"
            return out
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
        traced = None if not traces else "unreadable" if diff is None else "read"
        out["ops"] += _when_ops_match(step, out["ops_step_from"], traced, first)
    out["op"] = result.to_dict()
    if diff is not None and step == first:  # one diagnosis: the op recording's, where it found
        out["trace"] = with_op_diagnosis(diff, out["op"]).to_text()  # the cause at that step
    return out


def _when_ops_match(step: int, source: str, traced: str | None, first: int | None) -> str:
    """What to try when the recorded step matched although the runs differed: only what the
    user has not done. ``source``: where the step came from (``ops_step_from``); ``traced``:
    None without a trace among the outputs, else ``read`` or ``unreadable``; ``first``: the
    traces' first diverging step."""
    known = f"; the reruns matched at step {step} although the runs differed"
    if traced == "read" and first is None:
        known += " (the traces match, so they name no step)"
    elif traced == "unreadable":
        known += " (the trace could not be read, so it names no step)"
    tries = ["run verify again"]
    if first is not None and first != step:  # only with --ops-step
        tries.append(f"record step {first}, where the traces first differ (drop --ops-step)")
    elif source == "--ops-step":
        tries.append(f"record another step than {step} (another --ops-step)")
    elif source == "default":
        tries.append("record another step (--ops-step N)")
    if traced is None:
        tries.append("add TraceCallback so verify finds the step")
    either = " or ".join(tries) if len(tries) < 3 else f"{', '.join(tries[:-1])}, or {tries[-1]}"
    return f"{known}; a race or unwritten memory may have agreed this time: {either}"
