"""The train stage's Lightning machinery: fit.

:mod:`reprotrain.pipeline.stages.train` reads top to bottom and imports this
module when it runs, so the CLI can read the stage's options without
Lightning. It is part of the stage: the run ID's code hash covers it (it is
in the stage's import closure, :func:`reprotrain.provenance.identity.source_files`).

:func:`fit` builds the model and data module params names (:mod:`reprotrain.pipeline.recipe`),
checks them against the contract (:mod:`reprotrain.pipeline.contract`) and fits them,
checkpointing with the full random state when asked
(:class:`~reprotrain.pipeline.resume_point.Checkpointing`);
Ctrl-C and SIGTERM stop it after the batch on every rank, keeping the last
checkpoint (none where the module puts in it what ``weights_only`` loading
refuses: the stop's one line names the key, :mod:`reprotrain.resume`). Tied
weights, manual optimization, skipped batches and no optimizer train as
Lightning runs them (the ``train_loss`` they give: :mod:`reprotrain.pipeline.curves`);
world-size invariance refuses manual optimization by name before the first
step. :func:`~reprotrain.pipeline.train_files.write_outputs` writes what it
trained.

The op recorder (:class:`reprotrain.ops.recorder.OpRecorder`) is attached
only when a recording is asked for (``REPROTRAIN_RECORD_OPS``, which
``reprotrain verify`` sets), and is loaded by name: it observes the ops and
never decides the bits, so it stays out of the stage's import closure and
its code hash (tests/test_oprecord.py shows a recorded run's weights equal an
unrecorded run's).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import signal
import sys
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.utilities.exceptions import SIGTERMException

from reprotrain.determinism import (
    DeterminismSettings,
    explain_nondeterministic_error,
    user_frame,
)
from reprotrain.distributed.ddp import RankAgreement, ddp_strategy
from reprotrain.distributed.worldsize import WorldSizeInvariantStrategy
from reprotrain.pipeline.config import Params
from reprotrain.pipeline.contract import check_datasets, order_refusal
from reprotrain.pipeline.curves import CurveCheckpoint, MemoryLogger, MetricLevels, TrainLossLogger
from reprotrain.pipeline.data import PipelineLoaders
from reprotrain.pipeline.epoch_metrics import EpochAccumulators
from reprotrain.pipeline.errors import DataError, Interrupted
from reprotrain.pipeline.own_loaders import OwnLoader
from reprotrain.pipeline.preflight import check_accelerator
from reprotrain.pipeline.recipe import Recipe, build, hooks_skipped
from reprotrain.pipeline.resumable_loader import stop_loader_workers, stop_loader_workers_at_exit
from reprotrain.pipeline.resume_point import WORKERS_KEY, Checkpointing, LoaderStateRestored
from reprotrain.resume import (
    InterruptCheckpoint,
    RandomStateCallback,
    VerifiedCheckpointIO,
    latest_checkpoint,
)

#: Names the optimizer steps to record ("3" or "3-5"); the recorder's WINDOW_VARIABLE.
RECORD_OPS_VARIABLE = "REPROTRAIN_RECORD_OPS"
#: Loaded by name only when asked for, so no import statement puts it in the code hash.
RECORDER_MODULE = "reprotrain.ops.recorder"
#: How Lightning 2.6 (the version the locks pin) refuses a skipped batch on several ranks.
LIGHTNING_NO_SKIP = "Skipping the `training_step` by returning None in distributed training"


@dataclass
class Fitted:
    """What :func:`fit` trained: the module, its curves, and the arguments linked from the data."""

    module: L.LightningModule
    logger: MemoryLogger
    linked: dict[str, Any]
    #: Epochs trained, as the trainer counts them (those before a resume included).
    epochs: int
    #: Training steps run, the step axis of the train_loss curve: a skipped batch is one, and
    #: so is an optimizer step over several accumulated micro-batches.
    steps: int


#: The Trainer's root folder inside the checkpoints folder: what the module's own callbacks
#: write by default (a ModelCheckpoint with no dirpath: ``lightning/memory/0/checkpoints``).
LIGHTNING_ROOT = "lightning"


def fit(
    params: Params,
    recipe: Recipe,
    settings: DeterminismSettings,
    checkpointing: Checkpointing | None = None,
    callbacks: Sequence[L.Callback] = (),
) -> Fitted:
    """Build the model and data module ``recipe`` names and fit them with Lightning.

    With ``checkpointing``, a verified checkpoint is written at the end of
    every ``train.checkpoint_every_n_epochs``-th epoch (the newest one kept),
    and its ``resume_from`` continues from one. ``callbacks`` run after the
    rank check and before the checkpoint callbacks: the stage's
    :class:`~reprotrain.trace.callback.TraceCallback` (its rows are
    checkpointed too), or a measurement (``benchmarks/``). Under DDP the
    ranks must agree on the run ID and resume point before the first step.
    """
    cfg = params.train
    check_accelerator(params)
    stop_loader_workers_at_exit()
    ddp = cfg.strategy == "ddp"
    invariant = cfg.world_size_invariant
    source, module, linked = build(recipe)
    check_datasets(source)
    if invariant and not module.automatic_optimization:
        raise DataError(_manual_under_invariance(recipe))
    datamodule = PipelineLoaders(
        source,
        seed=params.seed,
        shard=ddp and not invariant,
        micro_batch_size=cfg.micro_batch_size if invariant else None,
    )
    if problem := order_refusal(params, datamodule.own("train")):
        named = recipe.components[0]  # the data module, else the model giving the data
        raise DataError(f"{named.key}.class_path: {named.class_path}: {problem}")
    # A ModelCheckpoint of the module's own with no dirpath writes under the Trainer's root:
    # beside the pipeline's checkpoints (git-ignored), not in the repository's root
    root = checkpointing.directory.parent / LIGHTNING_ROOT if checkpointing else None
    if (kept := datamodule.kept_order) is not None:
        checkpointing = None  # its order cannot be resumed: every run starts from the first step
    strategy, accumulate = _strategy(params, datamodule)
    logger = MemoryLogger(training_metrics=not invariant)
    resume_from = checkpointing.resume_from if checkpointing else None
    losses = TrainLossLogger()
    chosen: list[L.Callback] = [MetricLevels(logger), losses, LoaderStateRestored()]
    chosen += _op_recorder()
    if ddp or invariant:
        identity = checkpointing.run_id if checkpointing else None
        facts = {"run_id": identity, "resume_from": resume_from and resume_from.name}
        chosen.append(RankAgreement(facts, mode=settings.mode))
    chosen += callbacks
    if checkpointing is not None:
        every = cfg.checkpoint_every_n_epochs
        chosen += _checkpoint_callbacks(every, checkpointing, datamodule, logger, losses)
    checkpoint_io = VerifiedCheckpointIO(note=_note)
    interactive = quiet_lightning()
    trainer = L.Trainer(
        accelerator=cfg.accelerator,
        strategy=strategy,
        accumulate_grad_batches=accumulate,
        devices=cfg.devices,
        num_nodes=cfg.num_nodes,
        use_distributed_sampler=False,  # the data module shards with a seeded sampler
        precision=cfg.precision,
        max_epochs=cfg.max_epochs,
        logger=logger,
        log_every_n_steps=1,
        callbacks=chosen,
        plugins=[checkpoint_io],
        enable_checkpointing=checkpointing is not None,
        enable_model_summary=False,
        enable_progress_bar=interactive,
        num_sanity_val_steps=0,
        default_root_dir=root,
        **settings.trainer_flags(),
    )
    try:
        with _sigint_as_sigterm() as got, hooks_skipped(module, source):
            trainer.fit(module, datamodule=datamodule, ckpt_path=resume_from)
    except (SIGTERMException, RuntimeError) as err:
        # Lightning stops at the end of a batch after SIGTERM (SIGTERMException), or the
        # DataLoader-worker error comes first when the signal reached the workers too.
        if trainer.received_sigterm:
            _ignore_dead_loader_workers()
            stop_loader_workers()  # workers whose start the signal cut short
            if kept is not None:
                raise Interrupted(_not_resumable(kept, got["signal"])) from None
            directory = checkpointing.directory if checkpointing else None
            refused = checkpoint_io.refused
            raise Interrupted(_interrupted(directory, got["signal"], refused)) from None
        if LIGHTNING_NO_SKIP in str(err):
            raise DataError(_skipped_on_ranks(recipe, trainer.world_size)) from None
        explained = explain_nondeterministic_error(err, user_frame(err.__traceback__))
        if explained is None:
            raise
        raise explained from None
    steps = trainer.fit_loop.epoch_loop._batches_that_stepped  # Lightning 2.6, as the locks pin
    return Fitted(module, logger, linked, epochs=trainer.current_epoch, steps=steps)


def _manual_under_invariance(recipe: Recipe) -> str:
    return (
        f"train.world_size_invariant: true, but model.class_path: {recipe.model.class_path} sets "
        "automatic_optimization = False: the mode cuts each batch into micro-batches and adds "
        "their gradients by one fixed tree through Lightning's automatic optimization, which "
        "manual optimization steps around; use automatic optimization, or set "
        "train.world_size_invariant: false"
    )


def _skipped_on_ranks(recipe: Recipe, world_size: int) -> str:
    return (
        f"model.class_path: {recipe.model.class_path}: training_step returned None (a skipped "
        f"batch) on {world_size} ranks, which Lightning refuses in distributed training (the "
        "ranks must step together); return a loss for every batch, or train on one process"
    )


def _note(message: str) -> None:
    """One line on stderr while training goes on (a checkpoint not kept, and why)."""
    print(f"reprotrain: note: {message}", file=sys.stderr, flush=True)


def quiet_lightning() -> bool:
    """Silence Lightning's expected chatter; return whether stderr is an interactive terminal.

    Off a terminal (DVC, CI) Lightning's info lines (devices, tips) are dropped.
    """
    # Lightning 2.6 trips over its own use of a deprecated torch pytree API on every fit,
    # and warns about the (expected) earlier checkpoints when a run resumes.
    warnings.filterwarnings("ignore", message=r".*LeafSpec.*is deprecated")
    warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
    # Validation covers the whole split on every rank (see data.py): nothing to all-reduce.
    warnings.filterwarnings("ignore", message=r"It is recommended to use `self.log\('(val|test)_")
    # A data module with no validation split gets an empty list (data.py): nothing to validate
    warnings.filterwarnings("ignore", message=r"Total length of `list` across ranks is zero")
    interactive = sys.stderr.isatty() and not os.environ.get("CI")
    if not interactive:
        logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    return interactive


def _op_recorder() -> list[L.Callback]:
    """``[OpRecorder()]`` when ``REPROTRAIN_RECORD_OPS`` asks for a recording, else ``[]``.

    Imported by name: the recorder observes and never decides the bits, so it
    must not be in the stage's code hash, where an import statement would put
    it (``source_files`` follows every ``import``, inside functions too).
    """
    if not os.environ.get(RECORD_OPS_VARIABLE):
        return []
    return [importlib.import_module(RECORDER_MODULE).OpRecorder()]


def _checkpoint_callbacks(
    every_n_epochs: int,
    checkpointing: Checkpointing,
    datamodule: PipelineLoaders,
    logger: MemoryLogger,
    losses: TrainLossLogger,
) -> list[L.Callback]:
    """Verified checkpoints with the random state and the curves so far, and one on Ctrl-C."""
    generators = {"train_loader": datamodule.train_generator}
    random_state = checkpointing.random_state
    return [
        RandomStateCallback(
            generators,
            run_id=checkpointing.run_id,
            restore=random_state,
            stamp={WORKERS_KEY: checkpointing.workers} if checkpointing.workers else None,
        ),
        CurveCheckpoint(logger, losses),
        EpochAccumulators(),
        ModelCheckpoint(
            dirpath=checkpointing.directory,
            filename="epoch={epoch}",
            auto_insert_metric_name=False,
            save_top_k=1,
            every_n_epochs=every_n_epochs,
            enable_version_counter=False,
        ),
        InterruptCheckpoint(checkpointing.directory),
    ]


def _strategy(params: Params, datamodule: PipelineLoaders) -> tuple[Strategy | str, int]:
    """Lightning's strategy for ``train.strategy`` (and the mode), and its accumulation."""
    cfg = params.train
    if cfg.world_size_invariant:
        micro_batches = datamodule.batch_size // cfg.micro_batch_size
        invariant = WorldSizeInvariantStrategy(micro_batches, params.seed, cfg.accelerator)
        return invariant, invariant.micro_batches_per_rank(cfg.devices * cfg.num_nodes)
    return (ddp_strategy(cfg.accelerator) if cfg.strategy == "ddp" else "auto"), 1


