"""Shared benchmark plumbing: prepared default data, and timed trainings in fresh processes.

:func:`train_workspace` is for in-process benchmarks (the ``train`` stage's
arguments in a temporary folder). For DDP benchmarks every training is a
fresh process (Lightning starts the other ranks by rerunning the script):
:func:`timed_training` launches one and reads its result, and the script's
worker side calls :func:`time_training`, which prints rank 0's median
seconds per optimizer step (:class:`StepTimer`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import lightning as L

from reprotrain.determinism import configure_determinism
from reprotrain.distributed.ddp import set_threads_per_rank, this_rank
from reprotrain.hashing import canonical_json
from reprotrain.pipeline.config import Params, load_params
from reprotrain.pipeline.data import save_prepared
from reprotrain.pipeline.rawdata import load_raw
from reprotrain.pipeline.recipe import resolve_recipe
from reprotrain.pipeline.stages import prepare
from reprotrain.pipeline.stages.env import record_environment
from reprotrain.pipeline.training import fit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.helpers import cli_env  # noqa: E402


def with_data(params: Params, path: Path, **init_args: object) -> Params:
    """``params`` with the data module reading ``path`` (its ``init_args.path``), and with
    any other of its ``init_args`` given here."""
    init_args = {**params.data.init_args, "path": str(path), **init_args}
    return dataclasses.replace(params, data=dataclasses.replace(params.data, init_args=init_args))


@contextlib.contextmanager
def train_workspace(params: Params) -> Iterator[argparse.Namespace]:
    """Yield the `train` stage's arguments, pointing into a prepared temporary folder.

    The prepared file is ``args.data[0]``; the stage reads what ``data.init_args.path``
    names, so train with :func:`with_data` ``(params, args.data[0])``.
    """
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        x, y, source = load_raw(params.prepare.source, work)
        save_prepared(
            work / "data.safetensors", prepare.split(x, y, params.prepare, params.seed, source)
        )
        environment = record_environment(ROOT / "requirements-cpu.lock")
        (work / "environment.json").write_text(canonical_json(environment))
        yield argparse.Namespace(
            data=[work / "data.safetensors"],
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


@contextlib.contextmanager
def prepared_data() -> Iterator[Path]:
    """The default data, prepared by `reprotrain prepare` into a temporary folder."""
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data.safetensors"
        argv = [sys.executable, "-m", "reprotrain", "prepare", "--raw-dir", tmp, "--out", data]
        subprocess.run(argv, cwd=ROOT, env=cli_env(), check=True, capture_output=True)
        yield data


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    """The hidden flags by which a benchmark script reruns itself as a training worker."""
    parser.add_argument("--train", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--set", action="append", default=[], help=argparse.SUPPRESS)


def timed_training(script: str, data: Path, overrides: list[str]) -> dict:
    """Run ``script --train DATA --set ...`` afresh; the JSON its :func:`time_training` printed."""
    argv = [sys.executable, script, "--train", str(data), *(f"--set={o}" for o in overrides)]
    done = subprocess.run(
        argv, env=cli_env(PYTHONHASHSEED="0"), capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"training {overrides} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


class StepTimer(L.Callback):
    """Seconds from one optimizer step to the next, within every epoch after the first.

    Data loading and the forward and backward passes of all the step's
    micro-batches are in; validation and an epoch's DataLoader start are not.
    """

    def __init__(self) -> None:
        self.per_step: list[float] = []
        self._last: float | None = None
        self._step = 0

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._last, self._step = None, trainer.global_step

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step == self._step:  # a micro-batch that did not end a step
            return
        now, self._step = time.perf_counter(), trainer.global_step
        if self._last is not None and trainer.current_epoch > 0:
            self.per_step.append(now - self._last)
        self._last = now


def time_training(data: Path, overrides: list[str]) -> None:
    """Worker side: fit params.yaml with ``overrides``; rank 0 prints its median step as JSON."""
    params = with_data(load_params(ROOT / "params.yaml", overrides), data)
    settings = configure_determinism(params.seed, params.deterministic)
    threads = set_threads_per_rank(params.train.devices)
    timer = StepTimer()
    fit(params, resolve_recipe(params), settings, callbacks=[timer])
    if this_rank() == 0:
        step = statistics.median(timer.per_step)
        print(json.dumps({"step_s": step, "steps": len(timer.per_step), "threads": threads}))
