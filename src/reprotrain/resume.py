"""Bitwise resume for Lightning: random state in checkpoints, verified atomic checkpoint files.

Lightning checkpoints carry the model, optimizer and loop state but no random
state (Lightning issue 17543), so a resumed run draws different dropout masks
and shuffles than an uninterrupted one. :class:`RandomStateCallback` adds to
every checkpoint the python, numpy, torch CPU and every CUDA device's
generator state, plus any ``torch.Generator`` you hand it (give it the one
your training DataLoader shuffles with), and restores them on resume.
Under DDP each rank's state is gathered into the one checkpoint rank 0
writes, and each rank restores its own (a checkpoint from another world size
is refused).

The guarantee: resuming from a checkpoint taken at an **epoch boundary**
gives the same bits as the uninterrupted run, provided the DataLoader
workers are not persistent (``persistent_workers=False``: each epoch's
workers are then seeded from the saved loader generator; persistent workers
keep private random state that no checkpoint can capture) and nothing else
keeps hidden random state across epochs. A checkpoint from the middle of an
epoch is exact only when the training DataLoader can resume mid-epoch (it has
``state_dict``/``load_state_dict``, which Lightning stores and restores; the
pipeline's ``ResumableLoader``); otherwise Lightning restarts the epoch's
data iteration and the batches already seen are not replayed in order.
:class:`InterruptCheckpoint` writes such a checkpoint at the end of the batch
in which SIGTERM (Lightning's preemption signal) arrived, on every rank
under DDP.

:class:`VerifiedCheckpointIO` (``Trainer(plugins=[...])``) writes each
checkpoint atomically and then a ``<name>.sha256`` sidecar; it loads a file
only when the sidecar matches, and always with ``weights_only=True``, so a
truncated, corrupted or tampered checkpoint is refused before any byte of it
is unpickled. :func:`latest_checkpoint` finds the newest complete one.

``weights_only`` loading is kept whatever a module puts in its checkpoint, so
the resume guarantee is refused by name where it cannot hold: a checkpoint
that ``weights_only`` loading would refuse (an object a module's
``on_save_checkpoint`` stores, as Lightning's docs show, or a numpy array) is
loaded back as it is written, and when that fails it is not kept: no sidecar,
the file removed, and :attr:`VerifiedCheckpointIO.refused` names the key and
the type that made it fail (one ``note`` line, once per run). A stopped run
then has no resume point and its rerun trains from the first step, to the
same bits. Such a file found before a resume (one written by an earlier
version) is refused in one line that names it (:func:`load_checkpoint_file`).
"""

from __future__ import annotations

import collections
import io
import math
import pickle
import random
import re
import signal
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import Checkpoint

from reprotrain.atomic import atomic_write_bytes, atomic_write_text
from reprotrain.distributed.ddp import gather_from_ranks, own_entry
from reprotrain.hashing import sha256_file

RUN_ID_KEY = "reprotrain_run_id"


class CheckpointError(ValueError):
    """A checkpoint is corrupted, tampered with, or belongs to another run."""


def sidecar(path: str | Path) -> Path:
    path = Path(path)
    return path.with_name(path.name + ".sha256")


def verify_checkpoint(path: str | Path) -> None:
    """Raise :class:`CheckpointError` unless ``path`` matches its sha256 sidecar."""
    path = Path(path)
    try:
        expected = sidecar(path).read_text().split()[0]
    except (OSError, IndexError):
        raise CheckpointError(
            f"{path}: no checksum sidecar, so it may be incomplete; delete it to start over"
        ) from None
    actual = sha256_file(path)
    if actual != expected:
        raise CheckpointError(
            f"{path}: sha256 {actual} does not match {expected} in {sidecar(path).name}: "
            "corrupted or tampered with, not loaded; delete it to start over"
        )


#: What ``save_hyperparameters()`` put in a checkpoint: kept for ``load_from_checkpoint``,
#: never read when a run resumes.
HYPERPARAMETER_KEYS = ("hyper_parameters", "datamodule_hyper_parameters")


def plain(value: Any) -> Any:
    """``value`` with every object that ``weights_only`` loading refuses (a ``net`` module, an
    optimizer partial: ``save_hyperparameters()`` in the templates) replaced by its name."""
    if value is None or isinstance(value, bool | int | float | str | torch.Tensor):
        return value
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items() if isinstance(k, str | int)}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    kind = type(value)
    return f"<{kind.__module__}.{kind.__qualname__}: not kept in checkpoints>"


