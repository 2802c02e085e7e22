"""The timed part of ``reprotrain bench``: workloads, modes, step times (imports torch).

:mod:`reprotrain.commands.bench` states what is measured and reports it; this
module sets a mode's flags in place (they are process-global), builds the two
workloads from the same initial weights and batches for every mode, and times
steps: forward, backward and the optimizer, with CUDA synchronised around each
so a step's time is its own. A LightningModule's steps are a Lightning
Trainer's (what the module configures runs as it would in a fit); a bare
network's, a plain loop. Warm-up steps absorb cuDNN's autotuning.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from reprotrain.commands._rerun import ensure_prepared
from reprotrain.pipeline.command import stage_arguments
from reprotrain.pipeline.config import Params
from reprotrain.pipeline.recipe import build, resolve_recipe

#: Mode -> (deterministic algorithms and cudnn.deterministic, cudnn.benchmark).
MODES = {
    "deterministic": (True, False),
    "default": (False, True),
    "default_no_autotune": (False, False),
}

Batches = list[tuple[torch.Tensor, torch.Tensor]]
#: A fresh model and its optimizer; None: a LightningModule, trained by a Trainer.
Setup = Callable[[], tuple[nn.Module, torch.optim.Optimizer | None]]


def set_mode(mode: str) -> None:
    """The flags ``mode`` sets, as ``configure_determinism`` sets them (torch's fill of fresh
    tensors off: :data:`reprotrain.determinism.SETTING_REASONS`)."""
    deterministic, benchmark = MODES[mode]
    torch.use_deterministic_algorithms(deterministic)
    torch.utils.deterministic.fill_uninitialized_memory = False
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cudnn.benchmark = benchmark


@contextlib.contextmanager
def modes_restored() -> Iterator[None]:
    """Put the determinism flags back as they were, whatever mode the runs left."""
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.utils.deterministic.fill_uninitialized_memory,
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0])
        torch.utils.deterministic.fill_uninitialized_memory = saved[1]
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[2:]


class SpatialMean(nn.Module):
    """Global average pooling as a mean (adaptive pooling's CUDA backward has no
    deterministic kernel; a mean's backward is a broadcast)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=(2, 3))


def conv_network(channels: int, width: int, classes: int = 10) -> nn.Module:
    layers: list[nn.Module] = []
    widths = [channels, width, 2 * width, 4 * width, 4 * width]
    for i, (c_in, c_out) in enumerate(itertools.pairwise(widths)):
        stride = 2 if i in (1, 2) else 1
        layers += [nn.Conv2d(c_in, c_out, 3, stride, 1), nn.BatchNorm2d(c_out), nn.ReLU()]
    return nn.Sequential(*layers, SpatialMean(), nn.Linear(widths[-1], classes))


def conv_workload(args: argparse.Namespace, device: torch.device) -> tuple[Setup, Batches]:
    g = torch.Generator().manual_seed(0)
    shape = (args.batch_size, args.channels, args.image_size, args.image_size)
    batches = [
        (
            torch.randn(shape, generator=g).to(device),
            torch.randint(0, 10, shape[:1], generator=g).to(device),
        )
        for _ in range(4)
    ]

    def setup() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        net = conv_network(args.channels, args.width).to(device)
        return net, torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)

    return setup, batches


def pipeline_workload(
    params: Params, dvc_yaml: Path | None, device: torch.device
) -> tuple[Setup, Batches]:
    """The model and data params names: its first four training batches (in dataset order).

    ``dvc_yaml``: the pipeline whose train stage's data files are prepared first where
    missing; ``None`` (or no such file) for data the recipe reads itself.
    """
    # Lightning here, not at the top: the conv workload (and so `bench --workload conv`
    # and its children) trains without it and skips its import.
    from lightning.fabric.utilities.apply_func import move_data_to_device

    from reprotrain.pipeline.data import first_batches

    # Inside a pipeline: its data files, prepared if missing.
    if dvc_yaml is not None and dvc_yaml.is_file():
        for path in stage_arguments("train", dvc_yaml).data:
            ensure_prepared(path, "bench")
    recipe = resolve_recipe(params)
    source, _, linked = build(recipe)
    batches = [move_data_to_device(batch, device) for batch in first_batches(source, 4)]

    def setup() -> tuple[nn.Module, None]:
        torch.manual_seed(params.seed)
        return recipe.model.instantiate(**linked), None  # the Trainer sets it up

    return setup, batches


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_run(
    setup: Setup, batches: Batches, steps: int, warmup: int, device: torch.device
) -> float:
    """Median seconds per training step (forward, backward, optimizer) of one fresh run.

    A LightningModule's step is a Lightning Trainer's, as the module configures it; a bare
    network's, cross-entropy and the optimizer ``setup`` gave.
    """
    return timed_training(setup, batches, steps, warmup, device)[0]


