"""A warm interpreter for the restart: the test suite's start-up, paid once instead of per process.

Every ``reprotrain`` verb that trains or configures determinism restarts itself
(:func:`reprotrain.determinism.reexec_with_fixed_hash_seed`), and the restarted
interpreter then imports torch and Lightning: about 5 s on a 2-core build host,
paid by every test that runs the command and by every stage of every ``dvc
repro`` a test starts; so does each rank that Lightning's DDP launcher starts
(:func:`hand_over_rank`). With ``REPROTRAIN_ZYGOTE`` naming a folder (the test
suite sets it; nothing else should), the restart instead asks a server in that
folder, an interpreter started with the very variables the restart would export
and with those modules imported, to fork a child that runs the command: same
arguments, variables, working directory, umask and standard streams. This
process waits for the child, forwards the stop signals it gets to the child's
process group, and ends as the child ended (its exit code, or killed by the
same signal); if this process dies, the server kills the child's group.

One server per set of start-up variables (:data:`STARTUP`: those an interpreter,
OpenMP, MKL, OpenBLAS, ATen or CUDA read when they load, and ``PYTHON*``) and
process context; the first request of a set execs as before, the second
starts its server (:mod:`reprotrain._zygote_server`) and waits for it (what
its own exec would cost), and it and later ones are served. A command line
with interpreter options (``python -X importtime -m ...``) always execs. A
server exits after ``IDLE_S`` seconds without a request. Under ``REPROTRAIN_ZYGOTE`` unset this
module is never imported.

Limits, why it is for tests only: the child is a fork of a process that
imported modules for other commands; modules that read a variable outside
:data:`STARTUP` at import see the server's value, and the child is not a
descendant of this process (signals reach it through this one; ``ps`` trees
differ). The suite's comparisons against the committed reference, made by
fresh processes, show it trains the same bits.
"""

from __future__ import annotations

import array
import contextlib
import hashlib
import json
import os
import signal
import socket
import struct
import sys
import time
from collections.abc import Mapping
from pathlib import Path

VARIABLE = "REPROTRAIN_ZYGOTE"
#: Prefixes of the variables read when an interpreter or a native library loads.
STARTUP = (
    *("PYTHON", "LD_", "MALLOC", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS", "GOTO"),
    *("ATEN_", "TORCH", "CUDA", "CUBLAS", "CUDNN", "NCCL", "ONEDNN", "DNNL", "PL_", "LIGHTNING"),
    "REPROTRAIN_TEST_",  # tests/inject's sitecustomize reads them at start
)
#: Seconds the request that finds its server starting waits for it before it execs.
START_WAIT_S = 120.0
#: Signals a waiting requester passes on to the child's process group.
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1)
_HEADER = struct.Struct("!I")
#: True in a served child (set by :mod:`reprotrain._zygote_server`): the command it runs
#: must not ask for a server again.
SERVED = False


def _key(argv: list[str], env: Mapping[str, str]) -> str:
    """The server a request may use: same interpreter, start-up variables and process
    context (a served child runs in its server's namespaces, with its limits and CPUs)."""
    startup = sorted((k, v) for k, v in env.items() if k.startswith(STARTUP))
    text = json.dumps([os.path.realpath(argv[0]), startup, _context()])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _context() -> list:
    """What a fork inherits from its server but an exec from its requester, beyond variables:
    namespaces (``unshare``'s mounts), credentials, resource limits, CPUs, cgroup."""
    import resource

    spaces = [str(Path(f"/proc/self/ns/{n}").readlink()) for n in ("mnt", "user", "pid", "net")]
    limits = [resource.getrlimit(getattr(resource, n)) for n in dir(resource) if n[:7] == "RLIMIT_"]
    cgroup = Path("/proc/self/cgroup").read_text()
    ids = [os.getuid(), os.geteuid(), os.getgid(), os.getegid(), sorted(os.getgroups())]
    return [spaces, ids, limits, sorted(os.sched_getaffinity(0)), cgroup]


def entry(argv: list[str]) -> tuple[str, str] | None:
    """``("module", name)`` for ``python -m name``, ``("path", script)`` for ``python
    script``; None for a command line with interpreter options (exec it)."""
    if len(argv) >= 3 and argv[1] == "-m":
        return "module", argv[2]
    if len(argv) >= 2 and not argv[1].startswith("-"):
        return "path", argv[1]
    return None


def send(sock: socket.socket, message: dict, fds: list[int] = ()) -> None:
    data = json.dumps(message).encode()
    payload = _HEADER.pack(len(data)) + data
    if fds:
        sock.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        sock.sendall(payload)


