"""DDP on Lightning's engine: 2 CPU processes (gloo) rerun to the same bits, rank by rank."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from reprotrain.determinism import DeterminismError
from reprotrain.distributed.ddp import RankAgreement, distributed_layout, worker_start
from reprotrain.hashing import sha256_file
from reprotrain.pipeline.config import ConfigError
from reprotrain.pipeline.data import PipelineLoaders, ShardSampler
from reprotrain.pipeline.params_file import load_params
from reprotrain.provenance.environment import capture_environment, collective_variables
from reprotrain.recipes.digits import DigitsData
from reprotrain.trace.tracefile import load_trace
from tests.helpers import (
    ROOT,
    cli_env,
    kill_after_checkpoint,
    run_cli,
    signal_after_checkpoint,
    train_argv,
    verify_training,
)

DDP2 = ("-S", "train.strategy=ddp", "-S", "train.devices=2")
DDP1 = ("-S", "train.strategy=ddp", "-S", "train.devices=1")
#: Forward noise on rank 1 only, from its 4th step on (step 3): see tests/inject.
NOISE_ON_RANK_1 = {
    "PYTHONPATH": str(ROOT / "tests" / "inject"),
    "REPROTRAIN_TEST_NOISE_FROM_STEP": "3",
    "REPROTRAIN_TEST_NOISE_RANK": "1",
    "REPROTRAIN_TEST_NOISE_IN": "forward",
}
OUTPUTS = ("model.safetensors", "trace.safetensors", "run.json", "metrics.json")


def _argv(prepared: Path, env: Path, out: Path, *overrides: str) -> list[str]:
    epochs = ("-S", "train.max_epochs=3", "-S", "train.checkpoint_every_n_epochs=1")
    return train_argv(prepared, env, out, *epochs, *overrides)


def _train(prepared: Path, env: Path, out: Path, *overrides: str, **variables: str) -> Path:
    """One training in a fresh `reprotrain` process (which starts the other ranks)."""
    out.mkdir()
    result = run_cli(*_argv(prepared, env, out, *overrides), cwd=out, **variables)
    assert result.returncode == 0, result.stderr
    shutil.copy(env, out / "environment.json")  # a flat run folder, as compare reads it
    (out / "stdout.txt").write_text(result.stdout)
    return out


@pytest.fixture(scope="module")
def runs(
    prepared: Path, env_record: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("ddp")
    train = lambda name, *o, **v: _train(prepared, env_record, base / name, *o, **v)  # noqa: E731
    return {
        "a": train("a", *DDP2),
        "b": train("b", *DDP2),
        "one": train("one", *DDP1),
        "noisy_a": train("noisy_a", *DDP2, **NOISE_ON_RANK_1),
        "noisy_b": train("noisy_b", *DDP2, **NOISE_ON_RANK_1),
    }


def _compare(a: Path, b: Path, *extra: str) -> str:
    result = run_cli("compare", a, b, *extra, cwd=a)
    return result.stdout + result.stderr


@pytest.mark.slow
def test_two_process_ddp_reruns_give_identical_weights_and_traces(runs: dict[str, Path]) -> None:
    for name in OUTPUTS:
        assert sha256_file(runs["a"] / name) == sha256_file(runs["b"] / name), name
    assert "IDENTICAL: the same bits" in _compare(runs["a"], runs["b"])


@pytest.mark.slow
def test_trace_holds_every_rank_and_the_ranks_saw_different_data(runs: dict[str, Path]) -> None:
    trace = load_trace(runs["a"] / "trace.safetensors")
    assert trace.world_size == 2
    rank0, rank1 = trace.of_rank(0), trace.of_rank(1)
    assert rank0.num_steps == rank1.num_steps > 0
    assert list(rank0.step) == list(rank1.step)
    assert trace.num_steps == 2 * rank0.num_steps
    # Disjoint shares of the data: no step trains both ranks on the same batch.
    assert not (rank0.records["batch"] == rank1.records["batch"]).any()
    assert rank0.initial_params == rank1.initial_params  # DDP starts every rank alike


@pytest.mark.slow
def test_only_rank_zero_writes_the_outputs(runs: dict[str, Path]) -> None:
    printed = (runs["a"] / "stdout.txt").read_text().splitlines()
    assert sum("trained -> " in line for line in printed) == 1
    assert sum("rank 1 trained run" in line for line in printed) == 1
    assert not list((runs["a"] / "ckpt").rglob("*.ckpt")), "checkpoints are dropped after success"


@pytest.mark.slow
def test_world_size_is_in_the_run_id_and_compare_says_why(runs: dict[str, Path]) -> None:
    one, two = (json.loads((runs[n] / "run.json").read_text()) for n in ("one", "a"))
    assert one["run_id"] != two["run_id"]
    assert one["inputs"]["distributed"]["world_size"] == 1
    assert two["inputs"]["distributed"]["world_size"] == 2
    assert two["inputs"]["distributed"]["backend"] == "gloo"
    text = _compare(runs["one"], runs["a"])
    assert "different run IDs" in text
    assert "distributed.world_size: 1 -> 2" in text
    assert "traces of world size 1 vs 2" in text


@pytest.mark.slow
def test_compare_names_the_first_diverging_rank_and_step(runs: dict[str, Path]) -> None:
    assert sha256_file(runs["noisy_a"] / "model.safetensors") != sha256_file(
        runs["noisy_b"] / "model.safetensors"
    )
    text = _compare(runs["noisy_a"], runs["noisy_b"])
    assert "traces diverge at step 3 on rank 1 of 2" in text
    assert "loss differs first" in text
    report = json.loads(_compare(runs["noisy_a"], runs["noisy_b"], "--json"))
    assert (report["trace"]["rank"], report["trace"]["first_step"]) == (1, 3)


@pytest.mark.slow
def test_killed_ddp_run_resumes_to_the_same_bits(
    runs: dict[str, Path], prepared: Path, env_record: Path, tmp_path: Path
) -> None:
    argv = _argv(prepared, env_record, tmp_path, *DDP2)
    kill_after_checkpoint(argv, tmp_path / "ckpt", 0, tmp_path)
    result = run_cli(*argv, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "resumed from epoch=" in result.stdout
    for name in OUTPUTS:
        assert sha256_file(tmp_path / name) == sha256_file(runs["a"] / name), name


@pytest.mark.slow
def test_a_rank_with_another_run_id_stops_every_rank_before_training(
    prepared: Path, env_record: Path, tmp_path: Path
) -> None:
    skew = {"PYTHONPATH": str(ROOT / "tests" / "inject"), "REPROTRAIN_TEST_SKEW_RANK": "1"}
    result = run_cli(*_argv(prepared, env_record, tmp_path, *DDP2), cwd=tmp_path, **skew)
    assert result.returncode == 3, result.stderr
    assert "ranks disagree on what they run: rank 1 has run_id=" in result.stderr
    assert not any(tmp_path.glob("*.safetensors")) and not (tmp_path / "run.json").exists()


# -- the parts, without processes ---------------------------------------------------------


def test_rank_shares_are_disjoint_seeded_and_follow_the_generator() -> None:
    def shares(seed: int, size: int = 10, epochs: int = 2) -> list[list[list[int]]]:
        """Per epoch, each rank's share; each rank has its own generator, seeded alike."""
        samplers = [ShardSampler(size, r, 2, torch.Generator().manual_seed(seed)) for r in (0, 1)]
        return [[list(s) for s in samplers] for _ in range(epochs)]

    first, second = shares(1)
    assert sorted(first[0] + first[1]) == list(range(10))
    assert first != second  # reshuffled each epoch
    assert shares(1) == [first, second]
    assert shares(2)[0] != first
    odd = shares(1, size=7)[0]
    assert len(odd[0]) == len(odd[1]) == 4 and set(odd[0] + odd[1]) == set(range(7))


