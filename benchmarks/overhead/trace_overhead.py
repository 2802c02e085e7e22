"""Step time with and without TraceCallback, for the pipeline's model and a ~10M-parameter MLP.

One process, interleaved fits (off, default, full, off, default, full, ...)
after one warm-up fit of each, same seed and determinism flags throughout.
Step time is measured by a callback placed before the trace: the time from
one training batch's start to the next one's in the same epoch, so it holds
every per-step cost of tracing (hooks, fingerprints, the weight rows every
``weights_every`` steps) and none of validation or start-up. Reported: the
median and the minimum over fits of each fit's mean step time, each with
its ratio to tracing off (the minimum is the least disturbed by another
process on the machine); and, because those ratios still move by several
percent on a shared machine, the time spent inside the trace's hooks per
step (median over fits), with ``1 + hook time / median untraced step``.
That figure also holds the work the trace defers: on CPU it hashes its rows'
RNG states and fingerprints their batches every 64 rows, which a 60-step fit
leaves to its end, outside every step's window (the step ratios miss it).
The pipeline model loads data in the main process (``--workers 0``): worker
processes on 2 cores add noise that has nothing to do with tracing.
``--threads 1`` trains on one thread, which a shared machine disturbs far
less (two threads stall at every barrier while the other core is busy).
Targets: default detail at most 1.02 on the pipeline model, 1.03 on the 10M one.

Measured on the shared 2-core machine with ``--repeats 5`` and ``--repeats
7 --mlp-steps 0 --threads 1``, two runs, the pipeline model at default
detail: 0.154-0.160 ms in the trace per 9.8 ms step, 1 + hook/off 1.016,
median step ratio 0.982-1.017, minimum 1.021-1.024 (0.19-0.28 ms, 1.021-1.025
while the RNG states were read with getstate/get_state; 0.82-0.96 ms,
1.069-1.080, before rows on CPU became Python ints hashed per 64 rows); full
detail 0.55 ms (3.1 ms at first). What is left is copying the batch and
Lightning's hook calls. The 10M MLP (``--repeats 5 --threads 1``, a second
benchmark beside it): 4.2 ms in hooks per 100 ms step, 1.040 (13.7 ms
when its weight rows went through torch's int8 matmul at 0.2 GB/s; now a
float32 GEMM, about 0.6 GB/s), still above the 1.03 target.

    .venv/bin/python benchmarks/overhead/trace_overhead.py [--repeats 5] [--epochs 3]
        [--mlp-steps 64] [--steps N] [--threads N] [--accelerator cpu|gpu] [--json PATH]
        [--workload lm|digits]
"""

from __future__ import annotations

import argparse
import itertools
import logging
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # python benchmarks/<group>/<script>.py: import from the root

from benchmarks._common.step_timer import StepTimer
from benchmarks._common.workspace import (
    add_workload_argument,
    train_workspace,
    with_data,
    workload_params,
)
from reprotrain.atomic import atomic_write_text
from reprotrain.determinism import configure_determinism, reexec_with_fixed_hash_seed
from reprotrain.hashing import canonical_json
from reprotrain.pipeline.data import PipelineLoaders
from reprotrain.pipeline.recipe import build, resolve_recipe
from reprotrain.trace.callback import DEFAULT_WEIGHTS_EVERY, TraceCallback

MODES = ("off", "default", "full")


class MLP(L.LightningModule):
    """1024 -> 2048 -> 2048 -> 1536 -> 10 with ReLU: 9.46M parameters, Adam."""

    def __init__(self) -> None:
        super().__init__()
        widths = (1024, 2048, 2048, 1536)
        layers: list[nn.Module] = []
        for width_in, width_out in itertools.pairwise(widths):
            layers += [nn.Linear(width_in, width_out), nn.ReLU()]
        self.net = nn.Sequential(*layers, nn.Linear(widths[-1], 10))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class TimedTrace(TraceCallback):
    """TraceCallback that also adds up the wall time of its per-step work.

    That is the time inside its per-step hooks, and at the end of fit the
    time to finish the rows the hooks left for later (``_local_state``: the
    batched hashing that a short fit leaves to its end).
    """

    seconds = 0.0

    def _local_state(self) -> dict[str, Any]:
        start = time.perf_counter()
        state = super()._local_state()
        self.seconds += time.perf_counter() - start
        return state

    def on_train_batch_start(self, *args: Any) -> None:
        start = time.perf_counter()
        super().on_train_batch_start(*args)
        self.seconds += time.perf_counter() - start

    def on_before_optimizer_step(self, *args: Any) -> None:
        start = time.perf_counter()
        super().on_before_optimizer_step(*args)
        self.seconds += time.perf_counter() - start

    def on_train_batch_end(self, *args: Any) -> None:
        start = time.perf_counter()
        super().on_train_batch_end(*args)
        self.seconds += time.perf_counter() - start


