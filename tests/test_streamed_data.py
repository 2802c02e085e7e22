"""The pipeline on a shard folder (docs/data.md): prepare writes it, train checks and streams it.

The library's own tests (tests/test_shards.py) cover the format, the reader,
the order across workers and world sizes and the memory cap. Here: the
``prepare`` stage's folder holds what its tensor file holds; a folder is hashed
as DVC hashes one and refused by file name when it differs; a resumed epoch
skips its consumed micro-batches without reading them, with any worker count;
the worker count leaves the run ID only where it cannot decide the bits. The
slow ones train through the stage: the same weights from the file and from the
folder, at several worker counts and world sizes, and kill or SIGTERM then
resume with another worker count; in plain mode another count is refused.
"""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import Dataset

from reprotrain.distributed.microbatches import MicroBatchSampler
from reprotrain.pipeline.prepared import PreparedShards, load_prepared
from reprotrain.pipeline.resumable_loader import ResumableLoader
from reprotrain.provenance.dvcchecksum import ChecksumError, md5_dir, verify_dvc_checksum
from tests.helpers import (
    ROOT,
    kill_after_checkpoint,
    run_checked,
    run_cli,
    signal_after_checkpoint,
    train_argv,
)

INVARIANT = ("-S", "train.world_size_invariant=true", "-S", "train.max_epochs=2")


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default digits data prepared as a shard folder by the real CLI."""
    work = tmp_path_factory.mktemp("shards")
    (work / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    out = work / "digits"
    argv = ("prepare", "--raw-dir", work, "--out", out, "--samples-per-shard", "300")
    result = run_cli(*argv, cwd=work)
    assert result.returncode == 0, result.stderr
    return out


def test_the_prepared_folder_holds_the_prepared_files_splits(shards: Path, prepared: Path) -> None:
    folder, file = load_prepared(shards), load_prepared(prepared)
    assert isinstance(folder, PreparedShards)
    assert (folder.num_classes, folder.input_shape) == (file.num_classes, file.input_shape)
    for split in ("train", "val", "test"):
        x, y = file.split(split)
        streamed = folder.dataset(split)
        rows = streamed.__getitems__(list(range(len(streamed))))
        assert torch.equal(torch.stack([r[0] for r in rows]), x)
        assert torch.equal(torch.stack([r[1] for r in rows]), y)
    assert len(list(shards.glob("train-*-x.npy"))) == 5  # 1,257 samples, 300 per shard


def test_a_folder_is_hashed_as_dvc_hashes_it_and_a_changed_file_is_named(tmp_path: Path) -> None:
    folder = tmp_path / "data"
    (folder / "sub").mkdir(parents=True)
    for name, text in {"a.npy": "a", "b.npy": "b", "sub/c.npy": "c"}.items():
        (folder / name).write_text(text)
    run_checked("dvc", "init", "--no-scm", "-q", cwd=tmp_path)
    run_checked("dvc", "add", "-q", "data", cwd=tmp_path)
    lock = tmp_path / "dvc.lock"  # absent: the .dvc file beside the folder is read
    assert verify_dvc_checksum(folder, lock) == (md5_dir(folder), md5_dir(folder))
    # DVC's link in the workspace is replaced by a changed copy of the same size.
    (folder / "b.npy").unlink()
    (folder / "b.npy").write_text("B")
    with pytest.raises(ChecksumError, match=r"changed: \S*data/b\.npy \(altered\); "):
        verify_dvc_checksum(folder, lock)
    (folder / "sub/c.npy").unlink()
    (folder / "d.npy").write_text("d")
    names = r"data/b\.npy \(altered\), \S*data/d\.npy \(added\), \S*data/sub/c\.npy \(missing\)"
    with pytest.raises(ChecksumError, match=names):
        verify_dvc_checksum(folder, lock)


class _Reads(Dataset):
    """Items are their own index; every index read is noted."""

    def __init__(self) -> None:
        self.read: list[int] = []

    def __len__(self) -> int:
        return 64

    def __getitem__(self, item: tuple[int, tuple[int, int]]) -> int:
        self.read.append(item[0])
        return item[0]


def _loader(dataset: Dataset, workers: int) -> ResumableLoader:
    generator = torch.Generator().manual_seed(7)
    sampler = MicroBatchSampler(64, 16, 4, 0, 1, generator)
    return ResumableLoader(
        dataset, consumed=lambda: 0, batch_sampler=sampler, generator=generator,
        num_workers=workers,
    )  # fmt: skip


@pytest.mark.parametrize("workers", [0, 2])
def test_a_resumed_epoch_starts_past_its_consumed_micro_batches_without_reading_them(
    workers: int,
) -> None:
    whole = _loader(_Reads(), 0)
    state = {"epoch_start": whole.generator.get_state(), "consumed": 5}
    expected = [batch.tolist() for batch in whole]
    dataset = _Reads()
    resumed = _loader(dataset, workers)
    resumed.generator.manual_seed(99)  # the checkpoint's state is what counts
    resumed.load_state_dict(state)
    assert [batch.tolist() for batch in resumed] == expected[5:]
    if workers == 0:
        assert sorted(dataset.read) == sorted(i for b in expected[5:] for i in b)
    # The next epoch starts at its first micro-batch again.
    assert len(list(resumed)) == len(expected)


def _record(*overrides: str) -> dict:
    from reprotrain.pipeline.params_file import load_params
    from reprotrain.pipeline.recipe import resolve_recipe
    from reprotrain.pipeline.run_record import recipe_record

    params = load_params(ROOT / "params.yaml", list(overrides))
    return recipe_record(resolve_recipe(params), params)["data"]["init_args"]


def test_the_worker_count_leaves_the_run_id_only_where_draws_are_keyed_per_sample() -> None:
    assert "num_workers" not in _record("train.world_size_invariant=true")
    # Negative control: in plain mode each worker's stream decides the bits.
    assert _record("train.world_size_invariant=false")["num_workers"] == 2


# -- through the train stage -----------------------------------------------------------------


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "model.safetensors")


def _same_weights(a: Path, b: Path) -> bool:
    wa, wb = _weights(a), _weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def _train(data: Path, env: Path, out: Path, *overrides: str) -> Path:
    out.mkdir()
    result = run_cli(*train_argv(data, env, out, *overrides), cwd=out)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def _layout(world: int, workers: int) -> tuple[str, ...]:
    strategy = "ddp" if world > 1 else "single_device"
    return (
        *("-S", f"train.devices={world}", "-S", f"train.strategy={strategy}"),
        *("-S", f"data.init_args.num_workers={workers}"),
    )


@pytest.mark.slow
def test_the_folder_trains_the_files_weights_at_any_worker_count_and_world_size(
    shards: Path, prepared: Path, env_record: Path, tmp_path: Path
) -> None:
    reference = _train(prepared, env_record, tmp_path / "file", *INVARIANT, *_layout(1, 2))
    # Worker counts 0, 1 and 4, world sizes 1, 2 and 4, both above one at (2, 1); (4, 4)
    # would add sixteen worker processes, each started from a rank's fork server.
    layouts = [(1, 0), (1, 4), (2, 1), (4, 0)]
    runs = {
        layout: _train(shards, env_record, tmp_path / f"w{layout}", *INVARIANT, *_layout(*layout))
        for layout in layouts
    }
    for layout, run in runs.items():
        assert _same_weights(run, reference), layout
    ids = {json.loads((run / "run.json").read_text())["run_id"] for run in runs.values()}
    assert len(ids) == 1, ids
    # Negative control: plain DDP at world size 2 trains other weights from the same folder.
    plain = _train(shards, env_record, tmp_path / "plain", "-S", "train.max_epochs=2",
                   *_layout(2, 2))  # fmt: skip
    assert not _same_weights(plain, reference)


def _resume_argv(shards: Path, env: Path, out: Path, workers: int, *mode: str) -> list[str]:
    three = ("-S", "train.max_epochs=3", "-S", "train.checkpoint_every_n_epochs=1")
    return train_argv(shards, env, out, *mode, *three, *_layout(1, workers))


@pytest.mark.slow
@pytest.mark.parametrize(
    "stop",
    ["kill -9 in epoch 1", "SIGTERM in epoch 1", "kill -9 in epoch 2"],
)
def test_a_stopped_run_resumes_with_another_worker_count_to_the_same_bits(
    stop: str, shards: Path, env_record: Path, tmp_path: Path
) -> None:
    invariant = ("-S", "train.world_size_invariant=true")
    straight = tmp_path / "straight"
    straight.mkdir()
    result = run_cli(*_resume_argv(shards, env_record, straight, 2, *invariant), cwd=straight)
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "stopped"
    out.mkdir()
    argv = _resume_argv(shards, env_record, out, 2, *invariant)
    if stop.startswith("SIGTERM"):
        code, stderr = signal_after_checkpoint(argv, out, signal.SIGTERM)
        assert code == 130, stderr
    else:
        kill_after_checkpoint(argv, out / "ckpt", int(stop[-1]) - 1, out)
    resumed = run_cli(*_resume_argv(shards, env_record, out, 0, *invariant), cwd=out)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from epoch=" in resumed.stdout, resumed.stdout
    assert _same_weights(out, straight)
    for name in ("trace.safetensors", "metrics.json", "plots/train_loss.csv", "run.json"):
        assert (out / name).read_bytes() == (straight / name).read_bytes(), name


@pytest.mark.slow
def test_plain_mode_refuses_to_resume_with_another_worker_count(
    shards: Path, env_record: Path, tmp_path: Path
) -> None:
    argv = _resume_argv(shards, env_record, tmp_path, 2)
    kill_after_checkpoint(argv, tmp_path / "ckpt", 0, tmp_path)
    result = run_cli(*_resume_argv(shards, env_record, tmp_path, 1), cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert "num_workers 2, this run has 1" in last and "set num_workers back" in last, last
    assert not (tmp_path / "model.safetensors").exists()
    # Control: with the count it was interrupted with, it resumes.
    result = run_cli(*argv, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "resumed from epoch=" in result.stdout
    shutil.rmtree(tmp_path / "ckpt", ignore_errors=True)


# -- through DVC ---------------------------------------------------------------------------


def _use_shards(repo: Path) -> str:
    """Switch ``repo``'s digits pipeline to a shard folder: the edits docs/data.md lists."""
    folder = "data/prepared/digits"
    dvc_yaml = repo / "dvc.yaml"
    text = dvc_yaml.read_text().replace("data/prepared/dataset.safetensors", folder)
    text = text.replace(f"--out {folder}", f"--out {folder} --samples-per-shard 256")
    dvc_yaml.write_text(text)
    params = repo / "params.yaml"
    params.write_text(params.read_text().replace("data/prepared/dataset.safetensors", folder))
    return folder