@pytest.fixture
def process_group() -> Iterator[None]:
    """A one-rank gloo process group in this process, as a DDP rank has (its threads too)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _val_loader(prepared: Path) -> DataLoader:
    source = DigitsData(path=str(prepared), batch_size=64, num_workers=2)
    source.setup("fit")
    return PipelineLoaders(source, seed=0).val_dataloader()


def test_workers_start_from_a_fork_server_only_under_a_process_group(
    prepared: Path, process_group: None
) -> None:
    loader = _val_loader(prepared)
    assert loader.multiprocessing_context.get_start_method() == "forkserver"
    # Negative control: data a fork server cannot receive forks as before, and says why.
    with pytest.warns(UserWarning, match="cannot be pickled for a fork server"):
        assert worker_start(lambda: None) is None


#: A job that starts one process from a fork server preloading argv's modules, prints its
#: pid and waits: what a rank does with its DataLoader workers.
FORK_SERVER_JOB = """
import multiprocessing, sys, time
context = multiprocessing.get_context("forkserver")
context.set_forkserver_preload(sys.argv[1:])
child = context.Process(target=time.sleep, args=(600,))
child.start()
print(child.pid, flush=True)
time.sleep(600)
"""


def _outlives_its_killed_job(*preload: str, wait_s: float) -> bool:
    """Whether the fork server's child still runs ``wait_s`` after its job's kill -9."""
    with subprocess.Popen(
        [sys.executable, "-c", FORK_SERVER_JOB, *preload],
        stdout=subprocess.PIPE, text=True, env=cli_env(), start_new_session=True,
    ) as job:  # fmt: skip
        child = int(job.stdout.readline())
        job.kill()
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(child).status() == psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            return False
        time.sleep(0.1)
    os.kill(child, signal.SIGKILL)
    return True


def test_a_fork_servers_workers_end_when_their_job_is_killed() -> None:
    assert not _outlives_its_killed_job("reprotrain.distributed._fork_server", wait_s=30)


def test_a_plain_fork_servers_child_outlives_its_killed_job() -> None:
    """Negative control: without the module, server and child wait on each other for good."""
    assert _outlives_its_killed_job(wait_s=3)


def test_without_a_process_group_workers_fork(prepared: Path) -> None:
    assert _val_loader(prepared).multiprocessing_context is None


def test_more_than_one_device_needs_the_ddp_strategy() -> None:
    with pytest.raises(ConfigError, match=r"train\.strategy: got 'single_device'.*ddp"):
        load_params(ROOT / "params.yaml", ["train.devices=2"])
    with pytest.raises(ConfigError, match=r"train\.strategy"):
        load_params(ROOT / "params.yaml", ["train.num_nodes=2"])
    assert load_params(ROOT / "params.yaml", ["train.devices=2", "train.strategy=ddp"])


def test_nccl_settings_are_in_the_environment_record_and_the_layout(monkeypatch) -> None:
    monkeypatch.setenv("NCCL_ALGO", "Ring")
    monkeypatch.setenv("NCCL_NTHREADS", "256")
    monkeypatch.setenv("NCCL_DEBUG", "INFO")  # logging only: left out
    assert collective_variables() == {"NCCL_ALGO": "Ring", "NCCL_NTHREADS": "256"}
    assert capture_environment(None)["variables"]["NCCL_NTHREADS"] == "256"
    pinned = distributed_layout("ddp", "gpu", 8, 2)
    assert pinned["collective_variables"]["NCCL_ALGO"] == "Ring"
    assert (pinned["world_size"], pinned["backend"]) == (16, "nccl")
    monkeypatch.delenv("NCCL_ALGO")
    assert distributed_layout("ddp", "gpu", 8, 2) != pinned


def test_ranks_that_disagree_all_stop_with_one_message(monkeypatch) -> None:
    facts = [{"run_id": "aaa", "resume_from": None}, {"run_id": "bbb", "resume_from": None}]
    monkeypatch.setattr("reprotrain.distributed.ddp.gather_from_ranks", lambda _: facts)
    with pytest.raises(DeterminismError, match=r"rank 1 has run_id='bbb' \(rank 0: 'aaa'\)"):
        RankAgreement(facts[0]).setup(None, None, "fit")  # type: ignore[arg-type]
    with pytest.warns(UserWarning, match="ranks disagree"):
        RankAgreement(facts[0], mode="warn").setup(None, None, "fit")  # type: ignore[arg-type]
    agreeing = [facts[0], dict(facts[0])]
    monkeypatch.setattr("reprotrain.distributed.ddp.gather_from_ranks", lambda _: agreeing)
    RankAgreement(facts[0]).setup(None, None, "fit")  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_one_gpu_ddp_twice_gives_identical_bits(
    prepared: Path, env_record: Path, tmp_path: Path
) -> None:
    report = verify_training(
        prepared, env_record, tmp_path / "w", "-S", "train.accelerator=gpu", *DDP1,
        "-S", "train.max_epochs=1",
    )  # fmt: skip
    assert report["identical"], report
    assert "model.safetensors" in report["outputs"], report


@pytest.mark.slow
def test_sigterm_to_a_ddp_job_checkpoints_mid_epoch_and_resumes_to_the_same_bits(
    runs: dict[str, Path], prepared: Path, env_record: Path, tmp_path: Path
) -> None:
    # As a cluster preempts a job: SIGTERM to every process of it (ranks and workers).
    # Lightning's own DDP handler hung here; every rank must stop at one batch end.
    argv = _argv(prepared, env_record, tmp_path, *DDP2)
    code, stderr = signal_after_checkpoint(argv, tmp_path, signal.SIGTERM, to_group=True)
    assert code == 130, stderr
    errors = [line for line in stderr.splitlines() if "reprotrain: error:" in line]
    assert len(errors) == 1 and errors[0].startswith("reprotrain: error: training interrupted")
    written = re.search(r"(epoch=1-step=\d+\.ckpt)", errors[0])
    assert written, errors[0]
    result = run_cli(*argv, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"resumed from {written.group(1)}" in result.stdout, result.stdout
    for name in ("model.safetensors", "trace.safetensors", "metrics.json", "plots/train_loss.csv"):
        assert sha256_file(tmp_path / name) == sha256_file(runs["a"] / name), name
