"""How fast the shard reader feeds a training loop, next to the same data held in memory.

Generates a dataset (numpy, seed 0: ``x`` float32 of ``--shape``, ``y`` int64
in [0, 10)), writes it once as a shard folder (``write_shards``,
``--shard-samples`` per shard) and keeps the same arrays in memory as a
``TensorDataset``. For each ``--workers`` count it reads whole epochs through a
``DataLoader`` (``--batch`` per batch, a ``RandomSampler`` with a seeded
generator, the workers started afresh each epoch as in the pipeline),
alternating in-memory and shard epochs ``--repeats`` times after one warm-up
of each (the warm-up also checks that both give the same batches), and prints
the median samples per second of each and the ratio shards/in-memory.
Goal: >= 0.8 at every worker count.

The shard files were just written, so they are in the page cache: this
measures the reader's own cost (the system calls, the copies, the tensors),
not the disk's.

It also times the order check the tests use: hashing one epoch of
``MicroBatchSampler`` micro-batches (batch 64, micro-batch 16, rank 0 of 1;
sha256 over each micro-batch's sample indices as canonical JSON), and drawing
that order, against reading that epoch's micro-batches from the shards without
workers, and prints the milliseconds and their share of the epoch.

    .venv/bin/python benchmarks/overhead/shard_reader.py [--repeats 5] [--workers 0 2]
        [--samples 20000] [--shape 3 32 32] [--shard-samples 2048] [--batch 64] [--json PATH]
"""

from __future__ import annotations

import argparse
import hashlib
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler, TensorDataset

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # python benchmarks/<group>/<script>.py: import from the root

from benchmarks._common.workloads import cpu_model
from reprotrain.atomic import atomic_write_text
from reprotrain.data.shard_writer import write_shards
from reprotrain.data.shards import ShardedDataset
from reprotrain.distributed.microbatches import MicroBatchSampler
from reprotrain.hashing import canonical_json

MICRO_BATCH = 16
SAMPLER_BATCH = 64
GOAL = 0.8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--shape", type=int, nargs="+", default=[3, 32, 32])
    parser.add_argument("--shard-samples", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, help="also write the figures here, as JSON")
    cli = parser.parse_args()

    rng = np.random.default_rng(0)
    x = rng.random((cli.samples, *cli.shape), dtype=np.float32)
    y = rng.integers(0, 10, cli.samples, dtype=np.int64)
    memory = TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    report: dict = {
        "cpu": cpu_model(),
        "torch": torch.__version__,
        "samples": cli.samples,
        "shape": cli.shape,
        "bytes": x.nbytes + y.nbytes,
        "shard_samples": cli.shard_samples,
        "batch": cli.batch,
        "repeats": cli.repeats,
    }
    print(f"CPU: {report['cpu']} ({platform.machine()}), torch {torch.__version__}")
    print(
        f"{cli.samples} samples of x float32 {tuple(cli.shape)} + y int64 "
        f"({report['bytes'] / 2**20:.1f} MiB), {cli.shard_samples} per shard, "
        f"batch {cli.batch}, {cli.repeats} interleaved epochs per reader after a warm-up"
    )
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "shards"
        write_shards(folder, {"train": {"x": x, "y": y}}, cli.shard_samples)
        shards = ShardedDataset(folder, "train")
        report["held"] = shards.held
        streamed = [field for field in shards.fields if field not in shards.held]
        print(f"shard fields streamed: {streamed}, held in memory: {shards.held}")
        report["readers"] = {
            str(w): compare_readers(memory, shards, cli.batch, w, cli.repeats) for w in cli.workers
        }
        report["order_hash"] = order_hash_cost(shards, cli.repeats)
    if cli.json:
        atomic_write_text(cli.json, canonical_json(report))


