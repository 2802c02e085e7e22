"""The processes a command starts (reruns, a user's script, a clone's ``dvc repro``),
stopped with it, and output that outlives a closed pipe.

Each child runs in a process group of its own, so that stopping it reaches what
it started too (a shell's script, DataLoader workers, DDP ranks). Ctrl-C in a
terminal then reaches only this process; it stops the group (SIGTERM, then
SIGKILL after a grace period) before the command cleans up and exits 130.
:func:`stop_on_sigterm` makes SIGTERM (a CI job's timeout, ``kill``) take the
same path as Ctrl-C: before, a ``verify`` killed that way left its training
running and its temporary folder behind.

:func:`survive_closed_output`: ``reprotrain verify -- CMD | head -1`` closes
the pipe after one line; the command goes on to its verdict and exits with
its code, writing nothing more, instead of a traceback and exit 1 (which means
"different").
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any, TextIO

#: Seconds a stopped child's group has to end after SIGTERM before SIGKILL.
GRACE_SECONDS = 10.0


def start_child(argv: Sequence[str], **popen: Any) -> subprocess.Popen:
    """``subprocess.Popen(argv, **popen)`` in a process group of its own.

    A group of its own is not the terminal's foreground group, and a read from the
    terminal there stops the whole group (SIGTTIN) until it is brought to the foreground:
    a script that prompts (``input()``, a login prompt of a tracking library) would hang
    the command for good. So where this process reads a terminal and ``popen`` names no
    ``stdin``, the child reads from ``/dev/null`` instead: end of input at once.
    """
    if "stdin" not in popen and _reads_a_terminal():
        popen["stdin"] = subprocess.DEVNULL
    return subprocess.Popen(argv, process_group=0, **popen)


def _reads_a_terminal() -> bool:
    try:
        return os.isatty(sys.stdin.fileno())
    except (AttributeError, OSError, ValueError):  # no stdin, or one replaced by a non-file
        return False


def run_child(argv: Sequence[str], **popen: Any) -> subprocess.CompletedProcess:
    """``subprocess.run`` in a group of its own; interrupted, the group is stopped first."""
    with start_child(argv, **popen) as process:
        try:
            out, err = process.communicate()
        except BaseException:
            stop_child(process)
            raise
    return subprocess.CompletedProcess(list(argv), process.returncode, out, err)


def stop_child(process: subprocess.Popen, grace: float = GRACE_SECONDS) -> None:
    """Stop ``process``'s group: SIGTERM, then SIGKILL for what of it still runs after
    ``grace`` (or a second after the leader ended: a member that ignores SIGTERM)."""
    if not _signal_group(process, signal.SIGTERM):
        return
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(grace)
    if _signal_group(process, 0):  # a member still runs (the leader may have ended)
        time.sleep(min(grace, 1.0))
        _signal_group(process, signal.SIGKILL)
    process.wait()


def _signal_group(process: subprocess.Popen, number: int) -> bool:
    try:
        os.killpg(process.pid, number)  # the group outlives its leader while a member runs
    except ProcessLookupError:
        return False
    return True


@contextlib.contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """Inside, SIGTERM raises KeyboardInterrupt, as Ctrl-C does; the handler before is put
    back after (a command run in-process leaves no handler behind for Lightning to chain)."""

    def interrupt(_number: int, _frame: object) -> None:
        raise KeyboardInterrupt

    if signal.getsignal(signal.SIGTERM) is signal.SIG_IGN:  # `trap '' TERM`: left ignored
        yield
        return
    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:  # None: a handler not set from Python, which cannot be put back; the default
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


class _ClosedSafe:
    """A text stream that drops what it is given once its reader has gone."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._closed = False

    def write(self, text: str) -> int:
        self._call("write", text)
        return len(text)

    def flush(self) -> None:
        self._call("flush")

    def _call(self, name: str, *args: Any) -> None:
        if self._closed:
            return
        try:
            getattr(self._stream, name)(*args)
        except BrokenPipeError:
            self._closed = True
            # Python flushes the stream again at exit; point its descriptor at nothing
            with contextlib.suppress(OSError, ValueError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), self._stream.fileno())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextlib.contextmanager
def survive_closed_output() -> Iterator[None]:
    """stdout and stderr that drop their output once the pipe they write to is closed."""
    saved = sys.stdout, sys.stderr
    wrapped = [_ClosedSafe(stream) if stream is not None else None for stream in saved]
    sys.stdout, sys.stderr = wrapped  # type: ignore[assignment]
    try:
        yield
    finally:
        for stream in wrapped:  # what is still buffered, now: at exit it would be an error
            if stream is not None:
                stream.flush()
        sys.stdout, sys.stderr = saved
