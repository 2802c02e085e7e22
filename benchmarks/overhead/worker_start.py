"""What starting DataLoader workers from a fork server costs a DDP rank, against forking them.

Each measurement is a fresh process holding a one-rank gloo process group (as
a rank does, its threads included) that reads the digits training split
through ``num_workers`` workers for ``--epochs`` epochs, new workers each
epoch as the pipeline's training loader has them, started either by fork or
from the fork server :func:`reprotrain.distributed.ddp.worker_start` gives
(with Lightning's worker seeding, as in training). Fresh processes, because
the fork server is started once per process: its start is part of the cost.
Prints the median wall seconds of each way, interleaved, and their difference
and ratio.

    .venv/bin/python benchmarks/overhead/worker_start.py [--repeats 5] [--epochs 3] [--workers 2]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # python benchmarks/<group>/<script>.py: import from the root

from benchmarks._common.child import run_json


def measure(way: str, data: str, epochs: int, workers: int) -> None:
    """The worker side: one process, one way of starting workers; prints its seconds."""
    import torch.distributed as dist
    from lightning.fabric.utilities.seed import pl_worker_init_function
    from torch.utils.data import DataLoader

    from reprotrain.distributed.ddp import worker_start
    from reprotrain.recipes.digits import DigitsData

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    source = DigitsData(path=data, batch_size=64, num_workers=workers)
    source.setup("fit")
    dataset = source.train_dataset()
    started = time.perf_counter()
    context = worker_start(dataset, None) if way == "fork server" else None
    for _ in range(epochs):
        loader = DataLoader(
            dataset, batch_size=64, num_workers=workers, multiprocessing_context=context,
            worker_init_fn=functools.partial(pl_worker_init_function, rank=0),
        )  # fmt: skip
        for _ in loader:
            pass
    print(json.dumps({"seconds": time.perf_counter() - started}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--measure", nargs=2, metavar=("WAY", "DATA"), help=argparse.SUPPRESS)
    cli = parser.parse_args()
    if cli.measure:
        measure(cli.measure[0], cli.measure[1], cli.epochs, cli.workers)
        return
    ways = ("fork", "fork server")
    seconds: dict[str, list[float]] = {way: [] for way in ways}
    with tempfile.TemporaryDirectory() as work:
        data = Path(work) / "digits.safetensors"
        (Path(work) / "raw").mkdir()
        (Path(work) / "params.yaml").write_text((ROOT / "params.yaml").read_text())
        subprocess.run(
            [sys.executable, "-m", "reprotrain", "prepare", "--raw-dir", "raw", "--out", data],
            cwd=work, check=True, capture_output=True,
        )  # fmt: skip
        for _ in range(cli.repeats):
            for way in ways:
                argv = [__file__, "--measure", way, data, "--epochs", cli.epochs]
                argv += ["--workers", cli.workers]
                seconds[way].append(run_json(argv, way)["seconds"])
    print(
        f"digits training split, {cli.epochs} epochs, {cli.workers} workers, "
        f"{cli.repeats} interleaved fresh processes each, one-rank gloo group"
    )
    medians = {way: statistics.median(seconds[way]) for way in ways}
    for way in ways:
        runs = ", ".join(f"{s:.2f}" for s in seconds[way])
        print(f"  {way:11s}: median {medians[way]:.2f} s (runs {runs})")
    extra = medians["fork server"] - medians["fork"]
    ratio = medians["fork server"] / medians["fork"]
    print(f"  fork server - fork = {extra:.2f} s per process; fork server / fork = {ratio:.2f}")


if __name__ == "__main__":
    main()