def _rewrite(path: Path, data: bytes) -> None:
    path.unlink()  # DVC may have linked it to its cache: never write through
    path.write_bytes(data)


@pytest.mark.slow
def test_dvc_repro_trains_from_a_shard_folder_and_a_changed_shard_is_named(
    repo_copy: Path,
) -> None:
    import hashlib

    import yaml

    from tests.helpers import stage_argv

    reference = load_file(repo_copy / "models/model.safetensors")
    folder = repo_copy / _use_shards(repo_copy)
    run_checked("dvc", "repro", cwd=repo_copy)
    trained = load_file(repo_copy / "models/model.safetensors")
    assert all(torch.equal(trained[k], reference[k]) for k in reference)
    lock = yaml.safe_load((repo_copy / "dvc.lock").read_text())
    assert lock["stages"]["prepare"]["outs"][0]["md5"].endswith(".dir")
    outputs = ["models/model.safetensors", "reports/run.json", "reports/train_metrics.json"]
    before = {name: (repo_copy / name).read_bytes() for name in outputs}
    shard = folder / "train-00002-x.npy"
    good = shard.read_bytes()
    blob = bytearray(good)
    blob[-5] ^= 0xFF
    # One altered byte: the shard's sha256 in the folder's own index names it.
    _rewrite(shard, bytes(blob))
    result = run_cli(*stage_argv(repo_copy, "train"), cwd=repo_copy)
    assert result.returncode == 2, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert f"{shard.relative_to(repo_copy)}: sha256 differs" in last and "altered" in last, last
    # The index rewritten to agree: DVC's record of the folder names the shard.
    index = json.loads((folder / "index.json").read_text())
    for entry in index["splits"]["train"]["shards"]:
        if entry["files"]["x"]["name"] == shard.name:
            entry["files"]["x"]["sha256"] = hashlib.sha256(blob).hexdigest()
    _rewrite(folder / "index.json", json.dumps(index).encode())
    result = run_cli(*stage_argv(repo_copy, "train"), cwd=repo_copy)
    assert result.returncode == 2, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert "recorded by DVC" in last and f"{shard.name} (altered)" in last, last
    assert {name: (repo_copy / name).read_bytes() for name in outputs} == before
    # DVC restores the folder, and then nothing is out of date.
    run_checked("dvc", "checkout", "--force", cwd=repo_copy)
    assert shard.read_bytes() == good
    out = run_checked("dvc", "repro", cwd=repo_copy)
    assert "Stage 'train' didn't change, skipping" in out, out
