"""World-size invariant mode against plain DDP: optimizer-step time at 2 CPU processes.

Prepares the default data once, then alternates fresh trainings of the
pipeline model at 2 gloo processes and the same global batch: plain DDP
(batch B/2 per rank, one all-reduce) and ``train.world_size_invariant``
with micro-batches of B/2 (one per rank and step), of B/4 (two) and of B/8
(four); and plain DDP with Lightning's gradient accumulation over the
micro-batches of B/4 and B/8 (what cutting the batch costs without the
mode). Each training times its optimizer steps on rank 0 after a warm-up
epoch (from one step's end to the next, validation left out) and prints
the median; this prints the medians over the repeats, each mode's ratio to plain DDP
(of the medians, and the median of each repeat's own ratio: the host's
load drifts less within a repeat), on the workload's default model and on
a wider one of about 10M parameters.

    .venv/bin/python benchmarks/overhead/invariant_overhead.py [--repeats 3] [--epochs 3]
        [--batch B] [--models both|default|10m] [--workload lm|digits]
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

#: Each workload's model at about 10M parameters: the digits CNN with a hidden layer of
#: 19,500 (512 x 19500 + 19500 x 10 weights); the transformer 6 layers wide 384.
MODEL_10M = {
    "digits": ["model.init_args.hidden=19500"],
    "lm": ["model.init_args.n_layer=6", "model.init_args.n_head=6", "model.init_args.n_embd=384"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3, help="the first is warm-up")
    parser.add_argument("--batch", type=int, help="global batch (divisible by 8; default: params')")
    parser.add_argument(
        "--models", choices=("both", "default", "10m"), default="both", help="which models to time"
    )
    add_workload_argument(parser)
    add_worker_arguments(parser)
    cli = parser.parse_args()
    if cli.train is not None:  # a worker (or the rank Lightning started)
        time_training(cli.train, cli.set, cli.accumulate)
        return
    params = workload_params(cli.workload)
    cli.batch = cli.batch or params.batch_size
    if cli.batch % 8:
        parser.error(f"the global batch {cli.batch} does not split into 8 micro-batches")
    common = ["train.strategy=ddp", "train.devices=2", f"train.max_epochs={cli.epochs}"]
    # Plain DDP's data.init_args.batch_size is per rank; the mode's is the global batch.
    # Each mode: its overrides, and Lightning's accumulate_grad_batches for plain DDP.
    micros = {cli.batch // 2: 1, cli.batch // 4: 2, cli.batch // 8: 4}  # size: per rank
    modes: dict[str, tuple[list[str], int]] = {
        "plain DDP": ([f"data.init_args.batch_size={cli.batch // 2}"], 1),
        **{
            f"invariant, micro {micro}": (
                [
                    f"data.init_args.batch_size={cli.batch}",
                    "train.world_size_invariant=true",
                    f"train.micro_batch_size={micro}",
                ],
                1,
            )
            for micro in micros
        },
        # The mode's micro-batches without the mode: what cutting the batch alone costs.
        **{
            f"plain DDP, accumulate {k}": ([f"data.init_args.batch_size={micro}"], k)
            for micro, k in micros.items()
            if k > 1
        },
    }
    models = {"default model": [], "~10M-parameter model": MODEL_10M[cli.workload]}
    if cli.models != "both":
        models = dict([list(models.items())[cli.models == "10m"]])
    times: dict[tuple[str, str], list[float]] = {(m, k): [] for m in models for k in modes}
    with prepared_data(params) as data:
        for _ in range(cli.repeats):
            for model, model_set in models.items():
                for mode, (mode_set, accumulate) in modes.items():
                    overrides = [*data, *common, *model_set, *mode_set]
                    result = timed_training(__file__, cli.workload, overrides, accumulate)
                    times[(model, mode)].append(result["step_s"])
    time_draws()
    print(
        f"{cli.workload}, 2 gloo processes, global batch {cli.batch}, {cli.repeats} interleaved "
        "fresh trainings"
    )
    for model in models:
        base = statistics.median(times[(model, "plain DDP")])
        print(f"  {model}:")
        for mode in modes:
            runs = times[(model, mode)]
            median = statistics.median(runs)
            # Each repeat's own ratio: the host's load drifts less within a repeat.
            pairs = zip(runs, times[(model, "plain DDP")], strict=True)
            paired = statistics.median(t / plain for t, plain in pairs)
            each = ", ".join(f"{1000 * t:.1f}" for t in runs)
            print(
                f"    {mode:26s} median step {1000 * median:8.2f} ms  "
                f"ratio to plain DDP {median / base:.2f}, paired {paired:.2f}  (runs {each})"
            )


def time_draws() -> None:
    """One sample's shift drawn each way the data module can (per call, one process)."""
    import timeit

    import numpy as np

    from reprotrain.distributed.microbatches import sample_integers, sample_rng

    key, calls = (2**61 + 5, 17), 20000
    draws = {
        "sample_integers (the mode)": lambda: sample_integers(key, -1, 2, 2),
        "sample_rng(key).integers": lambda: sample_rng(key).integers(-1, 2, size=2),
        "np.random.randint (plain DDP's workers)": lambda: np.random.randint(-1, 2, size=2),
    }
    print("one sample's shift (dy, dx), per call:")
    for name, draw in draws.items():
        print(f"  {name:40s} {timeit.timeit(draw, number=calls) / calls * 1e6:6.1f} us")


if __name__ == "__main__":
    main()
