"""Stage ``train``: prepared data -> ``model.safetensors``, metrics, curves, run record.

Reads top to bottom: configure determinism (before anything touches CUDA);
refuse a drifted lock in ``true`` mode; check the prepared data against the
checksum DVC recorded and compute the run ID; resume from this run ID's
newest verified checkpoint if an earlier attempt was interrupted; fit with
Lightning, checkpointing every ``train.checkpoint_every_n_epochs`` epochs
with the full random state; then
write every output atomically (weights, metrics, curves and the per-step
trace that ``reprotrain compare`` reads), the run record (``run.json``: run
ID and output hashes) last, and drop the checkpoints. Nothing written contains a
time, a path, a host name or a logger version folder, so identical training
gives identical bytes, resumed or not.

With ``train.strategy: ddp`` Lightning starts one process per device (on
CPU, ``devices`` processes with gloo), each running this same stage. Every
rank computes the run ID, and :class:`~reprotrain.distributed.ddp.RankAgreement`
stops them all if any rank disagrees on it or on the resume point; each rank
trains on its seeded share of the data; only rank 0 writes, after gathering
every rank's trace rows (the checkpoints carry every rank's random state).
The distributed layout (world size, backend, DDP options, ``NCCL_*``
settings) is part of the run inputs, so it is part of the run ID.

With ``train.world_size_invariant`` the stage trains through
:class:`~reprotrain.distributed.worldsize.WorldSizeInvariantStrategy` (also in one
process), in micro-batches of ``train.micro_batch_size``: the same bits at
world size 1, 2, 4..., so the layout in the run ID is the mode, not the
world size, and ``dvc.yaml`` lists neither ``train.devices`` nor
``train.num_nodes`` nor ``train.strategy`` (the env stage's record carries
them when they decide the bits).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import sys
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.utilities.exceptions import SIGTERMException

from reprotrain.atomic import atomic_write_safetensors, atomic_write_text
from reprotrain.determinism import (
    DeterminismSettings,
    configure_determinism,
    explain_nondeterministic_error,
    refuse_or_warn,
)
from reprotrain.distributed.ddp import (
    BACKENDS,
    RankAgreement,
    ddp_strategy,
    distributed_layout,
    set_threads_per_rank,
    this_rank,
)
from reprotrain.distributed.worldsize import WorldSizeInvariantStrategy
from reprotrain.hashing import canonical_json, safetensors_metadata
from reprotrain.ops.recorder import OpRecorder
from reprotrain.pipeline.config import Params
from reprotrain.pipeline.curves import CurveCheckpoint, MemoryLogger
from reprotrain.pipeline.data import PreparedData, PreparedDataModule, load_prepared
from reprotrain.pipeline.errors import Interrupted
from reprotrain.pipeline.model import Classifier
from reprotrain.pipeline.preflight import check_accelerator
from reprotrain.pipeline.run_record import load_environment, run_inputs, write_run_record
from reprotrain.provenance.identity import run_id
from reprotrain.resume import (
    CheckpointError,
    InterruptCheckpoint,
    RandomStateCallback,
    VerifiedCheckpointIO,
    checkpoint_run_id,
    latest_checkpoint,
)
from reprotrain.trace.callback import TraceCallback

#: The params.yaml keys this stage reads; dvc.yaml lists exactly these. The process
#: layout (train.devices, train.num_nodes, train.strategy) reaches the cache key through
#: the environment record, only when it decides the bits.
PARAMS = (
    "seed",
    "deterministic",
    "cpu",
    "data.batch_size",
    "data.num_workers",
    "data.augment",
    "model",
    "train.max_epochs",
    "train.checkpoint_every_n_epochs",
    "train.trace",
    "train.optimizer",
    "train.lr",
    "train.weight_decay",
    "train.accelerator",
    "train.precision",
    "train.world_size_invariant",
    "train.micro_batch_size",
)


def run(params: Params, args: argparse.Namespace) -> str:
    settings = configure_determinism(params.seed, params.deterministic, params.cpu.to_profile())
    environment = load_environment(args.env)
    _check_lock(environment["lock"], params.deterministic, args.evidence)
    inputs = stage_inputs(params, args.data, environment, args.dvc_lock, settings)
    identity = run_id(inputs)
    run_dir = args.checkpoints / identity
    resume_from = find_resume_point(run_dir, identity)
    data = load_prepared(args.data)
    tracer = TraceCallback(None, detail=params.train.trace) if args.trace else None
    module, logger = fit(params, data, settings, run_dir, identity, resume_from, tracer=tracer)
    resumed = f", resumed from {resume_from.name}" if resume_from else ""
    if (rank := this_rank()) != 0:
        return f"rank {rank} trained run {identity[:12]}{resumed}; rank 0 writes"

    outputs = _write_outputs(args, params, data, settings, module, logger)
    if tracer is not None:
        tracer.write(args.trace)
        outputs["trace"] = args.trace
    write_run_record(args.run_record, inputs, outputs)
    shutil.rmtree(run_dir, ignore_errors=True)
    return f"trained -> {args.model}, run {identity[:12]}{resumed}"


def stage_inputs(
    params: Params,
    data: Path,
    environment: dict,
    dvc_lock: Path | None,
    settings: DeterminismSettings,
) -> dict:
    """This stage's run inputs (so its run ID); under DDP it fixes each rank's threads first."""
    cfg = params.train
    if cfg.strategy == "ddp":
        set_threads_per_rank(cfg.devices)
    distributed = distributed_run_input(params)
    return run_inputs(__name__, params, PARAMS, data, environment, dvc_lock, settings, distributed)


def distributed_run_input(params: Params) -> dict:
    """What of the process layout decides the bits: the run inputs' ``distributed`` entry.

    The world size, backend and DDP options; in invariant mode only the mode and backend.
    """
    cfg = params.train
    if cfg.world_size_invariant:
        return {"strategy": "world_size_invariant", "backend": BACKENDS[cfg.accelerator]}
    return distributed_layout(cfg.strategy, cfg.accelerator, cfg.devices, cfg.num_nodes)


def _check_lock(lock: dict, mode: object, evidence: bool = False) -> None:
    """Fail closed on lock drift in ``true`` mode, unless ``--evidence`` asks to record it.

    Evidence mode is for measuring a host that was not built from the lock (a
    lent GPU machine with its own torch): the drift is printed here, and it is
    in the environment record, so in the run ID and run.json. dvc.yaml never
    passes ``--evidence``: the pipeline itself stays fail-closed.
    """
    if lock["exact"]:
        return
    drift = ", ".join(
        f"{d['package']} {d['installed']} (lock {d['locked']})" for d in lock["drift"]
    )
    message = (
        f"installed packages differ from {lock['file']}: {drift}; reinstall from the lock "
        "(`make venv`), or set deterministic: warn to train anyway"
    )
    if evidence:
        print(f"reprotrain train: evidence mode, recorded not refused: {message}", file=sys.stderr)
    else:
        refuse_or_warn(mode, message)


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


def fit(
    params: Params,
    data: PreparedData,
    settings: DeterminismSettings,
    checkpoint_dir: Path | None = None,
    identity: str | None = None,
    resume_from: Path | None = None,
    random_state: bool = True,
    tracer: TraceCallback | None = None,
    extra_callbacks: Sequence[L.Callback] = (),
) -> tuple[Classifier, MemoryLogger]:
    """Build the model and data module from ``params`` and fit them with Lightning.

    With ``checkpoint_dir``, a verified checkpoint is written at the end of
    every ``train.checkpoint_every_n_epochs``-th epoch (the newest one kept),
    and ``resume_from`` continues from one. The random state rides along
    unless ``random_state=False``, which exists for the negative control
    (resume then differs) and the overhead benchmark. A ``tracer`` records
    per-step fingerprints (its rows are checkpointed too); ``extra_callbacks``
    are for measurements (``benchmarks/``). Under DDP the
    ranks must agree on ``identity`` and ``resume_from`` before the first step.
    """
    cfg = params.train
    check_accelerator(params)
    ddp = cfg.strategy == "ddp"
    invariant = cfg.world_size_invariant
    module = Classifier(params.model, cfg, data.input_shape, data.num_classes)
    datamodule = PreparedDataModule(
        data,
        batch_size=params.data.batch_size,
        num_workers=params.data.num_workers,
        augment=params.data.augment,
        seed=params.seed,
        shard=ddp and not invariant,
        micro_batch_size=cfg.micro_batch_size if invariant else None,
    )
    strategy, accumulate = _strategy(params)
    logger = MemoryLogger()
    # Records ops only when REPROTRAIN_RECORD_OPS names steps (verify sets it); else inert.
    callbacks: list[L.Callback] = [*extra_callbacks, OpRecorder()]
    if ddp or invariant:
        facts = {"run_id": identity, "resume_from": resume_from and resume_from.name}
        callbacks.append(RankAgreement(facts, mode=settings.mode))
    if tracer is not None:
        callbacks.append(tracer)
    if checkpoint_dir is not None:
        generators = {"train_loader": datamodule.train_generator}
        callbacks += [
            RandomStateCallback(generators, run_id=identity, restore=random_state),
            CurveCheckpoint(logger),
            ModelCheckpoint(
                dirpath=checkpoint_dir,
                filename="epoch={epoch}",
                auto_insert_metric_name=False,
                save_top_k=1,
                every_n_epochs=cfg.checkpoint_every_n_epochs,
                enable_version_counter=False,
            ),
            InterruptCheckpoint(checkpoint_dir),
        ]
    # Lightning 2.6 trips over its own use of a deprecated torch pytree API on every fit,
    # and warns about the (expected) earlier checkpoints when a run resumes.
    warnings.filterwarnings("ignore", message=r".*LeafSpec.*is deprecated")
    warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
    # Validation covers the whole split on every rank (see data.py): nothing to all-reduce.
    warnings.filterwarnings("ignore", message=r"It is recommended to use `self.log\('val_")
    interactive = sys.stderr.isatty() and not os.environ.get("CI")
    if not interactive:
        logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
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
        callbacks=callbacks,
        plugins=[VerifiedCheckpointIO()],
        enable_checkpointing=checkpoint_dir is not None,
        enable_model_summary=False,
        enable_progress_bar=interactive,
        num_sanity_val_steps=0,
        **settings.trainer_flags(),
    )
    try:
        with _sigint_as_sigterm() as got:
            trainer.fit(module, datamodule=datamodule, ckpt_path=resume_from)
    except (SIGTERMException, RuntimeError) as err:
        # Lightning stops at the end of a batch after SIGTERM (SIGTERMException), or the
        # DataLoader-worker error comes first when the signal reached the workers too.
        if trainer.received_sigterm:
            _ignore_dead_loader_workers()
            raise Interrupted(_interrupted(checkpoint_dir, got["signal"])) from None
        explained = explain_nondeterministic_error(err)  # type: ignore[arg-type]
        if explained is None:
            raise
        raise explained from None
    return module, logger


def _strategy(params: Params) -> tuple[Strategy | str, int]:
    """Lightning's strategy for ``train.strategy`` (and the mode), and its accumulation."""
    cfg = params.train
    if cfg.world_size_invariant:
        micro_batches = params.data.batch_size // cfg.micro_batch_size
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