def timed_training(
    setup: Setup, batches: Batches, steps: int, warmup: int, device: torch.device
) -> tuple[float, nn.Module]:
    """:func:`time_run`'s median step time, and the model those steps trained."""
    model, optimizer = setup()
    if optimizer is None:
        times = _lightning_step_times(model, batches, steps, warmup, device)
        return statistics.median(times), model
    model.train()
    times = []
    for step in range(warmup + steps):
        batch = batches[step % len(batches)]
        _sync(device)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(batch[0]), batch[1]).backward()
        optimizer.step()
        _sync(device)
        if step >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times), model


class _Cycled:
    """``batches`` over and over, ``count`` in all: a training loader of known length."""

    def __init__(self, batches: Batches, count: int) -> None:
        self.batches, self.count = batches, count

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return (self.batches[i % len(self.batches)] for i in range(self.count))


def _lightning_step_times(
    module: nn.Module, batches: Batches, steps: int, warmup: int, device: torch.device
) -> list[float]:
    """Each timed step of ``module`` trained by a Lightning Trainer on ``batches``, from
    the start of a batch to its end (optimizer, schedulers and logging as the module
    configures them, ``self.trainer`` there), with the device synchronised at both ends.

    The Trainer leaves the determinism flags as the mode set them, runs no validation and
    writes nothing (its root, where a module's own ModelCheckpoint would write, is a
    temporary folder). It runs one epoch of ``warmup + steps`` batches, not ``max_steps``,
    which counts each optimizer's step (two a batch for a GAN stepped by hand)."""
    import lightning as L

    class StepTimer(L.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.start = 0.0

        def on_train_batch_start(self, *_: object) -> None:
            _sync(device)
            self.start = time.perf_counter()

        def on_train_batch_end(self, *_: object) -> None:
            _sync(device)
            self.times.append(time.perf_counter() - self.start)

    timer = StepTimer()
    with tempfile.TemporaryDirectory(prefix="reprotrain-bench-") as root:
        trainer = L.Trainer(
            accelerator="gpu" if device.type == "cuda" else "cpu", devices=1, max_epochs=1,
            limit_val_batches=0, num_sanity_val_steps=0, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            deterministic=None, benchmark=None, callbacks=[timer], default_root_dir=root,
        )  # fmt: skip
        with warnings.catch_warnings():  # its loader is ours, not the module's; no workers
            warnings.simplefilter("ignore")
            trainer.fit(module, train_dataloaders=_Cycled(batches, warmup + steps))
    if len(timer.times) != warmup + steps:
        raise RuntimeError(
            f"the Trainer stopped after {len(timer.times)} of {warmup + steps} batches "
            "(the module stopped the fit); nothing to time"
        )
    return timer.times[warmup:]


def paired_step_times(
    setup: Setup, batches: Batches, args: argparse.Namespace, device: torch.device
) -> dict[str, list[float]]:
    """Each repeat's median step time per mode, the modes' order alternating between repeats.

    A mode that cannot run raises the RuntimeError with the mode's name in front.
    """
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for repeat in range(args.repeats):
        order = list(MODES) if repeat % 2 == 0 else list(reversed(MODES))
        for mode in order:
            set_mode(mode)
            try:
                times[mode].append(time_run(setup, batches, args.steps, args.warmup, device))
            except RuntimeError as err:
                raise RuntimeError(f"{mode} mode: {err}") from err
    return times