def receive(sock: socket.socket) -> tuple[dict | None, list[int]]:
    """One message and the descriptors that came with it; (None, []) at end of stream."""
    fds: list[int] = []
    data = b""
    size = None
    while size is None or len(data) < _HEADER.size + size:
        want = _HEADER.size - len(data) if size is None else _HEADER.size + size - len(data)
        chunk, ancillary, _, _ = sock.recvmsg(want, socket.CMSG_SPACE(16 * 4))
        for level, kind, raw in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds += array.array("i", raw[: len(raw) - len(raw) % 4]).tolist()
        if not chunk:
            return None, fds
        data += chunk
        if size is None and len(data) == _HEADER.size:
            size = _HEADER.unpack(data)[0]
    return json.loads(data[_HEADER.size :]), fds


# --- the requester: the restarting process -------------------------------------------------


def hand_over(argv: list[str], env: dict[str, str]) -> None:
    """Run ``argv`` (an interpreter's command line) under ``env`` in a served child and end
    as it ends; return (exec as before) where no server takes it."""
    folder = Path(env.get(VARIABLE) or os.environ[VARIABLE])
    if entry(argv) is None:
        return
    key = _key(argv, env)
    path = folder / f"{key}.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(path))
    except OSError:
        sock.close()
        if not _start_server(folder, key, argv, env):
            return
        sock = _connect_once_up(folder, key)
        if sock is None:  # the start failed, or took longer than START_WAIT_S: exec
            return
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    request = {
        "argv": argv,
        "env": env,
        "cwd": str(Path.cwd()),
        "umask": _umask(),
        # an exec keeps ignored signals ignored and blocked ones blocked (``cmd &`` ignores
        # SIGINT); the child starts with the same
        "ignored": [int(n) for n in FORWARDED if signal.getsignal(n) == signal.SIG_IGN],
        "blocked": [int(n) for n in signal.pthread_sigmask(signal.SIG_BLOCK, [])],
    }
    try:
        send(sock, request, [0, 1, 2])
        started, _ = receive(sock)
    except OSError:
        started = None
    if started is None:  # the server went away before forking: exec as before
        sock.close()
        return
    child = started["pid"]
    for number in FORWARDED:
        signal.signal(number, lambda sig, _frame: signal_group(child, sig))
    try:
        ended, _ = receive(sock)
    except OSError:
        ended = None
    status = -signal.SIGKILL if ended is None else ended["status"]
    if status < 0:
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    os._exit(status)


def hand_over_rank() -> None:
    """Serve a rank that Lightning's launcher started (``LOCAL_RANK`` above 0) as a restart
    is served: it is a fresh interpreter that needs no restart (it inherits the fixed
    variables) and would import torch and Lightning itself. Returns in a served child, in
    local rank 0, and where no server takes it (it runs here as before)."""
    if SERVED or os.environ.get("LOCAL_RANK", "0") == "0":
        return
    hand_over([sys.executable, *sys.orig_argv[1:]], dict(os.environ))


def signal_group(pid: int, number: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, number)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _start_server(folder: Path, key: str, argv: list[str], env: dict[str, str]) -> bool:
    """Start the server for ``key`` at its second request (a set of variables seen once, as
    a test's own, would cost a server's imports for nothing), detached from this process.
    False at a first request (exec); True when a server is starting (this or another
    request started it)."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(folder / f"{key}.seen", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        return False
    except FileExistsError:
        pass
    try:
        os.close(os.open(folder / f"{key}.starting", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        return True
    server = [argv[0], "-m", "reprotrain._zygote_server", str(folder / f"{key}.sock")]
    log = os.open(folder / f"{key}.log", os.O_CREAT | os.O_APPEND | os.O_WRONLY, 0o600)
    pid = os.fork()
    if pid == 0:  # forked twice: the server is nobody's child, so no test counts it as
        try:  # something a command left behind, and it holds none of the command's pipes
            os.setsid()
            if os.fork() == 0:
                null = os.open(os.devnull, os.O_RDWR)
                for target, fd in ((0, null), (1, null), (2, log)):
                    os.dup2(fd, target)
                os.chdir("/")
                os.execve(argv[0], server, env)
        finally:
            os._exit(0)
    os.close(log)
    os.waitpid(pid, 0)
    return True


def _connect_once_up(folder: Path, key: str) -> socket.socket | None:
    """A connection to ``key``'s server once it listens: waiting costs what an exec would
    (the same imports), and the request is then served, not paid twice. None when the
    start ended without a server (its ``.starting`` file gone) or took START_WAIT_S."""
    path = folder / f"{key}.sock"
    deadline = time.monotonic() + START_WAIT_S
    while time.monotonic() < deadline:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(str(path))
            return sock
        except OSError:
            sock.close()
        if not (folder / f"{key}.starting").exists():
            return None
        time.sleep(0.05)
    return None
