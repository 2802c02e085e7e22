"""Wall time of one default `train` stage, and its ratio to a bare Lightning loop.

Both sides run in this one process, interleaved (ours, bare, ours, bare, ...)
after a warm-up of each, on the same data (``--workload``), model, seed and
determinism flags. "Ours" is the real stage function (determinism set-up,
resolving and checking the model and data module params.yaml names, data
checks, in-memory logger, atomic safetensors/JSON/CSV writes); "bare" is
`seed_everything` + `Trainer(deterministic=True, logger=False).fit` on the
same LightningModule and data module, built by their constructors, the data
module's datasets in the same loaders (``PipelineLoaders``). Process start-up
and imports are the same for both and are left out of the ratio; one fresh
`reprotrain train` process (imports and the hash-seed restart included) is
timed separately.
Target: ratio of medians <= 1.02.

    .venv/bin/python benchmarks/overhead/overhead.py [--repeats 8] [--epochs N]
        [--workload lm|digits]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import lightning as L

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # python benchmarks/<group>/<script>.py: import from the root

from benchmarks._common.workspace import (
    WORKLOADS,
    add_workload_argument,
    data_overrides,
    train_workspace,
    workload_params,
)
from reprotrain.determinism import reexec_with_fixed_hash_seed
from reprotrain.pipeline.data import PipelineLoaders
from reprotrain.pipeline.recipe import resolve_recipe
from reprotrain.pipeline.stages import train


def overrides_as_flags(overrides: list[str]) -> list[str]:
    return [flag for item in overrides for flag in ("-S", item)]


def stage_flags(args: argparse.Namespace) -> list[str]:
    """The train stage's command-line flags for ``args`` (what `reprotrain train` parses)."""
    flags = []
    for key, value in vars(args).items():
        flag = f"--{key.replace('_', '-')}"
        if value is None or value is False:
            continue
        if value is True:
            flags.append(flag)
        elif isinstance(value, list):
            flags += [f"{flag}={item}" for item in value]
        else:
            flags.append(f"{flag}={value}")
    return flags


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=None, help="default: the params file's")
    add_workload_argument(parser)
    cli = parser.parse_args()
    overrides = [] if cli.epochs is None else [f"train.max_epochs={cli.epochs}"]
    params = workload_params(cli.workload, overrides)
    # The stage's CPU profile (threads, kernels) works only from process start, as in the CLI.
    reexec_with_fixed_hash_seed(params.cpu.to_profile().variables())

    with train_workspace(params) as (args, params):
        # The data module reads the workspace's prepared file, in here and in the fresh process.
        overrides += data_overrides(args.data[0] if args.data else None)
        recipe = resolve_recipe(params)

        def ours() -> None:
            train.run(params, args)

        def bare() -> None:
            L.seed_everything(params.seed, workers=True, verbose=False)
            # The classes params names, built as a user would (no argument parsing).
            source = recipe.data.cls(**recipe.data.init_args)
            source.setup("fit")
            linked = {name: getattr(source, name) for name in recipe.model.provided}
            module = recipe.model.cls(**recipe.model.init_args, **linked)
            datamodule = PipelineLoaders(source, seed=params.seed)
            L.Trainer(
                accelerator=params.train.accelerator,
                devices=params.train.devices,
                precision=params.train.precision,
                max_epochs=params.train.max_epochs,
                deterministic=True,
                logger=False,
                enable_checkpointing=False,
                enable_model_summary=False,
                enable_progress_bar=False,
                num_sanity_val_steps=0,
            ).fit(module, datamodule=datamodule)

        start = time.perf_counter()
        subprocess.run(
            [
                *(sys.executable, "-m", "reprotrain", "train"),
                *("--params", WORKLOADS[cli.workload]),
                *overrides_as_flags(overrides),
                *stage_flags(args),
            ],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        fresh = time.perf_counter() - start

        ours(), bare()  # warm-up: first-call costs (thread pools, kernels) hit both
        times: dict[str, list[float]] = {"ours": [], "bare": []}
        for _ in range(cli.repeats):
            for name, fn in (("ours", ours), ("bare", bare)):
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)

    med = {name: statistics.median(values) for name, values in times.items()}
    print(f"{cli.workload}: one default train in a fresh process (imports included): {fresh:.2f} s")
    print(
        f"train stage in-process, {params.train.max_epochs} epochs, {cli.repeats} interleaved pairs"
    )
    for name, values in times.items():
        print(f"  {name:5s} median {med[name]:.3f} s  runs {', '.join(f'{v:.3f}' for v in values)}")
    print(f"  ratio ours/bare (medians): {med['ours'] / med['bare']:.3f}  (target <= 1.02)")


if __name__ == "__main__":
    main()
