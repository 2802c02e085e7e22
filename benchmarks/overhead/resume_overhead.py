"""What saving the random state in every checkpoint costs the default train stage.

Fits the default model in this process, interleaved, with epoch-end
checkpoints that carry the full random state (python, numpy, torch, CUDA,
the loader generator) and with the same checkpoints without it. Prints the
median wall times and their ratio. Whole-run ratios on a shared 2-core
machine are noisy (a few percent between identical runs), so it also times
the random-state capture itself (``RandomStateCallback.state_dict``, what
each checkpoint adds) and prints it as a share of the median train time.
Target: 1% or less.

    .venv/bin/python benchmarks/overhead/resume_overhead.py [--repeats 6] [--workload lm|digits]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # python benchmarks/<group>/<script>.py: import from the root

from benchmarks._common.workspace import add_workload_argument, train_workspace, workload_params
from reprotrain.determinism import configure_determinism, reexec_with_fixed_hash_seed
from reprotrain.pipeline.recipe import resolve_recipe
from reprotrain.pipeline.resume_point import Checkpointing
from reprotrain.pipeline.training import fit
from reprotrain.resume import RandomStateCallback


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=6)
    add_workload_argument(parser)
    cli = parser.parse_args()
    reexec_with_fixed_hash_seed()
    params = workload_params(cli.workload)
    times: dict[str, list[float]] = {"with random state": [], "without": []}
    with train_workspace(params) as (_, params), tempfile.TemporaryDirectory() as ckpt:
        recipe = resolve_recipe(params)

        def timed_fit(random_state: bool) -> float:
            settings = configure_determinism(params.seed, params.deterministic)
            start = time.perf_counter()
            folder = Path(ckpt) / str(random_state)
            fit(params, recipe, settings, Checkpointing(folder, "bench", None, random_state))
            return time.perf_counter() - start

        timed_fit(True), timed_fit(False)  # warm-up
        for _ in range(cli.repeats):
            times["with random state"].append(timed_fit(True))
            times["without"].append(timed_fit(False))
    med = {name: statistics.median(values) for name, values in times.items()}
    epochs = params.train.max_epochs
    saves = epochs // params.train.checkpoint_every_n_epochs
    print(f"{cli.workload}: train, {epochs} epochs, {saves} checkpoints, {cli.repeats} pairs")
    for name, values in times.items():
        print(
            f"  {name:17s} median {med[name]:.3f} s  runs {', '.join(f'{v:.3f}' for v in values)}"
        )
    ratio = med["with random state"] / med["without"]
    print(f"  whole-run ratio with/without (medians): {ratio:.3f}")
    capture = _capture_seconds()
    share = 100 * capture * saves / med["without"]
    print(
        f"  random-state capture: {capture * 1e3:.3f} ms per checkpoint x {saves} checkpoints"
        f" = {share:.4f}% of the median train time (target <= 1%)"
    )


def _capture_seconds(calls: int = 200) -> float:
    """Median time of one RandomStateCallback.state_dict() call, loader generator included."""
    callback = RandomStateCallback({"train_loader": torch.Generator().manual_seed(0)})
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        callback.state_dict()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


if __name__ == "__main__":
    main()
