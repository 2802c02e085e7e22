"""Shard folders (reprotrain.data.shards): the format, its checks, and one order for any
worker count and world size; the memory-cap run is slow (it writes ~5 GiB)."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from reprotrain.data import shards
from reprotrain.data.shard_writer import ShardWriter, write_shards
from reprotrain.data.shards import INDEX, ShardedDataset, ShardError, check_shards
from reprotrain.distributed.microbatches import MicroBatchSampler
from reprotrain.pipeline.data import SampleSeeded
from tests.helpers import cli_env

SAMPLES = 1000


def _arrays(samples: int = SAMPLES) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.random((samples, 2, 3), dtype=np.float32)
    return {"x": x, "y": np.arange(samples, dtype=np.int64)}  # y: the sample's own number


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    arrays = _arrays()
    write_shards(tmp_path / "shards", {"train": arrays, "val": _arrays(10)}, 128)
    return tmp_path / "shards"


@pytest.fixture(params=["held", "streamed"])
def reading(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways a field is read: held in memory (a small field, the default here) or
    streamed row by row from its shards (every field, with no bytes allowed to be held)."""
    if request.param == "streamed":
        monkeypatch.setattr(shards, "HELD_BYTES", 0)
    return request.param


def test_a_split_reads_back_sample_for_sample(folder: Path, reading: str) -> None:
    arrays, dataset = _arrays(), ShardedDataset(folder, "train")
    assert bool(dataset._held) == (reading == "held")
    assert len(dataset) == SAMPLES and dataset.fields == ["x", "y"]
    for i in (0, 127, 128, 999):
        x, y = dataset[i]
        assert torch.equal(x, torch.from_numpy(arrays["x"][i])) and int(y) == i
    with pytest.raises(IndexError):
        dataset[SAMPLES]
    shuffled = np.random.default_rng(1).permutation(SAMPLES).tolist()
    batches = [list(range(120, 260)), shuffled[:300], [5, 6, 7, 3, 4, 127, 128, 129, 999, 0]]
    for batch in batches:  # runs across a shard's end, runs of one, runs broken by order
        x, y = (torch.stack(column) for column in zip(*dataset.__getitems__(batch), strict=True))
        assert torch.equal(x, torch.from_numpy(arrays["x"][batch])) and y.tolist() == batch
    assert len(ShardedDataset(folder, "val")) == 10
    with pytest.raises(ShardError, match="no split 'test'"):
        ShardedDataset(folder, "test")


def test_the_same_data_writes_the_same_bytes(tmp_path: Path, folder: Path) -> None:
    write_shards(tmp_path / "again", {"train": _arrays(), "val": _arrays(10)}, 128)
    assert _tree(tmp_path / "again") == _tree(folder)
    chunked = tmp_path / "chunked"  # written a chunk at a time: the same folder
    with ShardWriter(chunked, 128) as writer:
        arrays = _arrays()
        for start in range(0, SAMPLES, 300):
            writer.add("train", {k: v[start : start + 300] for k, v in arrays.items()})
        writer.add("val", _arrays(10))
    assert _tree(chunked) == _tree(folder)