def timed_fit(
    build: Callable[[], tuple[L.LightningModule, Any]],
    mode: str,
    epochs: int,
    work: Path,
    accelerator: str,
    steps: int | None = None,
) -> tuple[float, float]:
    """(mean step time, mean time inside the trace hooks per step) of one fit of ``epochs``
    epochs of at most ``steps`` batches each (None: whole epochs)."""
    settings = configure_determinism(42, True)
    module, data = build()
    timer = StepTimer(edge="start")  # before the trace: its batch-start hook is in
    trace = TimedTrace(
        work / f"trace-{mode}.safetensors", detail="full" if mode == "full" else "default"
    )
    callbacks: list[L.Callback] = [timer] if mode == "off" else [timer, trace]
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=1,
        max_epochs=epochs,
        limit_train_batches=steps or 1.0,
        limit_val_batches=steps or 1.0,  # validation is not timed
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        **settings.trainer_flags(),
    )
    if isinstance(data, DataLoader):
        trainer.fit(module, data)
    else:
        trainer.fit(module, datamodule=data)
    steps = trainer.global_step
    return statistics.fmean(timer.seconds), trace.seconds / steps


def measure(
    name: str,
    build: Callable[[], tuple[Any, Any]],
    epochs: int,
    repeats: int,
    accelerator: str,
    steps: int | None = None,
) -> dict[str, Any]:
    """Print the table for one model; return its figures (ratios to tracing off)."""
    with tempfile.TemporaryDirectory() as tmp:
        for mode in MODES:  # warm-up: thread pools, allocator, first-call costs
            timed_fit(build, mode, epochs, Path(tmp), accelerator, steps)
        runs: dict[str, list[tuple[float, float]]] = {mode: [] for mode in MODES}
        for _ in range(repeats):
            for mode in MODES:
                runs[mode].append(timed_fit(build, mode, epochs, Path(tmp), accelerator, steps))
    step = {mode: statistics.median(s for s, _ in values) for mode, values in runs.items()}
    low = {mode: min(s for s, _ in values) for mode, values in runs.items()}
    print(f"{name}: {repeats} interleaved repeats")
    print(
        "  mode     median step ms  ratio | min step ms  ratio |"
        " in-hook ms/step  1 + hook/median off | step ms per fit"
    )
    for mode in MODES:
        hook = statistics.median(h for _, h in runs[mode])
        each = ", ".join(f"{s * 1e3:.1f}" for s, _ in runs[mode])
        print(
            f"  {mode:8s} {step[mode] * 1e3:14.2f}  {step[mode] / step['off']:.3f} |"
            f" {low[mode] * 1e3:11.2f}  {low[mode] / low['off']:.3f} |"
            f" {hook * 1e3:15.3f}  {1 + hook / step['off']:19.3f} | {each}"
        )
    return {
        "model": name,
        "repeats": repeats,
        "median_step_ms": {mode: step[mode] * 1e3 for mode in MODES},
        "ratio_to_off": {mode: step[mode] / step["off"] for mode in MODES},
        "hook_ms_per_step": {
            mode: statistics.median(h for _, h in runs[mode]) * 1e3 for mode in MODES
        },
    }


def measure_mlp(steps: int, repeats: int, accelerator: str) -> dict[str, Any]:
    """The ~10M-parameter MLP, ``steps`` batches of 64 per fit."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64 * steps, 1024, generator=gen)
    y = torch.randint(0, 10, (len(x),), generator=gen)

    def mlp() -> tuple[L.LightningModule, Any]:
        loader = DataLoader(
            TensorDataset(x, y),
            batch_size=64,
            shuffle=True,
            generator=torch.Generator().manual_seed(0),
        )
        return MLP(), loader

    size = sum(p.numel() for p in MLP().parameters())
    name = f"MLP ({size:,} parameters, batch 64, Adam)"
    return measure(name, mlp, 1, repeats, accelerator)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=3, help="epochs of the pipeline model")
    parser.add_argument("--mlp-steps", type=int, default=64, help="steps per MLP fit (0: no MLP)")
    parser.add_argument(
        "--steps", type=int, help="at most this many batches per epoch, train and val (a dry run)"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--workers", type=int, default=0, help="pipeline DataLoader workers")
    parser.add_argument("--accelerator", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--json", type=Path, help="also write the figures here as JSON")
    add_workload_argument(parser)
    cli = parser.parse_args()
    reexec_with_fixed_hash_seed()
    if cli.threads:
        torch.set_num_threads(cli.threads)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")  # Lightning's advice on workers and deprecations
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"TraceCallback default weights_every={DEFAULT_WEIGHTS_EVERY}")  # fmt: skip

    with train_workspace(workload_params(cli.workload)) as (_, params):
        params = with_data(params, num_workers=cli.workers)
        recipe = resolve_recipe(params)
        source, _, linked = build(recipe)  # the data module, set up once

        def pipeline_model() -> tuple[L.LightningModule, Any]:
            module = recipe.model.instantiate(**linked)
            return module, PipelineLoaders(source, seed=params.seed)

        size = sum(p.numel() for p in pipeline_model()[0].parameters())
        model = recipe.model.class_path.rpartition(".")[2]
        name = f"pipeline {model} ({size:,} parameters, default params, {cli.workers} workers)"
        results = [
            measure(name, pipeline_model, cli.epochs, cli.repeats, cli.accelerator, cli.steps)
        ]

    if cli.mlp_steps > 0:
        results.append(measure_mlp(cli.mlp_steps, cli.repeats, cli.accelerator))
    if cli.json:
        report = {"accelerator": cli.accelerator, "torch": torch.__version__, "models": results}
        atomic_write_text(cli.json, canonical_json(report))


if __name__ == "__main__":
    main()
