"""Imported first by the fork server that starts DataLoader workers under a process
group (:func:`reprotrain.distributed.ddp.worker_start`), and nowhere else.

It blocks SIGTERM and SIGINT in that process, so a signal to the whole job (a
cluster preempting it, Ctrl-C in a terminal) leaves the server and the workers
it forks (they inherit the mask) to the training processes: they stop after
the batch and shut their workers down, as they do with workers forked while
those signals are blocked. The server still ends with the process that
started it.
"""

import signal

signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
