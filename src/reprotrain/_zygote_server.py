"""The warm interpreter's server: imports what commands need once, forks a child per request.

Started by :mod:`reprotrain._zygote` (``python -m reprotrain._zygote_server SOCKET``)
at a set of start-up variables' second request, detached; it imports
:data:`WARM`, listens on its socket and forks each request's child, which becomes
the requested process (its arguments, variables, working directory, umask,
standard streams and signal dispositions), runs it and exits as it exits, and
sends the requester the child's status; a requester that goes away has its child's
process group killed. It exits after :data:`IDLE_S` seconds without a request.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import runpy
import selectors
import signal
import socket
import sys
import time
from pathlib import Path

from reprotrain import _zygote
from reprotrain._zygote import FORWARDED, entry, receive, send, signal_group

#: Modules a served command would import anyway, imported once by the server.
WARM = ("torch", "lightning", "reprotrain.cli", "reprotrain.pipeline.stages.train")
IDLE_S = 120.0


def serve(path: Path) -> None:
    """Import :data:`WARM`, then fork a child per request until idle for :data:`IDLE_S`;
    whatever ends it (a failed import too) removes its files, so no request waits on it."""
    try:
        _serve(path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        for suffix in (".starting", ".pid"):
            with contextlib.suppress(FileNotFoundError):
                path.with_suffix(suffix).unlink()


def _serve(path: Path) -> None:
    import importlib

    for name in WARM:
        importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    listener.bind(str(path))
    listener.listen(64)
    path.with_suffix(".pid").write_text(f"{os.getpid()}\n")
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "listener")
    children: dict[int, tuple[socket.socket, int]] = {}  # pidfd -> (connection, pid)
    last = time.monotonic()
    while children or time.monotonic() - last < IDLE_S:
        for handle, _ in selector.select(timeout=5.0):
            if handle.data == "listener":
                connection, _ = listener.accept()
                last = time.monotonic()
                pid = _fork_child(connection, selector)
                if pid is None:
                    connection.close()
                    continue
                pidfd = os.pidfd_open(pid)
                children[pidfd] = (connection, pid)
                selector.register(pidfd, selectors.EVENT_READ, ("child", pidfd))
                selector.register(connection, selectors.EVENT_READ, ("requester", pidfd))
            elif handle.data[0] == "child":
                _reap(handle.data[1], children, selector)
                last = time.monotonic()
            elif handle.data[1] in children:  # the requester closed or died: stop the child
                _, pid = children[handle.data[1]]
                signal_group(pid, signal.SIGKILL)
                selector.unregister(handle.fileobj)


def _reap(pidfd: int, children: dict, selector: selectors.BaseSelector) -> None:
    connection, pid = children.pop(pidfd)
    _, code = os.waitpid(pid, 0)
    status = -os.WTERMSIG(code) if os.WIFSIGNALED(code) else os.WEXITSTATUS(code)
    selector.unregister(pidfd)
    os.close(pidfd)
    with contextlib.suppress(KeyError, ValueError):
        selector.unregister(connection)
    with contextlib.suppress(OSError):
        send(connection, {"status": status})
    connection.close()


def _fork_child(connection: socket.socket, selector: selectors.BaseSelector) -> int | None:
    request, fds = receive(connection)
    if request is None or len(fds) != 3:
        for fd in fds:
            os.close(fd)
        return None
    pid = os.fork()
    if pid == 0:  # none of the server's sockets or pidfds stays open in the child
        for held in list(selector.get_map().values()):
            with contextlib.suppress(OSError):
                os.close(held.fd)
        selector.close()
        _run_child(request, fds, connection)
    for fd in fds:
        os.close(fd)
    send(connection, {"pid": pid})
    print(f"served {pid}: {' '.join(request['argv'][1:4])}", file=sys.stderr, flush=True)
    return pid


def _run_child(request: dict, fds: list[int], connection: socket.socket) -> None:
    """In the forked child: become the requested process, run it, exit as it exits."""
    _zygote.SERVED = True
    code = 1
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: never outlive the server
        os.setpgid(0, 0)
        connection.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        for number in (*FORWARDED, signal.SIGCHLD):
            signal.signal(number, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as Python sets it at start
        for number in request["ignored"]:
            signal.signal(number, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_SETMASK, request["blocked"])
        os.chdir(request["cwd"])
        os.umask(request["umask"])
        os.environ.clear()
        os.environ.update(request["env"])
        import tempfile

        tempfile.tempdir = None
        if "numpy" in sys.modules:  # seeded from the system at import in a fresh process
            sys.modules["numpy"].random.seed()
        argv = request["argv"]
        sys.orig_argv[:] = argv
        kind, target = entry(argv)  # type: ignore[misc]  # checked by the requester
        if kind == "module":
            sys.argv[:] = [target, *argv[3:]]
            sys.path[0] = request["cwd"]
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.argv[:] = argv[1:]
            sys.path[0] = str(Path(target).resolve().parent)
            runpy.run_path(target, run_name="__main__")
        code = 0
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
        if not isinstance(done.code, int) and done.code is not None:
            print(done.code, file=sys.stderr)
    except KeyboardInterrupt:  # as the interpreter ends on one: killed by SIGINT
        sys.excepthook(*sys.exc_info())
        code = -signal.SIGINT
    except BaseException:  # noqa: BLE001  # the interpreter's own top level: report, exit 1
        sys.excepthook(*sys.exc_info())
        code = 1
    finally:
        import atexit

        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        if code < 0:
            signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
        os._exit(code)


if __name__ == "__main__":
    # Served by the module under its own name, as the requester's module was before.
    importlib.import_module("reprotrain._zygote_server").serve(Path(sys.argv[1]))