def _ignore_dead_loader_workers() -> None:
    """Keep the error line last: a DataLoader iterator whose workers the signal killed
    fails to shut them down when it is collected at exit ("Exception ignored in ...
    _MultiProcessingDataLoaderIter.__del__"); only that report is dropped."""
    default = sys.unraisablehook

    def hook(report: sys.UnraisableHookArgs) -> None:
        if "DataLoaderIter.__del__" not in getattr(report.object, "__qualname__", ""):
            default(report)

    sys.unraisablehook = hook


@contextlib.contextmanager
def _sigint_as_sigterm() -> Iterator[dict[str, str]]:
    """Ctrl-C takes Lightning's SIGTERM path: stop after the batch, on every rank.

    A KeyboardInterrupt can land anywhere, even in a finaliser where Python
    ignores it (seen: training then finished with exit 0); a flag checked at
    batch end cannot be lost. Yields which signal arrived.
    """
    got = {"signal": "SIGTERM"}

    def forward(signum: int, frame: object) -> None:
        got["signal"] = "SIGINT"
        os.kill(os.getpid(), signal.SIGTERM)

    previous = signal.signal(signal.SIGINT, forward)
    try:
        yield got
    finally:
        signal.signal(signal.SIGINT, previous)


def _interrupted(checkpoint_dir: Path | None, name: str, refused: str | None = None) -> str:
    """The stop's one line; ``refused``: why the latest checkpoint was not kept, if it was not."""
    kept = None
    if checkpoint_dir is not None and checkpoint_dir.is_dir():
        kept = latest_checkpoint(checkpoint_dir)
    if refused and kept is None:
        return (
            f"training interrupted ({name}); no checkpoint kept: {refused}. "
            "Rerun to train from the first step, to the same bits"
        )
    if not kept:
        return (
            f"training interrupted ({name}) before its first checkpoint: rerun the same command "
            "or `dvc repro` to train from the first step, to the same bits"
        )
    later = f" (a later one was not: {refused})" if refused else ""
    return (
        f"training interrupted ({name}); its last checkpoint, {kept.name}, is kept{later}: "
        "rerun the same command or `dvc repro` to resume, with the same bits as an "
        "uninterrupted run"
    )


def _not_resumable(kept: OwnLoader, name: str) -> str:
    return (
        f"training interrupted ({name}); no checkpoint kept: {kept.refusal('resume')}. "
        "Rerun to train from the first step, to the same bits"
    )
