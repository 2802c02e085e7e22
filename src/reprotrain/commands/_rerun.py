"""Train the pipeline again in fresh processes, for ``verify`` and ``noise-floor``.

Each run is the train stage's own command (as ``dvc.yaml`` writes it) in a
new interpreter writing a flat run folder (see
:mod:`reprotrain.commands._findrun`), so the determinism flags and
``CUBLAS_WORKSPACE_CONFIG`` apply before CUDA starts, exactly as under
``dvc repro``. Runs go ``jobs`` at a time (default 1): side by side they
overlap start-up, but on the 2-core build machine two trainings that each
use every core were slower together than one after the other.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from reprotrain.atomic import atomic_write_text
from reprotrain.commands._children import run_child, start_child, stop_child
from reprotrain.commands._exit_codes import ERROR_PREFIX
from reprotrain.commands._findrun import FLAT, METRICS
from reprotrain.hashing import canonical_json
from reprotrain.pipeline.command import stage_arguments
from reprotrain.pipeline.errors import DataError
from reprotrain.pipeline.stages.env import record_environment


class Workspace(NamedTuple):
    """Where fresh runs go: the train stage's arguments, a folder, this machine's record."""

    train_args: argparse.Namespace
    folder: Path
    environment: Path  # the record below, written in ``folder``, which each run trains with
    record: dict[str, Any]


@contextlib.contextmanager
def rerun_workspace(dvc_yaml: Path, folder: Path | None, command: str) -> Iterator[Workspace]:
    """Ready ``folder`` (default: a new temporary one) for fresh runs of the train stage.

    Prepares the data if it is missing and writes the environment record the
    ``env`` stage would write now (same lock), which every run trains with.
    A temporary folder is removed if the command fails; on success the
    command decides whether to keep it (verify keeps runs that differ).
    """
    train_args = stage_arguments("train", dvc_yaml)
    for data in train_args.data:
        ensure_prepared(data, command)
    temporary = folder is None
    folder = folder or Path(tempfile.mkdtemp(prefix=f"reprotrain-{command}-"))
    try:
        folder.mkdir(parents=True, exist_ok=True)
        environment = folder / FLAT["environment"]
        record = record_environment(stage_arguments("env", dvc_yaml).lock)
        atomic_write_text(environment, canonical_json(record))
        yield Workspace(train_args, folder, environment, record)
    except BaseException:
        if temporary:
            shutil.rmtree(folder, ignore_errors=True)
        raise


def ready_workdir(folder: Path, fresh: bool = False, command: str = "verify") -> Path:
    """``--workdir``: made (with its parents) if missing; a file there is refused, one line.

    ``fresh``: a folder that already holds anything is refused too, before any run
    starts, so no earlier run or record is deleted or replaced.
    """
    if folder.exists() and not folder.is_dir():
        raise DataError(f"--workdir {folder}: is a file, not a folder; name a new or empty folder")
    if fresh and folder.is_dir() and (held := sorted(p.name for p in folder.iterdir())):
        more = f" and {len(held) - 1} more" if len(held) > 1 else ""
        raise DataError(
            f"--workdir {folder}: already holds {held[0]}{more} from before; name an empty or "
            f"new folder ({command} never deletes runs)"
        )
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as err:  # a file where a parent folder goes
        raise DataError(
            f"--workdir {folder}: cannot make it ({err.strerror}: {err.filename}); "
            "name a new or empty folder"
        ) from None
    return folder


def ensure_prepared(data: Path, command: str) -> None:
    """Run ``dvc repro prepare`` if a data file (or folder) of the train stage is missing."""
    if data.exists():
        return
    print(f"reprotrain {command}: {data} missing; running `dvc repro prepare`", file=sys.stderr)
    done = run_child(["dvc", "repro", "prepare"])
    if done.returncode != 0 or not data.exists():
        raise DataError(f"{data}: `dvc repro prepare` did not produce it; fix that stage first")


def _train_command(
    train_args: argparse.Namespace, folder: Path, environment: Path, overrides: list[str]
) -> list[str]:
    argv = [
        *(item for data in train_args.data for item in ("--data", data)),
        *("--env", environment),
        *("--model", folder / FLAT["model"], "--trace", folder / FLAT["trace"]),
        *("--run-record", folder / FLAT["record"], "--metrics", folder / METRICS),
        *("--plots", folder / "plots", "--checkpoints", folder / "checkpoints"),
    ]
    if train_args.dvc_lock is not None:
        argv += ["--dvc-lock", train_args.dvc_lock]
    argv += _param_options(train_args)
    for override in overrides:
        argv += ["-S", override]
    return [sys.executable, "-m", "reprotrain", "train", *map(str, argv)]


def _param_options(train_args: argparse.Namespace) -> list[Any]:
    """The stage's own params options as its cmd gives them (``--params
    pipelines/lm/params.yaml``, ``--seed``, ``-S``), so a rerun trains the stage's recipe."""
    argv: list[Any] = ["--params", train_args.params]
    if train_args.seed is not None:
        argv += ["--seed", train_args.seed]
    if train_args.deterministic is not None:
        argv += ["--deterministic", train_args.deterministic]
    for override in train_args.overrides:
        argv += ["-S", override]
    return argv


