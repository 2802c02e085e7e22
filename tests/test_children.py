"""A command's child processes stop with it, and a closed output pipe is not a verdict.

``reprotrain verify -- CMD`` killed by SIGTERM (a CI job's timeout) stops the
runs it started, grandchildren included, removes its temporary folder and
exits 130, as Ctrl-C does; ``verify ... | head -1`` exits with the verdict's
code. The scripts are plain Python (no torch), so each test takes seconds.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from reprotrain.commands._children import run_child
from tests.helpers import cli_env, start_cli

#: Writes its own and its child's PIDs, then sleeps: a run that only ends when stopped.
SLEEPER = """
import subprocess, sys, time
from pathlib import Path
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
Path(sys.argv[1], "pids").write_text(f"{__import__('os').getpid()} {child.pid}")
time.sleep(300)
"""

#: Writes a file; its bytes differ between runs when DIFFER is set.
WRITER = """
import os, sys
for line in range(50):
    print(f"progress {line}", flush=True)
index = os.environ["REPROTRAIN_RUN_INDEX"] if os.environ.get("DIFFER") else "0"
open(os.path.join(sys.argv[1], "out.txt"), "w").write(index)
"""


def _wait_for(path: Path, process: subprocess.Popen) -> str:
    for _ in range(600):
        if path.is_file() and path.read_text():
            return path.read_text()
        assert process.poll() is None, "verify ended before its run started"
        time.sleep(0.1)
    raise AssertionError(f"{path} never appeared")


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _verify_then_signal(tmp_path: Path, number: int) -> tuple[int, list[int], Path]:
    """Start verify on the sleeper, send ``number`` once its run is up; rc, run PIDs, tmp."""
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {**cli_env(), "TMPDIR": str(temp)}
    argv = ["verify", "--", sys.executable, str(tmp_path / "sleeper.py"), "{out}"]
    process = subprocess.Popen(
        [sys.executable, "-m", "reprotrain", *argv],
        cwd=tmp_path,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    pids_file = next(iter(_run_folders(temp, process))) / "pids"
    pids = [int(pid) for pid in _wait_for(pids_file, process).split()]
    process.send_signal(number)
    _, stderr = process.communicate(timeout=60)
    assert "Traceback" not in stderr, stderr
    return process.returncode, pids, temp


def _run_folders(temp: Path, process: subprocess.Popen) -> list[Path]:
    for _ in range(600):
        if found := sorted(temp.glob("reprotrain-verify-*/run-0")):
            return found
        assert process.poll() is None, "verify ended before its run started"
        time.sleep(0.1)
    raise AssertionError(f"no run folder under {temp}")


def test_sigterm_stops_verifys_runs_and_removes_its_temporary_folder(tmp_path: Path) -> None:
    code, pids, temp = _verify_then_signal(tmp_path, signal.SIGTERM)
    assert code == 130
    time.sleep(0.5)
    assert [pid for pid in pids if _alive(pid)] == []  # the run and what it started
    assert list(temp.iterdir()) == []


def test_sigint_to_verify_alone_stops_its_runs_too(tmp_path: Path) -> None:
    # `kill -INT` reaches only verify (a terminal's Ctrl-C reaches its process group,
    # and the runs have their own): verify stops them
    code, pids, temp = _verify_then_signal(tmp_path, signal.SIGINT)
    assert code == 130
    time.sleep(0.5)
    assert [pid for pid in pids if _alive(pid)] == []
    assert list(temp.iterdir()) == []


def test_an_interrupted_child_is_stopped_with_what_it_started(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    script = SLEEPER.replace("sys.argv[1]", repr(str(tmp_path)))

    def interrupt(_number: int, _frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2, 0.2)  # until the pids are written
        try:
            while True:
                run_child([sys.executable, "-c", script])
        except KeyboardInterrupt:
            if not pids.is_file():
                raise AssertionError("interrupted before the child started") from None
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    finally:
        signal.signal(signal.SIGALRM, previous)
    started = [int(pid) for pid in pids.read_text().split()]
    time.sleep(0.5)
    assert [pid for pid in started if _alive(pid)] == []


def test_a_plain_childs_own_child_outlives_stopping_it_alone(tmp_path: Path) -> None:
    # negative control: what run_child prevents, and that _alive sees a survivor
    script = SLEEPER.replace("sys.argv[1]", repr(str(tmp_path)))
    process = subprocess.Popen([sys.executable, "-c", script])
    pids = tmp_path / "pids"
    leader, child = (int(pid) for pid in _wait_for(pids, process).split())
    process.kill()
    process.wait()
    try:
        time.sleep(0.5)
        assert not _alive(leader)
        assert _alive(child)
    finally:
        os.kill(child, signal.SIGKILL)


def _verify_into_closed_pipe(tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """verify on the writer with stdout and stderr into a pipe closed after one line."""
    (tmp_path / "writer.py").write_text(WRITER)
    argv = ["verify", "--", sys.executable, str(tmp_path / "writer.py"), "{out}"]
    process = start_cli(argv, tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    first = process.stdout.readline()  # type: ignore[union-attr]
    process.stdout.close()  # type: ignore[union-attr]
    return subprocess.CompletedProcess(argv, process.wait(timeout=120), first, "")


def test_a_closed_output_pipe_keeps_the_verdicts_exit_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)  # the verdict stays buffered till exit
    done = _verify_into_closed_pipe(tmp_path)
    assert done.stdout  # one line was read before the pipe closed
    assert done.returncode == 0  # IDENTICAL, not a traceback's 1


def test_a_closed_output_pipe_still_reports_a_difference(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DIFFER", "1")  # start_cli's environment is this process's
    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)
    done = _verify_into_closed_pipe(tmp_path)
    assert done.returncode == 4  # DIFFERS OUTSIDE TENSORS: out.txt is not a tensor file


#: Run in a terminal of its own (pty.fork): a child that reads its input, started by
#: start_child with ``stdin`` as given in argv[1] ("default" or "inherited").
READER = """\
import subprocess, sys
from reprotrain.commands._children import start_child, stop_child

stdin = {} if sys.argv[1] == "default" else {"stdin": sys.stdin}
child = [sys.executable, "-c", "import sys; print(repr(sys.stdin.read()))"]
process = start_child(child, stdout=subprocess.PIPE, text=True, **stdin)
try:
    print("read", process.communicate(timeout=3)[0].strip())
except subprocess.TimeoutExpired:
    print("stopped")
    stop_child(process, grace=1)
"""


def _in_a_terminal(stdin: str) -> str:
    """What READER prints, run as a terminal session's foreground process."""
    import pty

    pid, terminal = pty.fork()
    if pid == 0:
        os.execv(sys.executable, [sys.executable, "-c", READER, stdin])
    out = b""
    with contextlib.suppress(OSError):  # EIO: the session ended
        while chunk := os.read(terminal, 1024):
            out += chunk
    os.waitpid(pid, 0)
    return out.decode().strip().splitlines()[-1]


def test_a_child_that_reads_the_terminal_gets_end_of_input_rather_than_stopping() -> None:
    assert _in_a_terminal("default") == "read ''"


def test_a_child_given_the_terminal_as_input_stops_when_it_reads_it() -> None:
    """The control: reading the terminal from a group of its own stops the child (SIGTTIN)."""
    assert _in_a_terminal("inherited") == "stopped"
