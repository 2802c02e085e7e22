"""Wall time of one default `train` stage, and its ratio to a bare Lightning loop.

Both sides run in this one process, interleaved (ours, bare, ours, bare, ...)
after a warm-up of each, on the same prepared digits data, model, seed and
determinism flags. "Ours" is the real stage function (determinism set-up,
data checks, in-memory logger, atomic safetensors/JSON/CSV writes); "bare" is
`seed_everything` + `Trainer(deterministic=True, logger=False).fit` on the
same LightningModule and DataModule. Process start-up and imports are the
same for both and are left out of the ratio; one fresh `reprotrain train`
process (imports and the hash-seed restart included) is timed separately.
Target: ratio of medians <= 1.02.

    .venv/bin/python benchmarks/overhead.py [--repeats 8] [--epochs 10]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import lightning as L

from _workspace import ROOT, train_workspace
from reprotrain.determinism import reexec_with_fixed_hash_seed
from reprotrain.pipeline.config import load_params
from reprotrain.pipeline.data import PreparedDataModule, load_prepared
from reprotrain.pipeline.model import Classifier
from reprotrain.pipeline.stages import train


def overrides_as_flags(overrides: list[str]) -> list[str]:
    return [flag for item in overrides for flag in ("-S", item)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=None, help="default: params.yaml")
    cli = parser.parse_args()
    reexec_with_fixed_hash_seed()
    overrides = [] if cli.epochs is None else [f"train.max_epochs={cli.epochs}"]
    params = load_params(ROOT / "params.yaml", overrides)

    with train_workspace(params) as args:

        def ours() -> None:
            train.run(params, args)

        def bare() -> None:
            L.seed_everything(params.seed, workers=True, verbose=False)
            data = load_prepared(args.data)
            module = Classifier(params.model, params.train, data.input_shape, data.num_classes)
            datamodule = PreparedDataModule(
                data,
                params.data.init_args.batch_size,
                params.data.init_args.num_workers,
                params.data.init_args.augment,
                params.seed,
            )
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
            [sys.executable, "-m", "reprotrain", "train", *overrides_as_flags(overrides)]
            + [
                f"--{key.replace('_', '-')}={value}"
                for key, value in vars(args).items()
                if value is not None
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
    print(f"one default train in a fresh process (imports included): {fresh:.2f} s")
    print(
        f"train stage in-process, {params.train.max_epochs} epochs, {cli.repeats} interleaved pairs"
    )
    for name, values in times.items():
        print(f"  {name:5s} median {med[name]:.3f} s  runs {', '.join(f'{v:.3f}' for v in values)}")
    print(f"  ratio ours/bare (medians): {med['ours'] / med['bare']:.3f}  (target <= 1.02)")


if __name__ == "__main__":
    main()
