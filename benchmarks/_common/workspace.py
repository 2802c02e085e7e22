"""Shared benchmark plumbing: the workload, its data, and timed trainings in fresh processes.

The workload is a recipe's params file (``--workload``): the language-model
transformer (``pipelines/lm/params.yaml``) by default, as for every benchmark
from issue 29 on; ``--workload digits`` trains the digits CNN (``params.yaml``),
on which the figures measured before then were taken (each names its command).

:func:`train_workspace` is for in-process benchmarks (the ``train`` stage's
arguments in a temporary folder, the data prepared there where the recipe has
a ``prepare`` step). For DDP benchmarks every training is a fresh process
(Lightning starts the other ranks by rerunning the script):
:func:`timed_training` launches one and reads its result, and the script's
worker side calls :func:`time_training`, which prints rank 0's median
seconds per optimizer step (:class:`~benchmarks._common.step_timer.StepTimer`,
the first epoch left out).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import tempfile
from collections.abc import Iterator
from pathlib import Path

from benchmarks._common.child import run_json
from benchmarks._common.step_timer import StepTimer
from benchmarks._common.workloads import ROOT, WORKLOADS
from reprotrain.determinism import configure_determinism
from reprotrain.distributed.ddp import set_threads_per_rank, this_rank
from reprotrain.hashing import canonical_json
from reprotrain.pipeline import training
from reprotrain.pipeline.config import Params
from reprotrain.pipeline.params_file import load_params
from reprotrain.pipeline.prepared import save_prepared
from reprotrain.pipeline.rawdata import load_raw
from reprotrain.pipeline.recipe import resolve_recipe
from reprotrain.pipeline.stages import prepare
from reprotrain.pipeline.stages.env import record_environment
from reprotrain.pipeline.training import fit
from tests.helpers import cli_env


def add_workload_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workload",
        choices=tuple(WORKLOADS),
        default="lm",
        help="the recipe trained: 'lm' the language-model transformer (pipelines/lm/"
        "params.yaml, the default), 'digits' the digits CNN (params.yaml)",
    )


def workload_params(workload: str, overrides: list[str] | None = None) -> Params:
    return load_params(WORKLOADS[workload], overrides or [])


def with_data(params: Params, **init_args: object) -> Params:
    """``params`` with these of its data module's ``init_args`` replaced."""
    init_args = {**params.data.init_args, **init_args}
    return dataclasses.replace(params, data=dataclasses.replace(params.data, init_args=init_args))


def prepare_into(params: Params, folder: Path) -> Path | None:
    """The recipe's data prepared into ``folder``, where it has a ``prepare`` step (a
    recipe without one reads its own data)."""
    if params.prepare is None:
        return None
    x, y, source = load_raw(params.prepare.source, folder)
    data = folder / "data.safetensors"
    save_prepared(data, prepare.split(x, y, params.prepare, params.seed, source))
    return data


def data_overrides(data: Path | None) -> list[str]:
    """The overrides that point the data module at the prepared file (none without one)."""
    return [] if data is None else [f"data.init_args.path={data}"]


@contextlib.contextmanager
def train_workspace(params: Params) -> Iterator[tuple[argparse.Namespace, Params]]:
    """The `train` stage's arguments, pointing into a temporary folder, and ``params``
    reading the data prepared there (``args.data``: that file, if the recipe has one)."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = prepare_into(params, work)
        if data is not None:
            params = with_data(params, path=str(data))
        environment = record_environment(ROOT / "requirements-cpu.lock")
        (work / "environment.json").write_text(canonical_json(environment))
        args = argparse.Namespace(
            data=[] if data is None else [data],
            model=work / "model.safetensors",
            metrics=work / "metrics.json",
            plots=work / "plots",
            env=work / "environment.json",
            run_record=work / "run.json",
            checkpoints=work / "checkpoints",
            dvc_lock=None,
            trace=None,
            evidence=False,
        )
        yield args, params


@contextlib.contextmanager
def prepared_data(params: Params) -> Iterator[list[str]]:
    """The recipe's data prepared into a temporary folder; the overrides that read it."""
    with tempfile.TemporaryDirectory() as tmp:
        yield data_overrides(prepare_into(params, Path(tmp)))


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    """The hidden flags by which a benchmark script reruns itself as a training worker."""
    parser.add_argument("--train", choices=tuple(WORKLOADS), help=argparse.SUPPRESS)
    parser.add_argument("--set", action="append", default=[], help=argparse.SUPPRESS)
    parser.add_argument("--accumulate", type=int, default=1, help=argparse.SUPPRESS)


def timed_training(script: str, workload: str, overrides: list[str], accumulate: int = 1) -> dict:
    """Run ``script --train WORKLOAD --set ...`` afresh; what its :func:`time_training` printed.

    ``accumulate``: Lightning's ``accumulate_grad_batches`` for plain training (params
    have no such key: the pipeline accumulates only in the world-size-invariant mode).
    """
    argv = [script, "--train", workload, *(f"--set={o}" for o in overrides)]
    argv.append(f"--accumulate={accumulate}")
    return run_json(argv, f"training {overrides}", env=cli_env(PYTHONHASHSEED="0"))


def time_training(workload: str, overrides: list[str], accumulate: int = 1) -> None:
    """Worker side: fit the workload with ``overrides``; rank 0 prints its median step as JSON."""
    params = workload_params(workload, overrides)
    if accumulate > 1:
        if params.train.world_size_invariant:
            raise SystemExit("--accumulate is for plain training; the mode sets its own")
        plain_strategy = training._strategy
        training._strategy = lambda *args: (plain_strategy(*args)[0], accumulate)
    settings = configure_determinism(params.seed, params.deterministic)
    threads = set_threads_per_rank(params.train.devices)
    timer = StepTimer(from_epoch=1)  # the first epoch is warm-up
    fit(params, resolve_recipe(params), settings, callbacks=[timer])
    if this_rank() == 0:
        step = statistics.median(timer.seconds)
        print(json.dumps({"step_s": step, "steps": len(timer.seconds), "threads": threads}))
