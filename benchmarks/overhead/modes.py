"""`deterministic: true` vs `false` on this machine: train time and bitwise repeatability.

Runs the real train stage in this process, interleaved (true, false, true,
false, ...), `--repeats` times per mode, and prints the median wall time per
mode, their ratio, and whether every run of a mode produced the same weights
(sha256 of model.safetensors). On CPU both modes are often already bitwise
repeatable: the script reports what it sees, it does not assume.

    .venv/bin/python benchmarks/overhead/modes.py [--repeats 4] [--epochs N] [--workload lm|digits]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # python benchmarks/<group>/<script>.py: import from the root

from benchmarks._common.workspace import add_workload_argument, train_workspace, workload_params
from reprotrain.determinism import reexec_with_fixed_hash_seed
from reprotrain.hashing import sha256_file
from reprotrain.pipeline.stages import train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=None, help="default: the params file's")
    add_workload_argument(parser)
    cli = parser.parse_args()
    overrides = [] if cli.epochs is None else [f"train.max_epochs={cli.epochs}"]
    base = workload_params(cli.workload, overrides)
    # The stage's CPU profile (threads, kernels) works only from process start, as in the CLI.
    reexec_with_fixed_hash_seed(base.cpu.to_profile().variables())
    times: dict[str, list[float]] = {"true": [], "false": []}
    hashes: dict[str, set[str]] = {name: set() for name in times}
    with train_workspace(base) as (args, base):
        modes = {
            str(mode).lower(): dataclasses.replace(base, deterministic=mode)
            for mode in (True, False)
        }
        train.run(modes["true"], args)  # warm-up
        for _ in range(cli.repeats):
            for name, params in modes.items():
                start = time.perf_counter()
                train.run(params, args)
                times[name].append(time.perf_counter() - start)
                hashes[name].add(sha256_file(args.model))

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    epochs = base.train.max_epochs
    print(f"device {device}, torch {torch.__version__}, {cli.workload}, {epochs} epochs")
    print("mode   median_s  runs_identical  runs")
    for name in modes:
        same = "yes" if len(hashes[name]) == 1 else f"no ({len(hashes[name])} distinct)"
        runs = ", ".join(f"{t:.3f}" for t in times[name])
        print(f"{name:6s} {statistics.median(times[name]):8.3f}  {same:14s}  {runs}")
    ratio = statistics.median(times["true"]) / statistics.median(times["false"])
    print(f"time ratio true/false (medians): {ratio:.3f}")


if __name__ == "__main__":
    main()
