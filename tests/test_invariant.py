"""World-size invariant training: the same bits on 1, 2 and 4 processes, on Lightning's DDP.

The unit tests check the two pieces the property rests on (the tree and the
sampler). The slow ones train for real: a user's own Lightning script
(tests/scripts/invariant_fit.py) and the pipeline's train stage, at several
world sizes, a 2 nodes x 2 processes launch, and plain DDP as the negative
control; and `dvc exp run` at another world size is a cache hit.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from torch.nn import functional as F

from reprotrain.distributed.microbatches import (
    MicroBatchSampler,
    invariant_layout_problem,
    sample_integers,
)
from reprotrain.distributed.worldsize import tree_sum
from reprotrain.hashing import sha256_file
from reprotrain.pipeline.config import ConfigError
from reprotrain.pipeline.params_file import load_params
from tests.helpers import (
    ROOT,
    cli_env,
    run_checked,
    run_cli,
    run_process,
    train_argv,
)

SCRIPT = ROOT / "tests" / "scripts" / "invariant_fit.py"
#: What a user's launcher sets before Python starts (hash seed, one thread per rank).
SCRIPT_ENV = {"PYTHONPATH": str(ROOT / "src"), "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
MODE = ("-S", "train.world_size_invariant=true", "-S", "train.max_epochs=2")


def _ranks(world: int) -> tuple[str, ...]:
    strategy = "ddp" if world > 1 else "single_device"
    return ("-S", f"train.devices={world}", "-S", f"train.strategy={strategy}")


# -- the pieces ------------------------------------------------------------------------


@pytest.mark.parametrize(("leaves", "world"), [(8, 1), (8, 2), (8, 4), (8, 8), (12, 2), (12, 4)])
def test_adding_each_ranks_subtree_then_the_ranks_is_the_whole_tree(
    leaves: int, world: int
) -> None:
    values = list(torch.randn(leaves, 1000, generator=torch.Generator().manual_seed(leaves)))
    per_rank = leaves // world
    rank_sums = [tree_sum(values[r * per_rank : (r + 1) * per_rank]) for r in range(world)]
    assert torch.equal(tree_sum(rank_sums), tree_sum(values))


def test_the_top_addition_may_write_into_one_of_its_leaves() -> None:
    # The hook adds a rank's micro-batches into DDP's bucket, which holds the last of them.
    for leaves in (2, 3, 5, 8):
        values = list(torch.randn(leaves, 1000, generator=torch.Generator().manual_seed(leaves)))
        bucket = values[-1].clone()
        assert tree_sum([*values[:-1], bucket], out=bucket) is bucket
        assert torch.equal(bucket, tree_sum(values)), leaves


def test_adding_in_another_order_changes_the_bits() -> None:
    # Negative control: what plain DDP does at another world size (another grouping).
    values = list(torch.randn(8, 1000, generator=torch.Generator().manual_seed(8)))
    in_sequence = values[0]
    for v in values[1:]:
        in_sequence = in_sequence + v
    assert not torch.equal(in_sequence, tree_sum(values))


@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_takes_its_slice_of_one_order(world: int) -> None:
    def batches(rank: int, ranks: int) -> list[list]:
        sampler = MicroBatchSampler(100, 16, 4, rank, ranks, torch.Generator().manual_seed(3))
        return list(sampler)

    alone = batches(0, 1)
    assert len(alone) == 100 // 16 * 4  # the last partial batch is dropped
    per_rank = [batches(r, world) for r in range(world)]
    k = 4 // world
    merged = [mb for step in range(6) for r in range(world) for mb in per_rank[r][step * k :][:k]]
    assert merged == alone  # indices and draw keys alike


def test_a_samples_integers_follow_its_key_alone_and_cover_the_range() -> None:
    key = (2**61 + 5, 17)
    assert sample_integers(key, -1, 2, 2) == sample_integers(key, -1, 2, 2)
    draws = [tuple(sample_integers((key[0], i), -1, 2, 2)) for i in range(9000)]
    counts = {pair: draws.count(pair) for pair in set(draws)}
    assert len(counts) == 9 and min(counts.values()) > 800  # about 1000 each
    # Negative control: another epoch key gives other draws.
    assert draws[:50] != [tuple(sample_integers((key[0] + 1, i), -1, 2, 2)) for i in range(50)]


def test_one_process_and_micro_batches_of_the_same_size_differ() -> None:
    # Negative control for the sampler: another micro-batch layout is another order.
    a = list(MicroBatchSampler(100, 16, 4, 0, 1, torch.Generator().manual_seed(3)))
    b = list(MicroBatchSampler(100, 16, 4, 0, 1, torch.Generator().manual_seed(4)))
    assert a != b


def test_undoing_lightnings_loss_division_gives_each_micro_batch_its_own_gradient() -> None:
    x = torch.randn(8, 5, generator=torch.Generator().manual_seed(0))
    y = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])

    def grad(scale: int | None) -> torch.Tensor:
        w = torch.randn(5, 3, generator=torch.Generator().manual_seed(1)).requires_grad_()
        loss = F.cross_entropy(x @ w, y)
        (loss if scale is None else loss / scale * scale).backward()
        return w.grad

    for k in (1, 2, 3, 5, 6, 7):
        assert torch.equal(grad(k), grad(None)), k


@pytest.mark.parametrize(
    ("batch", "micro", "world", "says"),
    [
        (64, 24, 1, "micro_batch_size 24 does not divide batch_size 64"),
        (64, 16, 3, "world size 3 is not a power of two"),
        (64, 16, 8, "world size 8 is not a power of two that divides the 4 micro-batches"),
    ],
)
def test_layouts_that_cannot_be_invariant_are_named(
    batch: int, micro: int, world: int, says: str
) -> None:
    assert says in str(invariant_layout_problem(batch, micro, world))
    assert invariant_layout_problem(64, 16, 4) is None


def test_params_refuse_a_layout_the_mode_cannot_keep(tmp_path: Path) -> None:
    params = ROOT / "params.yaml"
    bad = ["train.world_size_invariant=true", "train.strategy=ddp", "train.devices=8"]
    with pytest.raises(ConfigError, match=r"train.world_size_invariant: world size 8.*set e.g."):
        load_params(params, bad)
    with pytest.raises(ConfigError, match="micro_batch_size 48 does not divide batch_size 64"):
        load_params(params, ["train.world_size_invariant=true", "train.micro_batch_size=48"])
    assert load_params(params, [*bad[:2], "train.devices=4"]).train.world_size_invariant


def test_the_world_size_leaves_the_record_only_in_the_mode() -> None:
    params = ROOT / "params.yaml"
    plain = [load_params(params, [f"train.devices={n}", "train.strategy=ddp"]) for n in (1, 2)]
    assert plain[0].train.process_layout() != plain[1].train.process_layout()
    mode = [load_params(params, ["train.world_size_invariant=true", *p]) for p in (
        ["train.devices=1"], ["train.devices=2", "train.strategy=ddp"],
    )]  # fmt: skip
    assert mode[0].train.process_layout() == mode[1].train.process_layout()


# -- a user's own Lightning script ------------------------------------------------------


def _script(out: Path, *args: str, **variables: str) -> Path:
    env = cli_env(**SCRIPT_ENV, **variables)
    result = run_process([sys.executable, str(SCRIPT), str(out), *args], out.parent, env)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.mark.slow
def test_a_lightning_script_trains_to_the_same_bits_on_1_2_and_4_processes(tmp_path: Path) -> None:
    runs = {n: _script(tmp_path / f"w{n}.safetensors", str(n)) for n in (1, 2, 4)}
    digests = {n: sha256_file(p) for n, p in runs.items()}
    assert len(set(digests.values())) == 1, digests
    losses = {n: json.loads(Path(f"{p}.json").read_text()) for n, p in runs.items()}
    assert losses[1] == losses[2] == losses[4] and losses[1]["steps"] == 2 * (200 // 32)
    # Negative control: plain DDP on the same script differs between 1 and 2 processes.
    plain = [_script(tmp_path / f"plain{n}.safetensors", str(n), "--plain") for n in (1, 2)]
    assert sha256_file(plain[0]) != sha256_file(plain[1])


@pytest.mark.slow
def test_two_nodes_of_two_processes_give_the_bits_of_one_process(tmp_path: Path) -> None:
    alone = _script(tmp_path / "one.safetensors", "1")
    out = tmp_path / "nodes.safetensors"
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29400 + os.getpid() % 500)}
    argv = [sys.executable, str(SCRIPT), str(out), "2", "--num-nodes", "2"]
    node1 = subprocess.Popen(
        argv, cwd=tmp_path, env=cli_env(**SCRIPT_ENV, NODE_RANK="1", **env),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        _script(out, "2", "--num-nodes", "2", NODE_RANK="0", **env)
    finally:
        _, stderr = node1.communicate(timeout=600)
    assert node1.returncode == 0, stderr[-3000:]
    assert sha256_file(out) == sha256_file(alone)


@pytest.mark.slow
def test_batch_norm_with_running_statistics_is_refused(tmp_path: Path) -> None:
    argv = [sys.executable, str(SCRIPT), str(tmp_path / "bn.safetensors"), "1", "--batchnorm"]
    result = run_process(argv, tmp_path, cli_env(**SCRIPT_ENV))
    assert result.returncode != 0
    assert "batch norm with running statistics is not world-size invariant" in result.stderr
    assert not (tmp_path / "bn.safetensors").exists()


# -- the pipeline -----------------------------------------------------------------------


@pytest.mark.slow
def test_the_train_stage_gives_the_same_files_on_1_2_and_4_processes_and_verify_says_so(
    repo_copy: Path, tmp_path: Path
) -> None:
    work = tmp_path / "verify"
    result = run_cli(
        "verify", "--world-sizes", "1", "2", "4", "--workdir", work, *MODE, cwd=repo_copy
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "reprotrain verify: IDENTICAL (3 runs)" in result.stdout
    # every file the train stage wrote, byte for byte: weights, trace, metrics, curves, run.json
    folders = [work / f"world-size-{n}" for n in (1, 2, 4)]
    names = sorted(str(p.relative_to(folders[0])) for p in folders[0].rglob("*") if p.is_file())
    assert {"model.safetensors", "trace.safetensors", "run.json"} <= set(names), names
    for name in names:
        digests = {folder.name: sha256_file(folder / name) for folder in folders}
        assert len(set(digests.values())) == 1, (name, digests)
    # Negative control: plain DDP at world size 2 differs from one process, and verify says so.
    # Without DataLoader workers: a rank forking workers beside gloo's threads once hung in
    # the fork (CI, under load; alone it passed), and workers are not what this checks.
    no_workers = ("-S", "data.init_args.num_workers=0")
    result = run_cli(
        "verify", "--world-sizes", "1", "2", "-S", "train.max_epochs=1", *no_workers,
        cwd=repo_copy,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    assert "NOT REPRODUCIBLE" in result.stdout


@pytest.mark.slow
def test_dvc_at_another_world_size_is_a_cache_hit_only_in_the_mode(repo_copy: Path) -> None:
    run_checked("dvc", "exp", "run", "-S", "train.world_size_invariant=true", cwd=repo_copy)
    model = sha256_file(repo_copy / "models" / "model.safetensors")
    two = ("-S", "train.devices=2", "-S", "train.strategy=ddp")
    out = run_checked("dvc", "exp", "run", *two, cwd=repo_copy)
    assert "Stage 'train' didn't change, skipping" in out, out
    assert sha256_file(repo_copy / "models" / "model.safetensors") == model
    # Negative control: outside the mode the world size is in the cache key.
    out = run_checked(
        "dvc", "exp", "run", "-S", "train.world_size_invariant=false", "-S",
        "train.max_epochs=1", *two, cwd=repo_copy,
    )  # fmt: skip
    assert "Running stage 'train'" in out, out


@pytest.mark.slow
def test_a_checkpoint_from_another_world_size_is_refused_clearly(
    prepared: Path, env_record: Path, tmp_path: Path
) -> None:
    from tests.helpers import kill_after_checkpoint

    argv = train_argv(
        prepared, env_record, tmp_path, *MODE, "-S", "train.max_epochs=3",
        "-S", "train.checkpoint_every_n_epochs=1", *_ranks(2),
    )  # fmt: skip
    kill_after_checkpoint(argv, tmp_path / "ckpt", 0, cwd=tmp_path)
    argv4 = [a.replace("train.devices=2", "train.devices=4") for a in argv]
    result = run_cli(*argv4, cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert "world size" in last and "resume with" in last, last
    shutil.rmtree(tmp_path / "ckpt")


@pytest.mark.gpu
@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL: one per rank)"
)
def test_gpu_one_process_and_two_processes_give_the_same_bits(tmp_path: Path) -> None:
    one = _script(tmp_path / "gpu1.safetensors", "1", "--gpu")
    two = _script(tmp_path / "gpu2.safetensors", "2", "--gpu")
    assert sha256_file(one) == sha256_file(two)


BN_MODEL = """
import torch
from reprotrain.recipes.language_model import TinyGPT


