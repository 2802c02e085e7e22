"""``reprotrain bench``: what determinism costs in step time, paired and interleaved.

Two workloads, each trained for ``--steps`` timed steps (after ``--warmup``
untimed ones) from the same initial weights and batches, in three modes per
repeat, the order alternating between repeats:

* ``deterministic``: ``use_deterministic_algorithms(True)`` (torch's
  ``fill_uninitialized_memory`` off, as ``configure_determinism`` leaves it),
  ``cudnn.deterministic=True``, ``cudnn.benchmark=False`` (what
  ``deterministic: true`` sets);
* ``default``: all off, ``cudnn.benchmark=True`` (``deterministic: false``);
* ``default_no_autotune``: all off, ``cudnn.benchmark=False``.

Workloads: ``pipeline``, params.yaml's model on the first four training
batches of its data (prepared where missing), trained by a Lightning Trainer
as the module configures it (its optimizers and schedulers, manual
optimization, ``self.trainer``), a step timed from its batch's start to its
end; ``conv``, a heavier convolutional network in a plain loop on generated
images sized by ``--batch-size``, ``--image-size``, ``--channels``,
``--width`` (so a GPU gets real work; on CPU keep it small).

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
import os
import random
import statistics
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reprotrain.atomic import atomic_write_text
from reprotrain.determinism import CUBLAS_DETERMINISTIC_CONFIGS
from reprotrain.hashing import canonical_json
from reprotrain.pipeline.command import Command, add_dvc_yaml
from reprotrain.pipeline.config import Params
from reprotrain.pipeline.errors import DataError

if TYPE_CHECKING:  # torch loads when it measures (commands._steptime), not with --help
    import torch

    from reprotrain.commands._steptime import Batches, Setup

PARAMS = ("seed", "cpu", "model", "data", "train")
BOOTSTRAP_SAMPLES = 2000
#: Below this many pairs a bootstrap interval is too coarse to call an effect resolved.
MIN_PAIRS_FOR_VERDICT = 5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", choices=("pipeline", "conv", "both"), default="both")
    parser.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda if available")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    parser.add_argument("--repeats", type=int, default=5, help="runs per mode (paired)")
    parser.add_argument("--batch-size", type=int, default=32, help="conv: images per batch")
    parser.add_argument("--image-size", type=int, default=32, help="conv: image height = width")
    parser.add_argument("--channels", type=int, default=3, help="conv: input channels")
    parser.add_argument("--width", type=int, default=32, help="conv: first layer's channels")
    add_dvc_yaml(parser)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--out", type=Path, help="also write the JSON report here")


COMMAND = Command(
    "step-time cost of determinism and of cuDNN autotuning, paired and interleaved",
    add_arguments,
    takes_params=True,
    restarts=True,
)


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
    from reprotrain.commands._steptime import paired_step_times

    try:
        times = paired_step_times(setup, batches, args, device)
    except RuntimeError as err:
        return {"error": str(err).splitlines()[0], "modes": {}}
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
    from reprotrain.commands import _steptime  # torch
    from reprotrain.commands._device import device_facts, pick_device

    device = pick_device(args.device)
    # The CPU profile's in-process part (oneDNN, thread pools); its variables came with the start.
    for problem in params.cpu.to_profile().apply():
        print(f"reprotrain bench: warning: {problem}", file=sys.stderr)
    names = ("pipeline", "conv") if args.workload == "both" else (args.workload,)
    report: dict[str, Any] = {
        **device_facts(device),
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "workloads": {},
    }
    with _steptime.modes_restored():
        for name in names:
            if name == "pipeline":
                setup, batches = _steptime.pipeline_workload(params, args.dvc_yaml, device)
                data = params.data.init_args if params.data is not None else None
                size = {"model": params.model.init_args, "data": data}
            else:
                setup, batches = _steptime.conv_workload(args, device)
                size = {
                    k: getattr(args, k) for k in ("batch_size", "image_size", "channels", "width")
                }
            result = bench_workload(setup, batches, args, device)
            report["workloads"][name] = {"size": size, **result}
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
