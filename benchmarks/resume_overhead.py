"""What saving the random state in every checkpoint costs the default train stage.

Fits the default model in this process, interleaved, with epoch-end
checkpoints that carry the full random state (python, numpy, torch, CUDA,
the loader generator) and with the same checkpoints without it. Prints the
median wall times and their ratio. Target: 1.01 or less.

    .venv/bin/python benchmarks/resume_overhead.py [--repeats 6]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from _workspace import ROOT, train_workspace
from reprotrain.determinism import configure_determinism, reexec_with_fixed_hash_seed
from reprotrain.pipeline import train
from reprotrain.pipeline.config import load_params
from reprotrain.pipeline.data import load_prepared


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=6)
    cli = parser.parse_args()
    reexec_with_fixed_hash_seed()
    params = load_params(ROOT / "params.yaml")
    times: dict[str, list[float]] = {"with random state": [], "without": []}
    with train_workspace(params) as args, tempfile.TemporaryDirectory() as ckpt:
        data = load_prepared(args.data)

        def fit(random_state: bool) -> float:
            settings = configure_determinism(params.seed, params.deterministic)
            start = time.perf_counter()
            train.fit(
                params, data, settings, Path(ckpt) / str(random_state), "bench", None, random_state
            )
            return time.perf_counter() - start

        fit(True), fit(False)  # warm-up
        for _ in range(cli.repeats):
            times["with random state"].append(fit(True))
            times["without"].append(fit(False))
    med = {name: statistics.median(values) for name, values in times.items()}
    epochs = params.train.max_epochs
    print(f"default train, {epochs} epochs, checkpoint every epoch, {cli.repeats} pairs")
    for name, values in times.items():
        print(
            f"  {name:17s} median {med[name]:.3f} s  runs {', '.join(f'{v:.3f}' for v in values)}"
        )
    print(
        f"  ratio with/without (medians): {med['with random state'] / med['without']:.3f}"
        "  (target <= 1.01)"
    )


if __name__ == "__main__":
    main()
