"""``reprotrain noise-floor``: how far same-seed runs drift, with and without determinism.

Trains ``--runs`` same-seed runs with ``deterministic: false`` (deterministic
algorithms off, cuDNN autotuning on) and ``--runs`` with ``deterministic:
true``, each the train stage's own command in a fresh process (as ``reprotrain
verify`` does, so the flags apply before CUDA starts), and reports per mode:

* ``final_loss_gap``: max - min of the runs' final train loss;
* ``max_abs_weight_diff`` and ``l2_weight_diff``: the largest, over runs, of
  max |w - w_first| and ||w - w_first||_2 over all weights, against the first run;
* ``first_diverging_step``: the earliest step at which a run's per-step trace
  parts from the first run's (``None`` when every trace is identical);
* ``identical``: every run's weights and trace are the same bytes as the first's.

It measures; it does not assume. On a CPU the default mode is usually
already repeatable, and then it says "identical" for both modes: there is
no noise floor to report on that machine. Numbers compare runs on one
machine only; across GPU models or library versions see ``reprotrain compare``.

``--workdir DIR`` keeps the runs there; it must be new or empty (a file, or a
folder holding anything, is refused before any run), so no earlier run is replaced.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path
from typing import Any

from reprotrain.atomic import atomic_write_text
from reprotrain.commands._findrun import FLAT, METRICS, run_in_folder
from reprotrain.commands._rerun import Workspace, ready_workdir, rerun_workspace, train_fresh
from reprotrain.commands._rundiff import compare_runs
from reprotrain.hashing import canonical_json, load_safetensors
from reprotrain.pipeline.command import Command, add_dvc_yaml, add_override_option
from reprotrain.pipeline.errors import DataError

PARAMS: tuple[str, ...] = ()
#: Mode name in the report -> the ``deterministic`` value the runs train with.
MODES = {"default": "false", "deterministic": "true"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runs", type=int, default=3, help="same-seed runs per mode (>= 2)")
    add_dvc_yaml(parser)
    parser.add_argument(
        "--workdir", type=Path, help="keep the run folders here (a new or empty folder)"
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--out", type=Path, help="also write the JSON report to this file")
    add_override_option(parser, "params override for every run, e.g. -S train.max_epochs=1")


COMMAND = Command(
    "how far same-seed runs drift with determinism off and on", add_arguments, restarts=True
)


def run(_: object, args: argparse.Namespace) -> int:
    if args.runs < 2:
        raise DataError(
            f"--runs {args.runs}: a noise floor needs at least 2 runs per mode; "
            "pass --runs 2 or more"
        )
    if any(o.split("=", 1)[0].strip() == "deterministic" for o in args.overrides):
        raise DataError(
            "-S deterministic=...: noise-floor sets `deterministic` itself (false, then true); "
            "drop that override"
        )
    if args.workdir is not None:  # before any run: train_fresh replaces a run folder it finds
        ready_workdir(args.workdir, fresh=True, command="noise-floor")
    with rerun_workspace(args.dvc_yaml, args.workdir, "noise-floor") as workspace:
        return _noise_floor(args, workspace)


def _noise_floor(args: argparse.Namespace, workspace: Workspace) -> int:
    import torch  # for its version; the runs themselves train in fresh processes

    train_args, workdir, environment, record = workspace
    modes: dict[str, Any] = {}
    for name, value in MODES.items():
        overrides = [*args.overrides, f"deterministic={value}"]
        folders = [workdir / f"{name}-{i + 1}" for i in range(args.runs)]
        train_fresh(train_args, folders, environment, overrides, "noise-floor", jobs=1)
        modes[name] = measure_mode(folders, value)
    report = {
        "runs_per_mode": args.runs,
        "overrides": list(args.overrides),
        "device": _device(record, args.overrides),
        "torch": torch.__version__,
        "modes": modes,
    }
    if args.out is not None:
        atomic_write_text(args.out, canonical_json(report))
    print(canonical_json(report) if args.json else render_table(report), end="")
    if args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


def _device(record: dict[str, Any], overrides: list[str]) -> str:
    if "train.accelerator=gpu" in [o.replace(" ", "") for o in overrides]:
        gpus = record.get("gpu") or [{}]
        return f"gpu: {gpus[0].get('name', 'unknown')}"
    return f"cpu: {record.get('cpu', {}).get('model', 'unknown')}"


def _weight_distance(a: Path, b: Path) -> tuple[float, float]:
    """Max |a - b| and ||a - b||_2 over every tensor of two weight files."""
    import torch

    wa, wb = load_safetensors(a)[0], load_safetensors(b)[0]
    if set(wa) != set(wb):
        raise DataError(f"{a} and {b} hold different tensors; were they trained with one config?")
    max_abs, squares = 0.0, 0.0
    for name in sorted(wa):
        delta = wa[name].to(torch.float64) - wb[name].to(torch.float64)
        if delta.numel():
            max_abs = max(max_abs, float(delta.abs().max()))
            squares += float((delta * delta).sum())
    return max_abs, math.sqrt(squares)


def measure_mode(folders: list[Path], deterministic: str) -> dict[str, Any]:
    """The per-mode figures (see the module docstring) for runs kept in ``folders``."""
    from reprotrain.trace.diff import compare_traces  # numpy
    from reprotrain.trace.tracefile import load_trace

    losses = [float(json.loads((f / METRICS).read_text())["train_loss"]) for f in folders]
    first = run_in_folder(folders[0], folders[0].name)
    first_trace = load_trace(folders[0] / FLAT["trace"])
    per_run: list[dict[str, Any]] = []
    for folder, loss in zip(folders, losses, strict=True):
        same = compare_runs(first, run_in_folder(folder, folder.name)).identical
        max_abs, l2 = _weight_distance(folders[0] / FLAT["model"], folder / FLAT["model"])
        diff = compare_traces(first_trace, load_trace(folder / FLAT["trace"]))
        per_run.append(
            {
                "run": folder.name,
                "final_train_loss": loss,
                "identical_to_first": same,
                "max_abs_weight_diff": max_abs,
                "l2_weight_diff": l2,
                "first_diverging_step": diff.first_step,
                "first_diverging_record": diff.record,
            }
        )
    steps = [r["first_diverging_step"] for r in per_run if r["first_diverging_step"] is not None]
    return {
        "deterministic": deterministic,
        "identical": all(r["identical_to_first"] for r in per_run),
        "final_loss_gap": max(losses) - min(losses),
        "max_abs_weight_diff": max(r["max_abs_weight_diff"] for r in per_run),
        "l2_weight_diff": max(r["l2_weight_diff"] for r in per_run),
        "first_diverging_step": min(steps) if steps else None,
        "runs": per_run,
    }


def render_table(report: dict[str, Any]) -> str:
    """A short plain-text table of the per-mode figures."""
    lines = [
        f"noise floor: {report['runs_per_mode']} same-seed runs per mode, "
        f"{report['device']}, torch {report['torch']}, overrides {report['overrides'] or 'none'}",
        f"{'mode':14s} {'verdict':10s} {'loss gap':>10s} {'max|dw|':>10s} {'L2 dw':>10s}  "
        "first diverging step",
    ]
    for name, mode in report["modes"].items():
        verdict = "identical" if mode["identical"] else "differs"
        step = mode["first_diverging_step"]
        lines.append(
            f"{name:14s} {verdict:10s} {mode['final_loss_gap']:10.3g} "
            f"{mode['max_abs_weight_diff']:10.3g} {mode['l2_weight_diff']:10.3g}  "
            f"{'none' if step is None else step}"
        )
    return "\n".join(lines) + "\n"
