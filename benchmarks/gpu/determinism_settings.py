"""What each determinism setting costs per step, alone and together, and which bits it keeps.

``deterministic: true`` (``configure_determinism``) sets four things; this
measures each on its own and together, on the device at hand:

* ``CUBLAS_WORKSPACE_CONFIG`` (``:4096:8``, or torch's other accepted value
  ``:16:8``): read once, when CUDA starts, so each value is a process of its own;
* ``torch.use_deterministic_algorithms(True)``, with and without its
  ``torch.utils.deterministic.fill_uninitialized_memory`` (on by default: every
  ``torch.empty`` output is filled with NaN first);
* ``torch.backends.cudnn.deterministic = True``;
* ``torch.backends.cudnn.benchmark``: ``False`` in torch's defaults (Lightning's
  ``deterministic=False``, the baseline here) and in ``deterministic: true``;
  ``True`` in the pipeline's fast mode.

On CUDA torch refuses ``use_deterministic_algorithms(True)`` without one of
the two cuBLAS values, so that setting is measured on top of ``:4096:8``
(its own increment over the variable alone).

Design: a round starts one fresh process per cuBLAS value (in rotating
order); each trains every configuration of its value ("cells", rotating
order, ``--passes`` times) from the same initial weights on the same
batches: ``--warmup`` untimed steps, then ``--steps`` timed ones (CUDA
synchronised around each step, as ``reprotrain bench``). A cell's figure is
its median step; an effect is ``median(slow) / median(fast) - 1`` over the
rounds' pairs with a seeded 95% bootstrap (``reprotrain bench``'s
``effect_pct``). Each cell also records the sha256 of the weights it
trained, so the report says which settings change the bits here (compared
with the full set) and whether each cell gave the same bits in every fresh
process: the evidence for dropping a setting that this model does not need
on this device.

Workloads: ``conv``, ``reprotrain bench``'s convolutional network (BatchNorm,
SGD) at ``--conv-batch`` images of ``--conv-image`` pixels, width
``--conv-width``; ``lm``, the pipeline's transformer recipe (TinyGPT, AdamW)
at ``--lm-size`` (``gpu``: 8 layers, 8 heads, width 512, 128 tokens x batch
32: 25.6M parameters; ``tiny``: the recipe's defaults).

    PYTHONPATH=src python benchmarks/gpu/determinism_settings.py [--device cuda] [--rounds 5]
        [--json PATH]     # on a GPU host; --quick: tiny sizes, the CPU dry run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # python benchmarks/<group>/<script>.py: import from the root

from benchmarks._common.child import child_env, run_json
from benchmarks._common.workloads import WORKLOADS

#: The "late" process: CUBLAS_WORKSPACE_CONFIG exported after cuBLAS's handle exists.
LATE = "late:4096:8"


@dataclass(frozen=True)
class Flags:
    """The in-process settings of one cell."""

    algorithms: bool = False
    fill: bool = True  # fill_uninitialized_memory, which only acts under algorithms
    cudnn_deterministic: bool = False
    cudnn_benchmark: bool = False


#: process -> (CUBLAS_WORKSPACE_CONFIG, or None for unset; its cells)
PROCESSES: dict[str, tuple[str | None, dict[str, Flags]]] = {
    "unset": (
        None,
        {
            "baseline": Flags(),
            "autotune": Flags(cudnn_benchmark=True),
            "cudnn": Flags(cudnn_deterministic=True),
        },
    ),
    "4096": (
        ":4096:8",
        {
            "cublas": Flags(),
            "algorithms": Flags(algorithms=True),
            "algorithms_nofill": Flags(algorithms=True, fill=False),
            "library": Flags(algorithms=True, cudnn_deterministic=True),
            "library_nofill": Flags(algorithms=True, fill=False, cudnn_deterministic=True),
            "library_autotune": Flags(
                algorithms=True, cudnn_deterministic=True, cudnn_benchmark=True
            ),
        },
    ),
    "16": (":16:8", {"cublas16": Flags(), "library16": Flags(True, True, True)}),
    # cuBLAS made its handle before the variable was exported (cuBLAS then runs as without
    # it, single-stream; torch's check, at the first deterministic GEMM, sees it): measured
    # as a candidate, not what configure_determinism does.
    "late": (LATE, {"late_cublas": Flags(algorithms=True, fill=False, cudnn_deterministic=True)}),
}
#: effect -> (slow cell, fast cell): what the first costs over the second.
EFFECTS = {
    "CUBLAS_WORKSPACE_CONFIG=:4096:8 alone": ("cublas", "baseline"),
    "CUBLAS_WORKSPACE_CONFIG=:16:8 alone": ("cublas16", "baseline"),
    "use_deterministic_algorithms, on top of :4096:8": ("algorithms", "cublas"),
    "its fill_uninitialized_memory": ("algorithms", "algorithms_nofill"),
    "cudnn.deterministic alone": ("cudnn", "baseline"),
    "cudnn.benchmark=False (vs autotuning)": ("baseline", "autotune"),
    "all four, as deterministic: true sets them": ("library", "baseline"),
    "all four, vs the fast mode (autotuning)": ("library", "autotune"),
    "all but fill_uninitialized_memory": ("library_nofill", "baseline"),
    "all four with :16:8": ("library16", "baseline"),
    "all four, cuDNN autotuning among deterministic kernels": ("library_autotune", "baseline"),
    "all but fill, :4096:8 exported after cuBLAS started": ("late_cublas", "baseline"),
}
#: Per process, the cells ``--profile`` profiles in round 0.
PROFILED = {"unset": ("baseline",), "4096": ("cublas", "library_nofill"), "late": ("late_cublas",)}
LM_SIZES = {
    "gpu": [
        *("model.init_args.n_layer=8", "model.init_args.n_head=8", "model.init_args.n_embd=512"),
        *("data.init_args.block_size=128", "data.init_args.batch_size=32"),
    ],
    "tiny": [],
}
FULL_SET = "library"


def cells() -> dict[str, tuple[str, Flags]]:
    """cell -> (its process, its flags)."""
    return {cell: (p, f) for p, (_, group) in PROCESSES.items() for cell, f in group.items()}


# -- the child: one process, one cuBLAS value, every cell of it ------------------------------


def set_flags(flags: Flags) -> None:
    import torch

    torch.use_deterministic_algorithms(flags.algorithms)
    torch.utils.deterministic.fill_uninitialized_memory = flags.fill
    torch.backends.cudnn.deterministic = flags.cudnn_deterministic
    torch.backends.cudnn.benchmark = flags.cudnn_benchmark


def workloads(args: argparse.Namespace, device: Any) -> dict[str, tuple[Any, Any]]:
    """name -> (setup, batches), built once per process from fixed seeds."""
    from reprotrain.commands import _steptime
    from reprotrain.pipeline.params_file import load_params

    built = {}
    if "conv" in args.workloads:
        conv = argparse.Namespace(
            batch_size=args.conv_batch, image_size=args.conv_image, channels=3,
            width=args.conv_width,
        )  # fmt: skip
        built["conv"] = _steptime.conv_workload(conv, device)
    if "lm" in args.workloads:
        params = load_params(WORKLOADS["lm"], LM_SIZES[args.lm_size])
        built["lm"] = _steptime.pipeline_workload(params, None, device)
    return built


def child(args: argparse.Namespace) -> dict[str, Any]:
    """Every cell of ``args.child``'s process, ``args.passes`` times: step times and sha256."""
    import torch

    from reprotrain.commands._steptime import modes_restored, timed_training
    from reprotrain.hashing import sha256_state_dict

    device = torch.device(args.device)
    group = PROCESSES[args.child][1]
    if os.environ.get("CUBLAS_WORKSPACE_CONFIG", "").startswith("late:"):
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG")
        if device.type == "cuda":
            torch.cuda.current_blas_handle()  # the handle, and torch's workspace, without it
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = LATE.removeprefix("late")
    report: dict[str, Any] = {"cublas": os.environ.get("CUBLAS_WORKSPACE_CONFIG"), "cells": {}}
    with modes_restored():
        for name, (setup, batches) in workloads(args, device).items():
            order = list(group)
            shift = args.round % len(order)
            order = order[shift:] + order[:shift]
            out = report["cells"].setdefault(name, {c: {"step_s": [], "sha256": []} for c in order})
            for index in range(args.passes):
                for cell in order if index % 2 == 0 else reversed(order):
                    set_flags(group[cell])
                    step, model = timed_training(setup, batches, args.steps, args.warmup, device)
                    out[cell]["step_s"].append(step)
                    out[cell]["sha256"].append(sha256_state_dict(model.state_dict()))
            report.setdefault("parameters", {})[name] = sum(p.numel() for p in model.parameters())
            if args.profile and args.round == 0:
                report.setdefault("profile", {})[name] = {
                    cell: top_kernels(group[cell], setup, batches, device)
                    for cell in PROFILED.get(args.child, ())
                }
    return report