def _interrupted(checkpoint_dir: Path | None, name: str) -> str:
    kept = None
    if checkpoint_dir is not None and checkpoint_dir.is_dir():
        kept = latest_checkpoint(checkpoint_dir)
    where = (
        f"its last checkpoint, {kept.name}, is kept" if kept else "no checkpoint was written yet"
    )
    return (
        f"training interrupted ({name}); {where}: rerun the same "
        "command or `dvc repro` to resume, with the same bits as an uninterrupted run"
    )


def _write_outputs(
    args: argparse.Namespace,
    params: Params,
    data: PreparedData,
    settings: DeterminismSettings,
    module: Classifier,
    logger: MemoryLogger,
) -> dict[str, Path]:
    weights = {name: t.detach().cpu().contiguous() for name, t in module.net.state_dict().items()}
    if params.train.world_size_invariant:
        # The layout did not decide these weights: record it as one process, so the file is
        # the same at any world size (run.json's inputs name the mode).
        one = dataclasses.replace(params.train, devices=1, num_nodes=1, strategy="single_device")
        params = dataclasses.replace(params, train=one)
    metadata = safetensors_metadata(
        {
            "params": dataclasses.asdict(params),
            "input_shape": list(data.input_shape),
            "num_classes": data.num_classes,
            "determinism": settings.as_dict(),
        }
    )
    val_loss, val_acc = logger.rows("val_loss"), logger.rows("val_acc")
    train_loss = logger.rows("train_loss")
    metrics = {
        "epochs": len(val_loss),
        "steps": len(train_loss),
        "train_loss": train_loss[-1][1],
        "val_loss": val_loss[-1][1],
        "val_acc": val_acc[-1][1],
    }
    atomic_write_safetensors(args.model, weights, metadata)
    atomic_write_text(args.metrics, canonical_json(metrics))
    atomic_write_text(args.plots / "train_loss.csv", _csv(("step", "train_loss"), train_loss))
    val_rows = [
        (epoch, loss, acc)
        for epoch, ((_, loss), (_, acc)) in enumerate(zip(val_loss, val_acc, strict=True))
    ]
    atomic_write_text(args.plots / "val.csv", _csv(("epoch", "val_loss", "val_acc"), val_rows))
    return {"model": args.model, "metrics": args.metrics}


def _csv(header: tuple[str, ...], rows: list[tuple[float, ...]]) -> str:
    lines = [",".join(header)] + [",".join(repr(v) for v in row) for row in rows]
    return "\n".join(lines) + "\n"