def compare_readers(
    memory: Dataset, shards: Dataset, batch: int, workers: int, repeats: int
) -> dict:
    """Interleaved epochs of both readers; their median samples per second and the ratio."""
    check_same_batches(memory, shards, batch, workers)
    rates: dict[str, list[float]] = {"in-memory": [], "shards": []}
    for _ in range(repeats):
        rates["in-memory"].append(epoch_rate(memory, batch, workers))
        rates["shards"].append(epoch_rate(shards, batch, workers))
    med = {name: statistics.median(values) for name, values in rates.items()}
    ratio = med["shards"] / med["in-memory"]
    print(f"num_workers={workers}:")
    for name, values in rates.items():
        runs = ", ".join(f"{v:,.0f}" for v in values)
        print(f"  {name:9s} median {med[name]:>9,.0f} samples/s  runs {runs}")
    verdict = "met" if ratio >= GOAL else "NOT met"
    print(f"  ratio shards/in-memory (medians): {ratio:.3f}  (goal >= {GOAL}: {verdict})")
    return {"samples_per_s": rates, "median": med, "ratio": ratio}


def loader(dataset: Dataset, batch: int, workers: int) -> DataLoader:
    sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(0))  # type: ignore[arg-type]
    return DataLoader(dataset, batch_size=batch, sampler=sampler, num_workers=workers)


def epoch_rate(dataset: Dataset, batch: int, workers: int) -> float:
    """Samples per second over one epoch, the workers' start included."""
    start = time.perf_counter()
    samples = sum(len(y) for _, y in loader(dataset, batch, workers))
    return samples / (time.perf_counter() - start)


def check_same_batches(memory: Dataset, shards: Dataset, batch: int, workers: int) -> None:
    """The warm-up: one epoch of each reader, in the same order; their batches must agree."""
    pairs = zip(loader(memory, batch, workers), loader(shards, batch, workers), strict=True)
    for (x_memory, y_memory), (x_shards, y_shards) in pairs:
        if not (torch.equal(x_memory, x_shards) and torch.equal(y_memory, y_shards)):
            raise SystemExit("the shard reader's batches differ from the in-memory ones")


def draw_order(size: int) -> list[list[int]]:
    """One epoch of the micro-batches the tests check: their sample indices."""
    generator = torch.Generator().manual_seed(0)
    sampler = MicroBatchSampler(size, SAMPLER_BATCH, MICRO_BATCH, 0, 1, generator)
    return [[index for index, _ in micro_batch] for micro_batch in sampler]


def order_hash(micro_batches: list[list[int]]) -> str:
    """The tests' order check: sha256 over each micro-batch's indices as canonical JSON."""
    digest = hashlib.sha256()
    for micro_batch in micro_batches:
        digest.update(canonical_json(micro_batch).encode())
    return digest.hexdigest()


def order_hash_cost(shards: ShardedDataset, repeats: int) -> dict:
    """Drawing and hashing one epoch's order against reading that epoch from the shards."""
    micro_batches = draw_order(len(shards))

    def read_epoch() -> None:
        for _ in DataLoader(shards, batch_sampler=micro_batches, num_workers=0):
            pass

    times: dict[str, list[float]] = {"draw": [], "hash": [], "epoch": []}
    read_epoch(), order_hash(micro_batches)  # warm-up
    for _ in range(repeats):
        times["draw"].append(seconds(lambda: draw_order(len(shards))))
        times["hash"].append(seconds(lambda: order_hash(micro_batches)))
        times["epoch"].append(seconds(read_epoch))
    med = {name: statistics.median(values) for name, values in times.items()}
    share = {
        "hash": 100 * med["hash"] / med["epoch"],
        "draw_and_hash": 100 * (med["draw"] + med["hash"]) / med["epoch"],
    }
    print(
        f"order check, one epoch ({len(micro_batches)} micro-batches of {MICRO_BATCH}, batch "
        f"{SAMPLER_BATCH}), medians:\n"
        f"  sha256 {med['hash'] * 1e3:.1f} ms, drawing the order {med['draw'] * 1e3:.1f} ms; "
        f"reading that epoch from the shards (0 workers) {med['epoch'] * 1e3:.0f} ms\n"
        f"  hash {share['hash']:.1f}% of the epoch, draw + hash {share['draw_and_hash']:.1f}%"
    )
    return {"seconds": times, "median": med, "share_percent": share}


def seconds(work: Callable[[], object]) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
