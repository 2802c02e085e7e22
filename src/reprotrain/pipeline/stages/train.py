"""Stage ``train``: the model and data params name -> ``model.safetensors``, metrics, run record.

Reads top to bottom: resolve the model and data module params.yaml names
(:mod:`reprotrain.pipeline.recipe`: imported, type-checked, no object built)
and check them against the contract (:mod:`reprotrain.pipeline.contract`);
configure determinism (before anything touches CUDA); refuse a drifted lock
in ``true`` mode; check the data files
(``--data``) against the checksums DVC recorded and compute the run ID, which
covers the recipe's resolved arguments and code; resume from this run ID's
newest verified checkpoint if an earlier attempt was interrupted (or refuse,
naming it, one interrupted with another ``num_workers`` where that count
decides the bits); fit with
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
import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from reprotrain.determinism import DeterminismSettings, configure_determinism, refuse_or_warn
from reprotrain.pipeline.command import Command, add_data_files, add_paths
from reprotrain.pipeline.config import Params
from reprotrain.pipeline.run_record import load_environment, run_inputs, write_run_record
from reprotrain.provenance.identity import run_id

if TYPE_CHECKING:  # jsonargparse and Lightning load when the stage runs
    from reprotrain.pipeline.recipe import Recipe

#: The params.yaml keys this stage reads; dvc.yaml lists exactly these. The process
#: layout (train.devices, train.num_nodes, train.strategy) and cpu.threads reach the
#: cache key through the environment record, only when they decide the bits (threads:
#: under cpu.profile native, not portable).
PARAMS = (
    "seed",
    "deterministic",
    "cpu.profile",
    "model",
    "data",
    "train.max_epochs",
    "train.checkpoint_every_n_epochs",
    "train.trace",
    "train.accelerator",
    "train.precision",
    "train.world_size_invariant",
    "train.micro_batch_size",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_data_files(parser, "checked against --dvc-lock and hashed into the run ID")
    required = {
        "model": "weights to write",
        "metrics": "training metrics JSON",
        "plots": "folder for curve CSVs",
        "env": "environment record (env stage)",
        "run-record": "run.json to write",
        "checkpoints": "checkpoint folder",
    }
    add_paths(parser, required, required=True)
    optional = {
        "trace": "per-step trace to write (read by compare)",
        "dvc-lock": "verify each --data file against this dvc.lock",
    }
    add_paths(parser, optional, required=False)
    parser.add_argument(
        "--evidence",
        action="store_true",
        help="record drift from the lock instead of refusing it, for measurements on a host "
        "not built from the lock (benchmarks/gpu/gpu_evidence.py); never used by dvc.yaml",
    )


COMMAND = Command(
    "train the model deterministically", add_arguments, takes_params=True, restarts=True
)


def run(params: Params, args: argparse.Namespace) -> str:
    """Train; on any failure under ``dvc repro``, the earlier outputs DVC deleted are put back
    (:mod:`reprotrain.pipeline.kept`) and the error says so."""
    from reprotrain.pipeline.kept import drop, note_put_back, put_back, train_outputs

    first = os.environ.get("LOCAL_RANK", "0") == "0"  # one process per machine restores
    try:
        done = _train(params, args)
    except BaseException as err:
        if first and (restored := put_back(train_outputs(args))):
            note_put_back(err, restored)
        raise
    if first:
        drop(train_outputs(args))
    return done


def _train(params: Params, args: argparse.Namespace) -> str:
    # torch and Lightning load here, not with the module: the CLI reads this one for its options.
    from reprotrain.distributed.ddp import this_rank
    from reprotrain.pipeline.contract import (
        check_data_files,
        check_prepare_data,
        check_recipe,
        check_world_size_invariance,
    )
    from reprotrain.pipeline.recipe import resolve_recipe
    from reprotrain.pipeline.resume_point import (
        Checkpointing,
        find_resume_point,
        refuse_another_worker_count,
        workers_stamp,
    )
    from reprotrain.pipeline.train_files import write_outputs
    from reprotrain.pipeline.training import fit
    from reprotrain.trace.callback import TraceCallback

    recipe = resolve_recipe(params)  # bad input first: one line, nothing written
    check_recipe(params, recipe, scores=False)  # the evaluate stage checks its own needs
    check_data_files(recipe, args.data)
    check_prepare_data(recipe, args.data)
    # The env stage makes this check where the data module can set up there; here it is
    # the one line before any rank starts (verify's world-size runs skip the env stage).
    check_world_size_invariance(params, recipe)
    settings = configure_determinism(params.seed, params.deterministic, params.cpu.to_profile())
    environment = load_environment(args.env)
    _check_lock(environment["lock"], params.deterministic, args.evidence)
    inputs = stage_inputs(params, recipe, args.data, environment, args.dvc_lock, settings)
    identity = run_id(inputs)
    run_dir = args.checkpoints / identity
    resume_from = find_resume_point(run_dir, identity)
    workers = workers_stamp(inputs)
    if resume_from is None:
        refuse_another_worker_count(args.checkpoints, identity, workers)
    tracer = TraceCallback(None, detail=params.train.trace) if args.trace else None
    checkpointing = Checkpointing(run_dir, identity, resume_from, workers=workers)
    fitted = fit(params, recipe, settings, checkpointing, [tracer] if tracer else [])
    resumed = f", resumed from {resume_from.name}" if resume_from else ""
    if (rank := this_rank()) != 0:
        return f"rank {rank} trained run {identity[:12]}{resumed}; rank 0 writes"

    outputs = write_outputs(args, params, recipe, settings, fitted)
    if tracer is not None:
        tracer.write(args.trace)
        outputs["trace"] = args.trace
    write_run_record(args.run_record, inputs, outputs)
    shutil.rmtree(run_dir, ignore_errors=True)
    return f"trained -> {args.model}, run {identity[:12]}{resumed}"


def stage_inputs(
    params: Params,
    recipe: Recipe,
    data: list[Path],
    environment: dict,
    dvc_lock: Path | None,
    settings: DeterminismSettings,
) -> dict:
    """This stage's run inputs (so its run ID); under DDP it fixes each rank's threads first.

    The code hash covers this module and every ``reprotrain`` module it imports,
    those imported inside its functions too (:mod:`reprotrain.pipeline.training`),
    and the recipe's code (:func:`reprotrain.pipeline.recipe_code.code_files`).
    """
    from reprotrain.distributed.ddp import set_threads_per_rank

    cfg = params.train
    if cfg.strategy == "ddp":
        set_threads_per_rank(cfg.devices)
    distributed = distributed_run_input(params)
    return run_inputs(
        __name__, params, PARAMS, recipe, data, environment, dvc_lock, settings, distributed
    )


def distributed_run_input(params: Params) -> dict:
    """What of the process layout decides the bits: the run inputs' ``distributed`` entry.

    The world size, backend and DDP options; in invariant mode only the mode and backend.
    """
    from reprotrain.distributed.ddp import BACKENDS, distributed_layout

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
