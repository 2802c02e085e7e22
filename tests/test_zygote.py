"""The test suite's warm interpreter (src/reprotrain/_zygote.py): a restart it serves is the
requested process in everything a command sees, ends as the child ends, and never outlives
its requester; a DDP rank that Lightning's launcher starts is served too. Negative control:
without ``REPROTRAIN_ZYGOTE`` the restart is an exec (the same process id)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from reprotrain._zygote import VARIABLE
from reprotrain.determinism import CUBLAS_DETERMINISTIC_CONFIGS
from tests.helpers import ROOT

#: Restarts as a reprotrain command does, then reports what it sees and does what it is told.
SCRIPT = """
import json, os, sys, time
from reprotrain.determinism import reexec_with_fixed_hash_seed
before = os.getpid()
reexec_with_fixed_hash_seed({"OMP_NUM_THREADS": "1"})
print(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "argv": sys.argv[1:],
                  "cwd": os.getcwd(), "seen": os.environ.get("SEEN"), "stdin": sys.stdin.read(),
                  "hash_seed": sys.flags.hash_randomization, "main": __name__}), flush=True)
print("to stderr", file=sys.stderr)
if "--sleep" in sys.argv:
    time.sleep(60)
sys.exit(int(sys.argv[1]))
"""

#: What a DDP rank that Lightning's launcher started does first (reprotrain's CLI does it):
#: it inherits the fixed variables, so it needs no restart, yet imports what a restart would.
RANK_SCRIPT = """
import json, os, sys
from reprotrain import _zygote
_zygote.hand_over_rank()
print(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "argv": sys.argv[1:]}), flush=True)
"""


def _environment(folder: Path | None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONHASHSEED", VARIABLE)}
    env["PYTHONPATH"] = str(ROOT / "src")  # the same for every request: one server
    if folder is not None:
        env[VARIABLE] = str(folder)
    return {**env, **extra}


def _start(script: Path, folder: Path | None, *args: str, **extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(script), *args],
        cwd=script.parent,
        env=_environment(folder, **extra),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _run(script: Path, folder: Path | None, *args: str, **extra: str) -> tuple[int, dict, str]:
    proc = _start(script, folder, *args, **extra)
    out, err = proc.communicate("from the requester", timeout=120)
    return proc.returncode, json.loads(out.splitlines()[0]), err


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """The script, and a zygote folder whose server for it is up (started by two requests)."""
    script = tmp_path / "work" / "restarts.py"
    script.parent.mkdir()
    script.write_text(SCRIPT)
    folder = tmp_path / "z"
    first = _run(script, folder, "0")[1]  # seen: an exec
    second = _run(script, folder, "0")[1]  # starts the server, waits for it, is served
    assert first["ppid"] == os.getpid(), first  # the requester itself, after its exec
    servers = [int(p.read_text()) for p in folder.glob("*.pid")]
    assert second["ppid"] in servers, (second, servers)
    deadline = time.monotonic() + 120
    while not list(folder.glob("*.pid")) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert list(folder.glob("*.pid")), [p.read_text() for p in folder.glob("*.log")]
    yield script, folder
    for pid_file in folder.glob("*.pid"):
        os.kill(int(pid_file.read_text()), signal.SIGTERM)


def test_a_served_restart_sees_what_the_exec_would_and_ends_as_the_child(served) -> None:
    script, folder = served
    server = int(next(folder.glob("*.pid")).read_text())
    code, seen, err = _run(script, folder, "3", "x y", SEEN="request")
    assert code == 3 and "to stderr" in err
    assert seen["ppid"] == server  # served: a child of the warm interpreter
    assert seen["argv"] == ["3", "x y"] and seen["cwd"] == str(script.parent)
    assert seen["seen"] == "request" and seen["stdin"] == "from the requester"
    assert seen["hash_seed"] == 0 and seen["main"] == "__main__"
    # Negative control: without the folder the restart is an exec, in the same process.
    proc = _start(script, None, "0")
    out, _ = proc.communicate("", timeout=120)
    assert json.loads(out.splitlines()[0])["pid"] == proc.pid


def test_a_launched_rank_is_served_and_asks_no_further(served) -> None:
    script, folder = served
    rank = script.with_name("rank.py")
    rank.write_text(RANK_SCRIPT)
    server = int(next(folder.glob("*.pid")).read_text())
    fixed = {"PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
    fixed["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_DETERMINISTIC_CONFIGS[0]  # as the restart sets
    code, seen, _ = _run(rank, folder, "r", LOCAL_RANK="1", **fixed)
    assert code == 0 and seen["ppid"] == server and seen["argv"] == ["r"]
    # Negative control: local rank 0, the launcher's own process, runs where it started.
    proc = _start(rank, folder, "r", LOCAL_RANK="0", **fixed)
    out, _ = proc.communicate("", timeout=120)
    assert proc.returncode == 0 and json.loads(out.splitlines()[0])["pid"] == proc.pid


def test_a_signal_to_the_requester_ends_the_child_and_a_killed_requester_takes_it_along(
    served,
) -> None:
    script, folder = served
    for number in (signal.SIGTERM, signal.SIGKILL):
        proc = _start(script, folder, "0", "--sleep")
        proc.stdin.close()
        child = json.loads(proc.stdout.readline())["pid"]
        assert child != proc.pid
        proc.send_signal(number)
        assert proc.wait(timeout=60) == -number
        deadline = time.monotonic() + 30
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(child), f"child {child} outlived its requester ({number!r})"
        proc.stdout.close()
        proc.stderr.close()


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return status != "Z"
