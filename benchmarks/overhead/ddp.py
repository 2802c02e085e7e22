"""DDP on CPU: step time of 2 gloo processes against 1 process, on the same global batch.

Prepares the default data once, then alternates fresh trainings of the
pipeline model: ``strategy: ddp`` with 1 process (batch B) and with 2
processes (batch B/2 each, so the same B samples per optimizer step). Each
training times its optimizer steps on rank 0 after a warm-up epoch (from
one step's end to the next, validation left out) and prints the median;
this prints the medians over the repeats and the ratio (2 processes / 1
process: above 1 means slower). On the 2-core build machine little
speed-up is possible: the point is the overhead of the path (all-reduce,
two interpreters on two cores), measured.

    .venv/bin/python benchmarks/overhead/ddp.py [--repeats 3] [--epochs 4] [--batch B]
        [--workload lm|digits]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # python benchmarks/<group>/<script>.py: import from the root

from benchmarks._common.workspace import (
    add_worker_arguments,
    add_workload_argument,
    prepared_data,
    time_training,
    timed_training,
    workload_params,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=4, help="the first is warm-up")
    parser.add_argument("--batch", type=int, help="global batch (even; default: the params')")
    add_workload_argument(parser)
    add_worker_arguments(parser)
    cli = parser.parse_args()
    if cli.train is not None:  # a worker (or a rank Lightning started)
        time_training(cli.train, cli.set)
        return
    params = workload_params(cli.workload)
    cli.batch = cli.batch or params.batch_size
    layouts = {"1 process": (1, cli.batch), "2 processes": (2, cli.batch // 2)}
    results: dict[str, list[dict]] = {name: [] for name in layouts}
    with prepared_data(params) as data:
        for _ in range(cli.repeats):
            for name, (devices, batch) in layouts.items():
                overrides = [*data, "train.strategy=ddp", f"train.devices={devices}"]
                overrides += [
                    f"train.max_epochs={cli.epochs}",
                    f"data.init_args.batch_size={batch}",
                ]
                results[name].append(timed_training(__file__, cli.workload, overrides))
    print(
        f"{cli.workload}, global batch {cli.batch}, {cli.repeats} interleaved fresh trainings "
        "each, gloo on CPU"
    )
    medians = {}
    for name, runs in results.items():
        medians[name] = statistics.median(r["step_s"] for r in runs)
        each = ", ".join(f"{1000 * r['step_s']:.2f}" for r in runs)
        per_rank = layouts[name][1]
        print(
            f"  {name:11s} batch {per_rank:3d} per rank, {runs[0]['threads']} thread(s) each: "
            f"median step {1000 * medians[name]:.2f} ms (runs {each})"
        )
    ratio = medians["2 processes"] / medians["1 process"]
    print(f"  step time, 2 processes / 1 process = {ratio:.2f}")


if __name__ == "__main__":
    main()