def top_kernels(flags: Flags, setup: Any, batches: Any, device: Any) -> list[dict[str, Any]]:
    """The device kernels that took the most time over 5 steps (after 3) under ``flags``
    (on the CPU: the ops). Each step ends synchronised (``timed_training``)."""
    from torch.profiler import ProfilerActivity, profile

    from reprotrain.commands._steptime import timed_training

    set_flags(flags)
    timed_training(setup, batches, 3, 0, device)
    activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * (device.type == "cuda")
    with profile(activities=activities) as prof:
        timed_training(setup, batches, 5, 0, device)
    rows = []
    for event in prof.key_averages():
        if device.type == "cuda":
            self_us = getattr(event, "self_device_time_total", 0) or 0
        else:
            self_us = event.self_cpu_time_total
        rows.append(
            {"name": event.key[:120], "self_ms_per_step": self_us / 5e3, "calls": event.count}
        )
    rows.sort(key=lambda r: -r["self_ms_per_step"])
    return rows[:15]


# -- the parent: rounds of fresh processes, then the effects ---------------------------------


def run_child(args: argparse.Namespace, process: str, round_: int) -> dict[str, Any]:
    cublas = PROCESSES[process][0]
    env = child_env(["CUBLAS_WORKSPACE_CONFIG"], PYTHONHASHSEED="0")
    if cublas is not None:
        env["CUBLAS_WORKSPACE_CONFIG"] = cublas
    src = str(ROOT / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    cmd = [__file__, "--child", process, "--round", str(round_), *args.forward]
    return run_json(cmd, f"determinism_settings: {process} round {round_}", env=env)


def analyse(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Per workload: each cell's median step and bits, each effect with its interval.

    ``rounds``: per round, process -> the child's report. A cell's figure per
    round is the median of its passes; pairs are taken within a round.
    """
    from reprotrain.commands.bench import effect_pct

    out: dict[str, Any] = {}
    names = rounds[0][next(iter(rounds[0]))]["cells"]
    for workload in names:
        per_cell: dict[str, dict[str, Any]] = {}
        for cell, (process, _) in cells().items():
            figures = [
                statistics.median(r[process]["cells"][workload][cell]["step_s"]) for r in rounds
            ]
            digests = [d for r in rounds for d in r[process]["cells"][workload][cell]["sha256"]]
            per_cell[cell] = {
                "median_step_s": statistics.median(figures),
                "step_s_per_round": figures,
                "sha256": digests[0],
                "same_bits_every_run": len(set(digests)) == 1,
                "runs": len(digests),
            }
        full = per_cell[FULL_SET]["sha256"]
        for figures in per_cell.values():
            figures["same_bits_as_full_set"] = figures["sha256"] == full
        effects = {}
        for index, (effect, (slow, fast)) in enumerate(EFFECTS.items()):
            effects[effect] = {
                "slow": slow,
                "fast": fast,
                **effect_pct(
                    per_cell[slow]["step_s_per_round"],
                    per_cell[fast]["step_s_per_round"],
                    seed=index,
                ),
            }
        out[workload] = {"cells": per_cell, "effects": effects}
    return out


def render(report: dict[str, Any]) -> str:
    lines = [
        f"determinism settings on {report['device_name']} ({report['device']}), torch "
        f"{report['torch']}: {report['rounds']} rounds x {len(PROCESSES)} fresh processes, "
        f"{report['passes']} passes x ({report['warmup']} warm-up + {report['steps']} timed steps)"
    ]
    for workload, result in report["workloads"].items():
        lines.append(f"{workload}: {report['sizes'][workload]}")
        for cell, figures in result["cells"].items():
            bits = (
                "same bits every run"
                if figures["same_bits_every_run"]
                else "BITS DIFFER between runs"
            )
            full = (
                "= full set" if figures["same_bits_as_full_set"] else "other bits than the full set"
            )
            lines.append(f"  {cell:18s} {1000 * figures['median_step_s']:9.3f} ms  {bits}; {full}")
        for effect, figures in result["effects"].items():
            low, high = figures["ci95"]
            lines.append(
                f"  {effect:48s} {figures['pct']:+7.1f} %  (95% CI {low:+.1f} .. {high:+.1f})"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--rounds", type=int, default=5, help="fresh processes per cuBLAS value")
    parser.add_argument("--passes", type=int, default=2, help="runs of every cell per process")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps before them")
    parser.add_argument("--workloads", default="conv,lm", help="comma-separated: conv, lm")
    parser.add_argument("--conv-batch", type=int, default=256)
    parser.add_argument("--conv-image", type=int, default=64)
    parser.add_argument("--conv-width", type=int, default=64)
    parser.add_argument("--lm-size", choices=tuple(LM_SIZES), default="gpu")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: the CPU dry run")
    parser.add_argument("--json", type=Path, help="also write the report here")
    parser.add_argument(
        "--profile", action="store_true", help="round 0: top device kernels, :4096:8 vs algorithms"
    )
    parser.add_argument("--child", choices=tuple(PROCESSES), help=argparse.SUPPRESS)
    parser.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.conv_batch, args.conv_image, args.conv_width, args.lm_size = 4, 16, 8, "tiny"
        args.steps, args.warmup, args.passes = 2, 1, 1
    args.workloads = [w for w in args.workloads.split(",") if w]
    if args.child:
        print(json.dumps(child(args)))
        return 0
    if args.rounds < 2:
        parser.error("--rounds must be >= 2 (the intervals are over rounds)")
    args.forward = [
        *("--device", args.device, "--passes", str(args.passes), "--steps", str(args.steps)),
        *("--warmup", str(args.warmup), "--workloads", ",".join(args.workloads)),
        *("--conv-batch", str(args.conv_batch), "--conv-image", str(args.conv_image)),
        *("--conv-width", str(args.conv_width), "--lm-size", args.lm_size),
        *(["--profile"] if args.profile else []),
    ]
    rounds = []
    for round_ in range(args.rounds):
        order = list(PROCESSES)
        order = order[round_ % len(order) :] + order[: round_ % len(order)]
        rounds.append({p: run_child(args, p, round_) for p in order})
        print(f"determinism_settings: round {round_ + 1}/{args.rounds} done", file=sys.stderr)
    report = {
        **device_facts(args.device),
        **{k: getattr(args, k) for k in ("rounds", "passes", "steps", "warmup")},
    }
    report["sizes"] = {
        "conv": {"batch": args.conv_batch, "image": args.conv_image, "width": args.conv_width},
        "lm": {
            "size": args.lm_size,
            "overrides": LM_SIZES[args.lm_size],
        },
    }
    report["sizes"] = {
        w: {**report["sizes"][w], "parameters": rounds[0]["4096"]["parameters"][w]}
        for w in args.workloads
    }
    report["cells"] = {
        cell: {"process": p, "cublas": PROCESSES[p][0], **asdict(f)}
        for cell, (p, f) in cells().items()
    }
    report["workloads"] = analyse(rounds)
    if args.profile:
        report["profile"] = {}
        for result in rounds[0].values():
            for workload, cells_ in result.get("profile", {}).items():
                report["profile"].setdefault(workload, {}).update(cells_)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
    print(render(report), end="")
    return 0


def device_facts(device: str) -> dict[str, Any]:
    import torch

    name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    return {"device": device, "device_name": name, "torch": torch.__version__}


if __name__ == "__main__":
    sys.exit(main())