class VerifiedCheckpointIO(TorchCheckpointIO):
    """Atomic checkpoint writes with a sha256 sidecar; verified, ``weights_only`` loads.

    The hyperparameters a module saved are written as plain values (:func:`plain`): a
    resume never reads them, and an object among them would make the file one that
    ``weights_only`` refuses (the model's own ``state_dict`` holds its ``net``'s tensors).
    Anything else that ``weights_only`` refuses is the module's own, read back by its
    ``on_load_checkpoint``: that file is not kept (module doc), and ``note`` is called
    once with why.
    """

    def __init__(self, note: Callable[[str], None] | None = None) -> None:
        super().__init__()
        self.note = note
        #: Why the latest checkpoint was not kept (None once one is kept again).
        self.refused: str | None = None
        self._noted = False

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        path = Path(path)
        for key in HYPERPARAMETER_KEYS:
            if key in checkpoint:
                checkpoint = {**checkpoint, key: plain(checkpoint[key])}
        # Serialised in memory: torch.save reports a full disk as a RuntimeError, a
        # Python write as an OSError with its errno (one line from the CLI).
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        atomic_write_bytes(path, buffer.getvalue())
        try:  # mapped, not read: the tensors' bytes stay on disk
            torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except pickle.UnpicklingError as err:
            path.unlink()
            self.refused = unloadable(checkpoint, err)
            if self.note is not None and not self._noted:
                self.note(f"this run keeps no checkpoint, so a stop starts over: {self.refused}")
                self._noted = True
            return
        self.refused = None
        atomic_write_text(sidecar(path), f"{sha256_file(path)}  {path.name}\n")

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        return load_checkpoint_file(path, map_location or "cpu")

    def remove_checkpoint(self, path: Any) -> None:
        super().remove_checkpoint(path)
        sidecar(path).unlink(missing_ok=True)


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The newest ``*.ckpt`` in ``directory`` with a sidecar, verified; None if there is none.

    Files without a sidecar were interrupted while being written and are
    skipped; a file whose sidecar does not match raises :class:`CheckpointError`.
    """
    directory = Path(directory)
    complete = [p for p in directory.glob("*.ckpt") if sidecar(p).is_file()]
    if not complete:
        return None
    newest = max(complete, key=_checkpoint_order)
    verify_checkpoint(newest)
    return newest


def _checkpoint_order(path: Path) -> tuple[float, ...]:
    """``epoch=E`` (end of epoch E) after ``epoch=E-step=S`` (inside epoch E) after E - 1."""
    numbers = [int(n) for n in re.findall(r"\d+", path.stem)] or [-1]
    return (numbers[0], numbers[1] if len(numbers) > 1 else math.inf)


def checkpoint_run_id(path: str | Path) -> str | None:
    """The run ID a verified checkpoint was written for (``weights_only`` load)."""
    return load_checkpoint_file(path).get(RUN_ID_KEY)


def load_checkpoint_file(path: str | Path, map_location: Any = "cpu") -> dict[str, Any]:
    """A verified checkpoint, loaded with ``weights_only=True``; :class:`CheckpointError` (one
    line naming it) if it fails its sidecar or holds what that loading refuses."""
    verify_checkpoint(path)
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        raise CheckpointError(
            f"{path}: weights_only loading refuses it ({_refused_global(err)}), so no run can "
            "resume from it (an earlier reprotrain kept such files); delete it to train from "
            "the first step, to the same bits"
        ) from None


#: What ``weights_only`` loading rebuilds besides tensors (``torch.serialization``'s allowed
#: globals), for :func:`unloadable` to point at what is not among them.
_PLAIN = (type(None), bool, int, float, complex, str, bytes, bytearray, torch.Tensor, torch.Size)
_PLAIN_TORCH = (torch.dtype, torch.device, torch.layout, torch.memory_format)
_CONTAINERS = (dict, collections.OrderedDict, collections.Counter, list, tuple, set)


def unloadable(checkpoint: Mapping[str, Any], err: Exception) -> str:
    """Why ``checkpoint`` cannot be kept: each entry ``weights_only`` loading refuses (up to 3),
    by key and type, and what to store instead; ``err`` is that loading's error."""
    found = [
        f"checkpoint{key} holds a {type(value).__module__}.{type(value).__qualname__}"
        for key, value in _objects(checkpoint, "", set())
    ][:3]
    what = " and ".join(found) if found else f"the checkpoint holds {_refused_global(err)}"
    return (
        f"{what}, which weights_only loading refuses (checkpoints load with weights_only=True); "
        "store plain values or tensors there to resume (an object's fields for the object, "
        "torch.from_numpy for an array)"
    )


def _objects(value: Any, key: str, seen: set[int]) -> Iterator[tuple[str, Any]]:
    """``(key path, value)`` of each value under ``value`` that is not plain or a container."""
    if isinstance(value, _PLAIN + _PLAIN_TORCH):
        return
    if type(value) not in _CONTAINERS:
        yield key, value
        return
    if id(value) in seen:
        return
    seen.add(id(value))
    items = value.items() if isinstance(value, dict) else enumerate(value)
    for name, item in items:
        yield from _objects(item, f"{key}[{name!r}]", seen)


def _refused_global(err: Exception) -> str:
    """The global ``weights_only`` loading refused, from its error; else the error's gist."""
    found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(err))
    return f"a {found.group(1)}" if found else str(err).splitlines()[0]


