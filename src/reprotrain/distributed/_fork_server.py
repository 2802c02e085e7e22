"""Imported first by the fork server that starts DataLoader workers under a process
group (:func:`reprotrain.distributed.ddp.worker_start`), and nowhere else.

It blocks SIGTERM and SIGINT in that process, so a signal to the whole job (a
cluster preempting it, Ctrl-C in a terminal) leaves the server and the workers
it forks (they inherit the mask) to the training processes: they stop after
the batch and shut their workers down, as they do with workers forked while
those signals are blocked.

And it ties the server's life to the training process that started it, and
each worker's to the server's. multiprocessing alone does not: every process
the server forks holds the write end of its "alive" pipe, so the server ends
only after its workers, while a DataLoader worker watches only its parent (the
server) and waits for work for good. A training process killed outright
(kill -9, the OOM killer) left its server and workers running, SIGTERM
blocked: seen in the suite. Now the server ends when that process does, and
the kernel sends each worker SIGKILL, which no mask blocks, when the server
ends (``PR_SET_PDEATHSIG``); a worker forked as the server went ends at once.
"""

import ctypes
import os
import select
import signal
import threading
import time

signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})

_SERVER = os.getpid()
#: The training process that started this server.
_JOB = os.getppid()
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux: no parent-death signal to ask for
    _prctl = None
#: The process about to fork, as the child sees it: only the server's children are bound to it.
_forking = _SERVER


def _end_with_the_job() -> None:
    """In a thread of the server: wait for the training process to end, then end too."""
    try:
        ended = os.pidfd_open(_JOB)
    except (AttributeError, OSError):  # no pidfd here (old kernel): ask every second
        while os.getppid() == _JOB:
            time.sleep(1.0)
    else:
        select.select([ended], [], [])
    os._exit(0)


def _note_forking() -> None:
    global _forking
    _forking = os.getpid()


def _end_with_the_server() -> None:
    if _forking != _SERVER:  # a worker's own child: not the server's to end
        return
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != _SERVER:  # the server went before the signal was asked for
        os._exit(1)


threading.Thread(target=_end_with_the_job, name="reprotrain-job-watch", daemon=True).start()
os.register_at_fork(before=_note_forking, after_in_child=_end_with_the_server)