def _tree(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_a_failed_write_leaves_the_previous_folder(folder: Path) -> None:
    before = _tree(folder)
    with pytest.raises(RuntimeError), ShardWriter(folder, 16) as writer:
        writer.add("train", _arrays(100))
        raise RuntimeError("killed mid-write")
    assert _tree(folder) == before
    assert [p.name for p in folder.parent.iterdir()] == ["shards"]  # no temporary folder left


def _rewrite(path: Path, change) -> None:  # type: ignore[no-untyped-def]
    data = bytearray(path.read_bytes())
    path.write_bytes(bytes(change(data)))


def _flip_last(data: bytearray) -> bytearray:
    data[-1] ^= 0xFF
    return data


@pytest.mark.parametrize(
    ("damage", "message", "hashes"),
    [
        (lambda f: (f / "train-00003-x.npy").unlink(), "train-00003-x.npy: shard missing", False),
        (lambda f: _rewrite(f / "train-00003-x.npy", lambda d: d[:-5]), "truncated", False),
        (lambda f: _rewrite(f / "train-00003-y.npy", lambda d: d + b"\0" * 8), "extended", False),
        (lambda f: _rewrite(f / "train-00003-x.npy", _flip_last), "altered", True),
        (lambda f: (f / "train-00003-x.npy").write_bytes(b"not npy"), "not a readable", False),
        (lambda f: (f / INDEX).unlink(), "no shard index", False),
        (lambda f: (f / INDEX).write_text("{"), "unreadable shard index", False),
    ],
    ids=["missing", "truncated", "extended", "altered", "not-npy", "no-index", "bad-index"],
)
def test_a_damaged_folder_is_refused_naming_the_file(
    folder: Path, damage, message: str, hashes: bool
) -> None:  # type: ignore[no-untyped-def]
    check_shards(folder, hashes=True)  # the control: intact
    damage(folder)
    with pytest.raises(ShardError, match=message) as err:
        check_shards(folder, hashes=hashes)
    assert len(str(err.value).splitlines()) == 1
    if hashes:  # sizes alone cannot see an altered byte: the full check is what finds it
        check_shards(folder, hashes=False)


def test_an_index_naming_more_samples_than_a_shard_holds_is_refused(folder: Path) -> None:
    index = json.loads((folder / INDEX).read_text())
    index["splits"]["train"]["shards"][-1]["samples"] += 5
    index["splits"]["train"]["samples"] += 5
    (folder / INDEX).write_text(json.dumps(index))
    with pytest.raises(ShardError, match=r"train-00007-x.npy: holds 104 samples, the index names"):
        ShardedDataset(folder, "train")


def test_forked_workers_read_what_the_main_process_reads(folder: Path, reading: str) -> None:
    dataset = ShardedDataset(folder, "train")
    dataset[0]  # the main process has its files open before the fork
    batches = [
        torch.cat([b[1] for b in DataLoader(dataset, batch_size=64, num_workers=workers)])
        for workers in (0, 2)
    ]
    assert torch.equal(batches[0], batches[1]) and torch.equal(batches[0], torch.arange(SAMPLES))
    assert bool(dataset._held) == (reading == "held")


def _order_hash(folder: Path, world_size: int, workers: int, epochs: int = 2) -> str:
    """sha256 of every global step's samples, micro-batch by micro-batch, gathered from the
    ranks of one world size (each rank's loader as the pipeline builds it, in this process)."""
    batch, micro = 64, 16
    dataset = SampleSeeded(ShardedDataset(folder, "train"))
    loaders = []
    for rank in range(world_size):
        generator = torch.Generator().manual_seed(7)  # every rank's generator alike
        sampler = MicroBatchSampler(SAMPLES, batch, micro, rank, world_size, generator)
        loaders.append(DataLoader(dataset, batch_sampler=sampler, num_workers=workers))
    digest = hashlib.sha256()
    for _ in range(epochs):
        per_rank = [[b[1].tolist() for b in loader] for loader in loaders]
        per_step = batch // micro // world_size
        for step in range(len(per_rank[0]) // per_step):
            for rank in range(world_size):  # micro-batch j lives on rank j // per_step
                for micro_batch in per_rank[rank][step * per_step : (step + 1) * per_step]:
                    digest.update(json.dumps(micro_batch).encode())
    return digest.hexdigest()


@pytest.mark.parametrize(
    "layouts",
    [
        [(2, 0), (4, 0), (1, 1)],
        pytest.param([(w, n) for w in (1, 2, 4) for n in (0, 1, 4)][1:], marks=pytest.mark.slow),
    ],
    ids=["quick", "every-layout"],
)
def test_one_order_for_any_worker_count_and_world_size(
    folder: Path, layouts: list[tuple[int, int]]
) -> None:
    reference = _order_hash(folder, 1, 0)
    for world_size, workers in layouts:
        assert _order_hash(folder, world_size, workers) == reference, (world_size, workers)


def test_plain_distributed_sampling_orders_by_world_size(folder: Path) -> None:
    """The negative control: with torch's DistributedSampler a step holds the same samples
    at any world size, but in other groups (rank by rank), so the sums, and the bits, differ."""

    def steps(world_size: int) -> list[list[int]]:
        loaders = [
            DataLoader(
                ShardedDataset(folder, "train"),
                batch_size=64 // world_size,
                sampler=DistributedSampler(range(SAMPLES), world_size, rank, seed=7),
            )
            for rank in range(world_size)
        ]
        ranks = [[b[1].tolist() for b in loader] for loader in loaders]
        return [[i for r in ranks for i in r[s]] for s in range(len(ranks[0]))]

    one, two = steps(1), steps(2)
    assert [sorted(s) for s in one[:5]] == [sorted(s) for s in two[:5]]
    assert one[:5] != two[:5]


WORKER = textwrap.dedent(
    """
    import resource, sys
    import numpy as np, torch
    from torch.utils.data import DataLoader, TensorDataset
    from reprotrain.data.shards import ShardedDataset, read_index

    folder, path = sys.argv[1], sys.argv[2]
    if path == "shards":
        dataset = ShardedDataset(folder, "train")
    else:  # the in-memory path: every shard loaded, as a prepared file is
        index = read_index(folder)["splits"]["train"]["shards"]
        x = np.concatenate([np.load(f"{folder}/{s['files']['x']['name']}") for s in index])
        y = np.concatenate([np.load(f"{folder}/{s['files']['y']['name']}") for s in index])
        dataset = TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(dataset, batch_size=32, shuffle=True)
    steps = 0
    for x, y in loader:
        loss = torch.nn.functional.cross_entropy(model(x.mean(dim=(2, 3))), y % 10)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        steps += 1
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(steps, len(dataset), peak)
    """
)


@pytest.mark.slow
def test_training_on_three_times_the_memory_cap_stays_under_it(tmp_path: Path) -> None:
    cap = 1600 << 20  # address space of the training process (RLIMIT_AS), bytes
    sample = (16, 64, 64)  # 256 KiB of float32 per sample
    samples = 3 * cap // (4 * int(np.prod(sample))) + 1
    folder = tmp_path / "big"
    try:
        rng = np.random.default_rng(0)
        with ShardWriter(folder, 2048) as writer:
            for start in range(0, samples, 1024):
                n = min(1024, samples - start)
                x = rng.standard_normal((n, *sample), dtype=np.float32)
                writer.add("train", {"x": x, "y": np.arange(start, start + n)})
        size = sum(p.stat().st_size for p in folder.iterdir())
        assert size > 3 * cap

        def train(path: str) -> subprocess.CompletedProcess:
            limit = f"import resource; resource.setrlimit(resource.RLIMIT_AS, ({cap}, {cap}))"
            code = f"{limit}\n{WORKER}"
            return subprocess.run(
                [sys.executable, "-c", code, str(folder), path],
                env=cli_env(MALLOC_ARENA_MAX="2", OMP_NUM_THREADS="1"),
                capture_output=True,
                text=True,
                timeout=600,
            )

        streamed = train("shards")
        assert streamed.returncode == 0, streamed.stderr[-2000:]
        steps, seen, peak = map(int, streamed.stdout.split())
        assert seen == samples and steps == -(-samples // 32)
        assert peak < cap, f"peak RSS {peak >> 20} MiB over the {cap >> 20} MiB cap"
        in_memory = train("memory")  # the negative control: the whole split in memory
        assert in_memory.returncode != 0 and "MemoryError" in in_memory.stderr
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # ~5 GiB: not for pytest's kept tmp dirs