class NormedGPT(TinyGPT):
    def __init__(self, vocab_size: int, block_size: int, track: bool = True) -> None:
        super().__init__(vocab_size, block_size)
        self.norm = torch.nn.BatchNorm1d(64, track_running_stats=track)
"""


def test_the_env_stage_refuses_batch_norm_under_invariance_before_any_output_goes(
    tmp_path: Path,
) -> None:
    """One line at ``env``, which runs before DVC deletes a later stage's outputs; the model
    is built on the meta device with the data module's linked sizes. Control: without
    running statistics the same model passes."""
    (tmp_path / "bnpkg").mkdir()
    (tmp_path / "bnpkg" / "__init__.py").write_text("")
    (tmp_path / "bnpkg" / "model.py").write_text(BN_MODEL)
    lm = yaml.safe_load((ROOT / "pipelines/lm/params.yaml").read_text())
    lm["model"] = {"class_path": "bnpkg.model.NormedGPT", "init_args": {}}
    lm["train"]["world_size_invariant"] = True
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(lm))
    args = ("env", "--lock", ROOT / "requirements-cpu.lock", "--out", tmp_path / "env.json")
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    refused = run_cli(*args, cwd=tmp_path, **env)
    assert refused.returncode == 2, refused.stderr
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in refused.stderr, refused.stderr
    assert "world_size_invariant: true" in lines[0] and "norm: batch norm with running" in lines[0]
    assert "track_running_stats=False" in lines[0] and not (tmp_path / "env.json").exists()
    lm["model"]["init_args"] = {"track": False}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(lm))
    passed = run_cli(*args, cwd=tmp_path, **env)
    assert passed.returncode == 0, passed.stderr
