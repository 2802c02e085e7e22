"""The training DataLoader: it resumes in the middle of an epoch bit for bit, and its
workers leave stop signals to the training process.

:class:`ResumableLoader` checkpoints its epoch generator and the batches consumed,
so a run stopped mid-epoch (SIGTERM) resumes with the same order, worker seeds
and augmentation. :class:`WorkersIgnoreStopSignals` starts its workers with
SIGTERM and SIGINT blocked, so a signal to the process group stops training
after the batch instead of killing a worker mid-fetch;
:func:`stop_loader_workers` then ends workers that never were shut down.
:mod:`reprotrain.pipeline.data` builds these loaders around a data module.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader

from reprotrain.distributed.microbatches import MicroBatchSampler


class WorkersIgnoreStopSignals(DataLoader):
    """A DataLoader whose worker processes start with SIGTERM and SIGINT blocked.

    The mask is inherited by the forked workers (a fork server, which does not inherit
    it, blocks the same signals itself: :func:`~reprotrain.distributed.ddp.worker_start`)
    and torch's worker loop leaves it, so a signal to the whole process group (a
    cluster preempting the job, Ctrl-C in a terminal) reaches the training
    processes alone: they stop after the batch and shut their workers down,
    instead of a killed worker failing a fetch at a different moment on each DDP
    rank.
    """

    def __iter__(self) -> Iterator:
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
        try:
            return super().__iter__()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def stop_loader_workers() -> None:
    """Stop this process's daemon children still alive (DataLoader workers are): SIGTERM,
    then SIGKILL for those alive a second later.

    A worker's iterator stops it when it is shut down; one whose start a stop signal
    interrupted (the signal landing while an epoch's workers start) never is, and at exit
    Python's multiprocessing sends its daemon children SIGTERM, which these workers block
    (:class:`WorkersIgnoreStopSignals`), then waits for them: for good. The train stage
    calls this when it stops, and at exit (:func:`stop_loader_workers_at_exit`).
    """
    children = [child for child in multiprocessing.active_children() if child.daemon]
    if not children:
        return
    # torch's SIGCHLD handler raises for a worker that died of a signal: not news here
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGCHLD, signal.SIG_DFL) if main else None
    try:
        for child in children:
            child.terminate()
        deadline = time.monotonic() + 1
        for child in children:
            child.join(timeout=max(0.0, deadline - time.monotonic()))
        for child in children:
            if child.is_alive():
                child.kill()
        for child in children:
            child.join(timeout=5)
    finally:
        if main:
            signal.signal(signal.SIGCHLD, previous)


def stop_loader_workers_at_exit() -> None:
    """Run :func:`stop_loader_workers` at exit, before multiprocessing waits for its children
    (exit functions run last registered first; multiprocessing registers its own on import)."""
    atexit.unregister(stop_loader_workers)
    atexit.register(stop_loader_workers)


class ResumableLoader(WorkersIgnoreStopSignals):
    """A seeded training DataLoader that resumes in the middle of an epoch, bit for bit.

    Each epoch's iterator draws the shuffle and the workers' base seed from
    ``generator``. :meth:`state_dict` (which Lightning stores in every
    checkpoint, as it does for any loader with one) holds the generator's
    state from just before that draw and ``consumed()``, the batches training
    has used. After :meth:`load_state_dict` (Lightning calls it only when
    resuming mid-epoch) the next iterator rewinds the generator, draws the
    same order and seeds, and loads and drops the consumed batches, so every
    worker's augmentation stream is where it was. With a batch sampler that
    skips by itself (:class:`~reprotrain.distributed.microbatches.MicroBatchSampler`,
    whose samples draw from their own keys) nothing is loaded again: the sampler
    starts past them, and the number of workers may differ from the interrupted run's.
    """

    def __init__(self, *args: object, consumed: Callable[[], int], **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._consumed = consumed
        self._epoch_start: torch.Tensor | None = None
        self._skip = 0

    def __iter__(self) -> Iterator:
        if self.generator is not None:
            self._epoch_start = self.generator.get_state()
        if self._skip and isinstance(self.batch_sampler, MicroBatchSampler):
            self.batch_sampler.skip, self._skip = self._skip, 0
        iterator = super().__iter__()
        with self._global_streams_kept():
            for _ in range(self._skip):
                next(iterator)
        self._skip = 0
        return iterator

    @contextlib.contextmanager
    def _global_streams_kept(self) -> Iterator[None]:
        """Without workers, replaying the consumed batches runs the dataset's draws in
        this process, after the checkpoint restored torch's, numpy's and Python's
        generators to where the interrupted run left them: keep them there."""
        if self.num_workers > 0 or not self._skip:
            yield
            return
        numpy_state, python_state = np.random.get_state(), random.getstate()
        with torch.random.fork_rng(devices=[]):
            yield
        np.random.set_state(numpy_state)
        random.setstate(python_state)

    def state_dict(self) -> dict[str, object]:
        return {"epoch_start": self._epoch_start, "consumed": int(self._consumed())}

    def load_state_dict(self, state: dict[str, object]) -> None:
        if self.generator is not None and state["epoch_start"] is not None:
            self.generator.set_state(state["epoch_start"])  # type: ignore[arg-type]
        self._skip = int(state["consumed"])  # type: ignore[call-overload]