def train_fresh(
    train_args: argparse.Namespace,
    folders: list[Path],
    environment: Path,
    overrides: list[str],
    command: str,
    jobs: int = 1,
    env: dict[str, str] | None = None,
) -> list[Path]:
    """Train once into each of ``folders``, ``jobs`` fresh processes at a time.

    ``train_args`` are the stage's arguments from ``dvc.yaml`` (its data and
    ``dvc.lock``); ``overrides`` are ``key=value`` params overrides; ``env``
    variables are added to each run's environment.
    """
    jobs = max(1, jobs)
    for start in range(0, len(folders), jobs):
        batch = folders[start : start + jobs]
        running: list[tuple[subprocess.Popen[str], _StderrRelay]] = []
        try:
            for folder in batch:
                if folder.exists():
                    shutil.rmtree(folder)
                print(f"reprotrain {command}: training {folder.name}", file=sys.stderr, flush=True)
                argv = _train_command(train_args, folder, environment, overrides)
                # A run's summary goes to stderr: stdout is for the command's result (--json).
                extra = None if env is None else {**os.environ, **env}
                process = start_child(
                    argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=extra
                )
                running.append((process, _relay_stderr(process)))
            # stdout is one summary line per run; stderr goes through each run's relay thread
            outputs = [process.stdout.read() for process, _ in running]  # type: ignore[union-attr]
            for process, relay in running:
                process.wait()
                relay.join()
        except BaseException:  # Ctrl-C or SIGTERM: the runs stop with this command
            for process, _ in running:
                stop_child(process)
            raise
        for folder, (process, relay), output in zip(batch, running, outputs, strict=True):
            print(output, file=sys.stderr, end="")
            if process.returncode != 0:
                raise DataError(_failure(folder, process.returncode, relay.errors))
            shutil.copy2(environment, folder / FLAT["environment"])
    return folders


class _StderrRelay(threading.Thread):
    """Passes a run's stderr through as it comes, keeping back its own error lines."""

    def __init__(self, stream: Any) -> None:
        super().__init__(daemon=True)
        self.stream = stream
        self.errors: list[str] = []

    def run(self) -> None:
        for line in self.stream:
            if line.startswith(ERROR_PREFIX):
                self.errors.append(line.removeprefix(ERROR_PREFIX).strip())
            else:
                print(line, file=sys.stderr, end="", flush=True)


def _relay_stderr(process: subprocess.Popen[str]) -> _StderrRelay:
    relay = _StderrRelay(process.stderr)
    relay.start()
    return relay


def _failure(folder: Path, code: int, errors: list[str]) -> str:
    """The run's own error line as this command's one line (a refusal: bad input), or where
    to look."""
    if errors:
        return f"{errors[-1]} (the run for {folder.name}, exit {code})"
    return f"training for {folder} failed (exit {code}); see above"