class RandomStateCallback(L.Callback):
    """Saves and restores every random generator with Lightning's checkpoints.

    ``generators`` are extra ``torch.Generator`` objects by name (for example
    the training DataLoader's). ``run_id`` is stored in each checkpoint so a
    resume can refuse another run's file, and so are the ``stamp`` entries (more
    facts about the run, top-level keys). ``restore=False`` saves but does not
    restore: the negative control that shows the restore matters.
    """

    def __init__(
        self,
        generators: Mapping[str, torch.Generator] | None = None,
        run_id: str | None = None,
        restore: bool = True,
        stamp: Mapping[str, Any] | None = None,
    ) -> None:
        self.generators = dict(generators or {})
        self.run_id = run_id
        self.restore = restore
        self.stamp = dict(stamp or {})

    def state_dict(self) -> dict[str, Any]:
        """Every rank's random state, in rank order (a collective under DDP)."""
        return {"ranks": gather_from_ranks(self._local_state())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not self.restore:
            return
        self._restore(
            own_entry(state["ranks"], "checkpoint holds the random state", CheckpointError)
        )

    def _local_state(self) -> dict[str, Any]:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        version, internal, gauss = random.getstate()
        return {
            "python": {"version": version, "state": list(internal), "gauss": gauss},
            "numpy": {
                "kind": kind,
                "keys": torch.from_numpy(keys.astype(np.int64)),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached": float(cached),
            },
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "generators": {name: g.get_state() for name, g in self.generators.items()},
        }

    def _restore(self, state: dict[str, Any]) -> None:
        py = state["python"]
        random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
        npy = state["numpy"]
        keys = npy["keys"].numpy().astype(np.uint32)
        np.random.set_state((npy["kind"], keys, npy["pos"], npy["has_gauss"], npy["cached"]))
        torch.set_rng_state(state["torch"])
        if state["cuda"]:
            torch.cuda.set_rng_state_all(state["cuda"])
        for name, generator in self.generators.items():
            generator.set_state(state["generators"][name])

    def on_save_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        checkpoint[RUN_ID_KEY] = self.run_id
        checkpoint.update(self.stamp)


class InterruptCheckpoint(Checkpoint):
    """At SIGTERM, a checkpoint at the end of the current batch: ``epoch=E-step=S.ckpt``.

    Lightning notes SIGTERM and stops after the batch (``SIGTERMException``);
    without this, the newest checkpoint is the last epoch-boundary one. The
    file is written like any checkpoint (the trainer's checkpoint IO, every
    callback's state), in ``directory``. On an epoch's last batch the stop is
    put off by one batch, so the epoch ends with its own hooks (validation,
    its checkpoint) and the file is written in the next epoch (or training
    simply finishes); under gradient accumulation it is put off to the batch
    that ends an optimizer step. Under DDP see :meth:`on_train_start`.
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.written: Path | None = None
        self._deferred = False
        self._signalled = False

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Under DDP, SIGTERM only sets a flag; the ranks agree on it at each batch end.

        Lightning's own DDP handler broadcasts from inside the signal handler, which
        can pair with another collective on the other ranks: a SIGTERM to the
        process group of a 2-rank CPU run hung there (measured). Lightning restores
        its handlers at teardown.
        """
        if trainer.world_size > 1:
            signal.signal(signal.SIGTERM, self._note_signal)

    def _note_signal(self, signum: int, frame: object) -> None:
        self._signalled = True

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
        batch_idx: int,
    ) -> None:  # fmt: skip
        # Under DDP a collective on every rank at every batch end: any rank signalled stops all.
        if trainer.world_size > 1 and trainer.strategy.reduce_boolean_decision(
            self._signalled, all=False
        ):
            _set_received_sigterm(trainer, True)
        if self.written:
            return
        if self._deferred:
            _set_received_sigterm(trainer, True)
            self._deferred = False
        if not trainer.received_sigterm:
            return
        last_of_epoch = batch_idx + 1 >= trainer.num_training_batches
        # Accumulated gradients live in no checkpoint: stop only where an optimizer step ends.
        accumulating = (batch_idx + 1) % getattr(trainer, "accumulate_grad_batches", 1) != 0
        if last_of_epoch or accumulating:
            _set_received_sigterm(trainer, False)
            self._deferred = True
            return
        self._save(trainer)

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        """A stop put off from an epoch's last batch still reads as SIGTERM to the caller."""
        if self._deferred:
            _set_received_sigterm(trainer, True)

    def _save(self, trainer: L.Trainer) -> None:
        path = self.directory / f"epoch={trainer.current_epoch}-step={trainer.global_step}.ckpt"
        trainer.save_checkpoint(path)
        self.written = path


def _set_received_sigterm(trainer: L.Trainer, value: bool) -> None:
    """``Trainer.received_sigterm`` is read-only; its signal connector holds the flag
    (Lightning 2.6, the version the locks pin)."""
    trainer._signal_connector.received_sigterm = value
