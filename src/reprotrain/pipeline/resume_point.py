"""Where the train stage resumes from: this run's newest verified checkpoint, or none.

A run's checkpoints live in ``<--checkpoints>/<run ID>/`` (:class:`Checkpointing`),
so a checkpoint of other inputs is never resumed: :func:`find_resume_point`
refuses one that is not this run's. Where the data module's ``num_workers``
decides the bits (each worker draws from its own seeded stream, outside
world-size-invariant mode), checkpoints carry the count and the run ID without
it (:func:`workers_stamp`), so a rerun with another count is refused by name
(:func:`refuse_another_worker_count`) rather than silently starting over.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L

from reprotrain.pipeline.run_record import without_num_workers
from reprotrain.provenance.identity import run_id
from reprotrain.resume import (
    CheckpointError,
    checkpoint_run_id,
    latest_checkpoint,
    load_checkpoint_file,
)

#: The checkpoint entry with the worker count where it decides the bits (workers_stamp).
WORKERS_KEY = "reprotrain_workers"


@dataclass(frozen=True)
class Checkpointing:
    """Where :func:`fit` checkpoints, for which run, and what it resumes from."""

    #: A verified checkpoint is written here every ``train.checkpoint_every_n_epochs`` epochs.
    directory: Path
    #: The run ID the checkpoints are written for (and that DDP ranks must agree on).
    run_id: str
    #: This run's checkpoint to continue from (:func:`find_resume_point`), if any.
    resume_from: Path | None = None
    #: The random state rides along; False only for the negative control (resume then
    #: differs) and the overhead benchmark.
    random_state: bool = True
    #: The worker count and the ID of the run without it (:func:`workers_stamp`), where
    #: the count decides the bits: a checkpoint carries it, so a rerun with another count
    #: is refused by name (:func:`refuse_another_worker_count`) rather than started over.
    workers: dict[str, Any] | None = None


def find_resume_point(run_dir: Path, identity: str) -> Path | None:
    """This run's newest verified checkpoint; refuses tampered files and other runs' files."""
    if not run_dir.is_dir():
        return None
    newest = latest_checkpoint(run_dir)
    if newest is None:
        return None
    owner = checkpoint_run_id(newest)
    if owner != identity:
        raise CheckpointError(
            f"{newest}: written for run {str(owner)[:12]}, not this run {identity[:12]}: "
            "its params, data, code or environment differ, so resuming would mix two runs; "
            "delete it to start over"
        )
    return newest


def workers_stamp(inputs: dict[str, Any]) -> dict[str, Any] | None:
    """``{"key": run ID without num_workers, "num_workers": n}``; None if the run ID has no
    worker count (``train.world_size_invariant``: draws are keyed per sample)."""
    data = (inputs["recipe"]["data"] or {}).get("init_args", {})  # None: the model's loaders
    if "num_workers" not in data:
        return None
    key = run_id({**inputs, "recipe": without_num_workers(inputs["recipe"])})
    return {"key": key, "num_workers": data["num_workers"]}


def refuse_another_worker_count(checkpoints: Path, identity: str, workers: Any) -> None:
    """Refuse to start over when an interrupted run of the same inputs but another worker
    count left checkpoints: outside world-size-invariant mode each worker draws from its
    own seeded stream, so that run cannot resume with this count (docs/data.md)."""
    if not workers or not checkpoints.is_dir():
        return
    for run_dir in sorted(p for p in checkpoints.iterdir() if p.is_dir() and p.name != identity):
        newest, stamp = _workers_stamp_of(run_dir)
        if stamp and stamp.get("key") == workers["key"]:
            raise CheckpointError(
                f"{newest}: an interrupted run of these inputs with data.init_args.num_workers "
                f"{stamp.get('num_workers')}, this run has {workers['num_workers']}; each worker "
                "draws from its own stream, so it cannot resume with another count "
                "(train.world_size_invariant can): set num_workers back to resume it, or delete "
                "it to start over"
            )


def _workers_stamp_of(run_dir: Path) -> tuple[Path | None, dict[str, Any] | None]:
    """The newest verified checkpoint in ``run_dir`` and its workers stamp (or Nones); another
    run's file that cannot be read (not even by ``weights_only`` loading) has none."""
    with contextlib.suppress(CheckpointError, OSError):
        newest = latest_checkpoint(run_dir)
        if newest is not None:
            stamp = load_checkpoint_file(newest).get(WORKERS_KEY)
            return newest, stamp if isinstance(stamp, dict) else None
    return None, None


class LoaderStateRestored(L.Callback):
    """The training loader's saved state applied on a mid-epoch resume, whenever Lightning
    set the loader up.

    Lightning 2.6 applies a checkpoint's loader state (a
    :class:`~reprotrain.pipeline.resumable_loader.ResumableLoader`'s epoch generator and consumed
    batches) when ``FitLoop.setup_data`` sets the loader up, then makes the epoch's
    iterator. A module whose ``configure_optimizers`` reads
    ``self.trainer.estimated_stepping_batches`` (Lightning's documented way to size
    ``OneCycleLR``) sets it up earlier, before the checkpoint is restored: the iterator
    drew a fresh epoch's order, the later call returns at once, and the state was never
    applied, so the resumed epoch trained other batches. At ``on_train_start`` (after the
    restore, before the first batch) a state still pending is applied and the iterator
    made again from it; where Lightning applied it, none is pending and this does nothing.
    """

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        loop = trainer.fit_loop  # Lightning 2.6's, as the locks pin
        if not (loop.restarting and loop._combined_loader_states_to_load):
            return
        loop._load_combined_loader_states()
        iter(loop._data_fetcher)  # the iterator the early set-up made drew before the restore
