"""A measurement in a fresh Python process, read back from the last line it prints as JSON.

What a process reads once, when it starts (the CPU profile's variables, the cuBLAS
workspace, OpenBLAS's core type, a fork server, a DDP rank's launch), makes a figure
only in a process of its own: the benchmark reruns itself (or a one-line ``-c``)
with a hidden flag, the child prints its result last, and :func:`run_json` reads it.
A child that fails stops the benchmark with the end of its output, not with a
traceback of the parent. Standard library only: the steps of ``gpu/gpu_evidence.py``
run these on a bare GPU host.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterable, Mapping
from typing import Any

#: How much of a failed child's output its error keeps (its traceback's end).
TAIL_LINES = 20


def child_env(drop: Iterable[str] = (), **add: str) -> dict[str, str]:
    """This process's environment without the variables ``drop`` names, with ``add`` set:
    a variable exported in the shell cannot leak into a child that sets its own."""
    dropped = set(drop)
    return {**{k: v for k, v in os.environ.items() if k not in dropped}, **add}


def run_json(
    argv: Iterable[object],
    what: str,
    env: Mapping[str, str] | None = None,
    cwd: os.PathLike[str] | str | None = None,
) -> Any:
    """Run ``python ARGV`` (this interpreter) afresh; the JSON value of its last output line.

    ``env`` None: this process's environment. A nonzero exit raises :class:`SystemExit`
    with the end of the child's output, then ``what`` (the measurement that failed).
    """
    done = subprocess.run(
        [sys.executable, *map(str, argv)],
        env=None if env is None else dict(env),
        cwd=cwd,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-TAIL_LINES:])
        raise SystemExit(f"{tail}\n{what} failed (exit {done.returncode}; its output ends above)")
    return json.loads(done.stdout.strip().splitlines()[-1])
