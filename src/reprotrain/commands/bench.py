"""``reprotrain bench``: what determinism costs in step time, paired and interleaved.

Two workloads, each trained for ``--steps`` timed steps (after ``--warmup``
untimed ones) from the same initial weights and batches, in three modes per
repeat, the order alternating between repeats:

* ``deterministic``: ``use_deterministic_algorithms(True)``,
  ``cudnn.deterministic=True``, ``cudnn.benchmark=False`` (what
  ``deterministic: true`` sets);
* ``default``: all off, ``cudnn.benchmark=True`` (``deterministic: false``);
* ``default_no_autotune``: all off, ``cudnn.benchmark=False``.

Workloads: ``pipeline``, the pipeline's own Classifier on the prepared data
(params.yaml's model and batch size); ``conv``, a heavier convolutional
network on generated images sized by ``--batch-size``, ``--image-size``,
``--channels``, ``--width`` (so a GPU gets real work; on CPU keep it small).

A run's figure is its median step time. Per mode, ``median_step_s`` is the
median over repeats of those figures (``step_times_s``);
``determinism_cost_pct = 100 * (median_det / median_default - 1)`` with a
95% bootstrap interval over the repeats' pairs (seeded), and
``autotune_effect_pct`` likewise for ``default`` vs ``default_no_autotune``.
The flags are process-global, so modes switch in place between runs;
``CUBLAS_WORKSPACE_CONFIG`` is set once before CUDA starts (harmless when
determinism is off). Warm-up steps absorb cuDNN's autotuning, so the figures
are steady-state step times.
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from reprotrain.atomic import atomic_write_text
from reprotrain.commands._rerun import ensure_prepared
from reprotrain.commands.ops import device_facts
from reprotrain.determinism import CUBLAS_DETERMINISTIC_CONFIGS
from reprotrain.hashing import canonical_json
from reprotrain.pipeline.arguments import stage_arguments
from reprotrain.pipeline.config import Params
from reprotrain.pipeline.data import load_prepared
from reprotrain.pipeline.errors import DataError
from reprotrain.pipeline.model import Classifier

PARAMS = ("seed", "cpu", "data.batch_size", "model", "train")
#: Mode -> (deterministic algorithms and cudnn.deterministic, cudnn.benchmark).
MODES = {
    "deterministic": (True, False),
    "default": (False, True),
    "default_no_autotune": (False, False),
}
BOOTSTRAP_SAMPLES = 2000
#: Below this many pairs a bootstrap interval is too coarse to call an effect resolved.
MIN_PAIRS_FOR_VERDICT = 5

Batches = list[tuple[torch.Tensor, torch.Tensor]]
Setup = Callable[[], tuple[nn.Module, torch.optim.Optimizer]]


def set_mode(mode: str) -> None:
    deterministic, benchmark = MODES[mode]
    torch.use_deterministic_algorithms(deterministic)
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cudnn.benchmark = benchmark


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


def _conv_workload(args: argparse.Namespace, device: torch.device) -> tuple[Setup, Batches]:
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


def _pipeline_workload(
    params: Params, args: argparse.Namespace, device: torch.device
) -> tuple[Setup, Batches]:
    path = args.data
    if path is None:
        path = stage_arguments("train", args.dvc_yaml).data
        ensure_prepared(path, "bench")
    data = load_prepared(path)
    x, y = data.split("train")
    size = params.data.batch_size
    batches = [
        (x[i : i + size].to(device), y[i : i + size].to(device)) for i in range(0, size * 4, size)
    ]

    def setup() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(params.seed)
        module = Classifier(params.model, params.train, data.input_shape, data.num_classes)
        module = module.to(device)
        return module, module.configure_optimizers()

    return setup, batches


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_run(
    setup: Setup, batches: Batches, steps: int, warmup: int, device: torch.device
) -> float:
    """Median seconds per training step (forward, backward, optimizer) of one fresh run."""
    model, optimizer = setup()
    model.train()
    times = []
    for step in range(warmup + steps):
        x, y = batches[step % len(batches)]
        _sync(device)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        _sync(device)
        if step >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def effect_pct(slow: list[float], fast: list[float], seed: int) -> dict[str, Any]:
    """100 * (median(slow) / median(fast) - 1), with a seeded 95% bootstrap over the pairs."""
    point = 100 * (statistics.median(slow) / statistics.median(fast) - 1)
    rng = random.Random(seed)
    n = len(slow)
    samples = []
    for _ in range(BOOTSTRAP_SAMPLES):
        pick = [rng.randrange(n) for _ in range(n)]
        samples.append(
            100
            * (
                statistics.median(slow[i] for i in pick) / statistics.median(fast[i] for i in pick)
                - 1
            )
        )
    samples.sort()
    low, high = samples[int(0.025 * len(samples))], samples[int(0.975 * len(samples)) - 1]
    ratios = [a / b for a, b in zip(slow, fast, strict=True)]
    return {"pct": point, "ci95": [low, high], "paired_ratios": ratios, "bootstrap_seed": seed}


def bench_workload(
    setup: Setup, batches: Batches, args: argparse.Namespace, device: torch.device
) -> dict[str, Any]:
    """Paired, interleaved runs of every mode; the figures in the module docstring."""
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for repeat in range(args.repeats):
        order = list(MODES) if repeat % 2 == 0 else list(reversed(MODES))
        for mode in order:
            set_mode(mode)
            try:
                times[mode].append(time_run(setup, batches, args.steps, args.warmup, device))
            except RuntimeError as err:
                return {"error": f"{mode} mode: {err}".splitlines()[0], "modes": {}}
    modes = {
        m: {"step_times_s": t, "median_step_s": statistics.median(t)} for m, t in times.items()
    }
    return {
        "modes": modes,
        "determinism_cost": effect_pct(times["deterministic"], times["default"], seed=0),
        "autotune_effect": effect_pct(times["default"], times["default_no_autotune"], seed=1),
    }


def _resolved(effect: dict[str, Any]) -> bool:
    low, high = effect["ci95"]
    return low > 0 or high < 0


def run(params: Params, args: argparse.Namespace) -> int:
    if args.repeats < 2 or args.steps < 1 or args.warmup < 0:
        raise DataError("--repeats must be >= 2, --steps >= 1 and --warmup >= 0")
    # cuBLAS reads this when its first handle is created: set it before anything touches CUDA.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DETERMINISTIC_CONFIGS[0])
    if args.device == "cuda" and not torch.cuda.is_available():
        raise DataError("--device cuda: no CUDA device is visible here; use --device cpu")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    # The CPU profile's in-process part (oneDNN, thread pools); its variables came with the start.
    for problem in params.cpu.to_profile().apply():
        print(f"reprotrain bench: warning: {problem}", file=sys.stderr)
    names = ("pipeline", "conv") if args.workload == "both" else (args.workload,)
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    report: dict[str, Any] = {
        **device_facts(device),
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "workloads": {},
    }
    try:
        for name in names:
            if name == "pipeline":
                setup, batches = _pipeline_workload(params, args, device)
                size = {"batch_size": params.data.batch_size, "model": vars(params.model)}
            else:
                setup, batches = _conv_workload(args, device)
                size = {
                    k: getattr(args, k) for k in ("batch_size", "image_size", "channels", "width")
                }
            result = bench_workload(setup, batches, args, device)
            report["workloads"][name] = {"size": size, **result}
    finally:
        torch.use_deterministic_algorithms(saved[0])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[1:]
    report["autotune_note"] = (
        "cuDNN autotuning applies to cuDNN kernels on CUDA"
        if device.type == "cuda"
        else "not applicable on the CPU: cuDNN is not used there, so cudnn.benchmark selects "
        "nothing; the measured autotune effect is run-to-run noise"
    )
    if args.out is not None:
        atomic_write_text(args.out, canonical_json(report))
    print(canonical_json(report) if args.json else render_table(report), end="")
    return 0


def render_table(report: dict[str, Any]) -> str:
    """What was run, then per workload the median step time per mode and both effects."""
    lines = [
        f"bench on {report['device']} ({report['device_name']}), torch {report['torch']}, "
        f"{report['threads']} threads: {report['repeats']} paired repeats x "
        f"({report['warmup']} warm-up + {report['steps']} timed steps) per mode",
    ]
    for name, result in report["workloads"].items():
        lines.append(f"{name}: {result['size']}")
        if "error" in result:
            lines.append(f"  could not run: {result['error']}")
            continue
        for mode, figures in result["modes"].items():
            lines.append(f"  {mode:20s} median step {1000 * figures['median_step_s']:9.3f} ms")
        for key, label in (
            ("determinism_cost", "determinism cost"),
            ("autotune_effect", "autotune effect"),
        ):
            effect = result[key]
            low, high = effect["ci95"]
            verdict = "resolved" if _resolved(effect) else "not resolved from noise"
            if len(effect["paired_ratios"]) < MIN_PAIRS_FOR_VERDICT:
                verdict = f"fewer than {MIN_PAIRS_FOR_VERDICT} pairs: no verdict"
            lines.append(
                f"  {label:20s} {effect['pct']:+8.1f} %  "
                f"(95% CI {low:+.1f} .. {high:+.1f}; {verdict})"
            )
    lines.append(f"autotune: {report['autotune_note']}")
    return "\n".join(lines) + "\n"
