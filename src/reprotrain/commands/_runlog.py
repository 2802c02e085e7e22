"""A failed run's log read back: the one line that says why it failed, and what to do.

``verify -- CMD`` keeps each run's output in a log; when a run fails, its error
line is :func:`failure_line` (the last traceback's final line, else a line
naming an exception, else Hydra's message above its hint);
:func:`explained_alert` gives torch's no-deterministic-kernel error as
``configure_determinism`` explains it (the op, where, the choices), also for a
script that set torch's flag itself; :func:`interpreter_hint` names the
interpreter that ran where it could not import reprotrain.
"""

from __future__ import annotations

import re
import shutil
import sys
from collections.abc import Mapping

from reprotrain.determinism import (
    EXPLAINED_PREFIX,
    NONDETERMINISTIC_ALERT,
    explain_nondeterministic_error,
)


def explained_alert(log: str) -> str | None:
    """A failed run's explanation of torch's no-deterministic-kernel error, or None.

    The line ``configure_determinism``'s hook printed; for a script that set torch's
    flag itself, the same text made from the traceback (the innermost frame outside
    installed packages is the caller).
    """
    lines = log.splitlines()
    printed = [line for line in lines if line.startswith(EXPLAINED_PREFIX)]
    if printed:
        return printed[-1].removeprefix(EXPLAINED_PREFIX)
    error = failure_line(log)
    if NONDETERMINISTIC_ALERT not in error:
        return None
    frames = [m.groups() for m in _FRAME.finditer(log)]
    own = [f"{path}:{line}" for path, line in frames if not _INSTALLED.search(path)]
    explained = explain_nondeterministic_error(RuntimeError(error.partition(": ")[2] or error),
                                               own[-1] if own else None)  # fmt: skip
    return str(explained) if explained else None


_FRAME = re.compile(r'^  File "([^"]+)", line (\d+)', re.MULTILINE)
_INSTALLED = re.compile(r"[/\\](?:site|dist)-packages[/\\]|^<")


def interpreter_hint(log: str, program: str, env: Mapping[str, str]) -> str:
    """Where a run could not import reprotrain: which interpreter ran, and which has it."""
    if "No module named 'reprotrain'" not in log:
        return ""
    found = shutil.which(program, path=env.get("PATH")) or program
    return (
        f"; `{program}` ran as {found}, which has no reprotrain: activate the environment that "
        f"has it (`source .venv/bin/activate`) or name its interpreter, `-- {sys.executable} ...`"
    )


#: Hydra's last line after any error; the error is the paragraph above it.
HYDRA_HINT = "Set the environment variable HYDRA_FULL_ERROR=1"


def failure_line(log: str) -> str:
    """A failed run's error: the last traceback's final line, else a line naming an exception,
    else (Hydra's own errors: an override it could not apply) Hydra's message above its hint."""
    lines = [line.rstrip() for line in log.splitlines()]
    if hint := [i for i, line in enumerate(lines) if line.startswith(HYDRA_HINT)]:
        lines = lines[: hint[-1]]
        if hydra := _hydra_message(lines):
            return hydra
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call")]
    if starts:
        after = lines[starts[-1] + 1 :]
        # the frames are indented; the exception is the first line that is not
        found = next((line for line in after if line and not line[0].isspace()), None)
        if found:
            return found
    named = next((line for line in lines if _EXCEPTION.search(line)), None)
    return named or next((line for line in reversed(lines) if line.strip()), "(no output)")


def _hydra_message(lines: list[str]) -> str | None:
    """The paragraph above Hydra's hint, its unindented lines joined; None if it is a traceback
    (then its last line is the error, as for any run)."""
    while lines and not lines[-1].strip():
        lines = lines[:-1]
    start = max((i + 1 for i, line in enumerate(lines) if not line.strip()), default=0)
    block = lines[start:]
    if not block or any(line.startswith("Traceback (most") for line in lines):
        return None
    return " ".join(line.strip() for line in block if line and not line[0].isspace())


_EXCEPTION = re.compile(r"\b(?:[A-Z]\w*)?(?:Error|Exception)\b")
