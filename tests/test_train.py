"""Two same-seed fits in fresh processes give the same bits; another seed does not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from reprotrain.hashing import load_safetensors, sha256_file, sha256_state_dict
from tests.helpers import RUN_OUTPUTS, run_cli, train_argv

EPOCHS = "3"


def _train(prepared: Path, env: Path, out: Path, *overrides: str) -> Path:
    """Train in a fresh `reprotrain` process (default num_workers=2); return its folder."""
    out.mkdir()
    epochs = ("-S", f"train.max_epochs={EPOCHS}")
    result = run_cli(*train_argv(prepared, env, out, *epochs, *overrides), cwd=out)
    assert result.returncode == 0, result.stderr
    return out


@pytest.fixture(scope="module")
def runs(
    prepared: Path, env_record: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("runs")
    return {
        "a": _train(prepared, env_record, base / "a"),
        "b": _train(prepared, env_record, base / "b"),
        "other_seed": _train(prepared, env_record, base / "c", "--seed", "43"),
        "every_epoch": _train(
            prepared,
            env_record,
            base / "d",
            *("-S", "train.checkpoint_every_n_epochs=1", "-S", "train.trace=full"),
        ),
    }


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return load_safetensors(run / "model.safetensors")[0]


def test_same_seed_gives_identical_weights(runs: dict[str, Path]) -> None:
    a, b = _weights(runs["a"]), _weights(runs["b"])
    assert a.keys() == b.keys()
    assert all(torch.equal(a[name], b[name]) for name in a)
    assert sha256_state_dict(a) == sha256_state_dict(b)


def test_same_seed_gives_identical_output_files(runs: dict[str, Path]) -> None:
    for name in RUN_OUTPUTS:
        assert sha256_file(runs["a"] / name) == sha256_file(runs["b"] / name), name


def test_different_seed_gives_different_weights(runs: dict[str, Path]) -> None:
    a, c = _weights(runs["a"]), _weights(runs["other_seed"])
    assert not all(torch.equal(a[name], c[name]) for name in a)
    assert sha256_file(runs["a"] / "model.safetensors") != sha256_file(
        runs["other_seed"] / "model.safetensors"
    )


def test_model_records_params_and_determinism_in_force(runs: dict[str, Path]) -> None:
    _, meta = load_safetensors(runs["a"] / "model.safetensors")
    assert meta["params"]["train"]["max_epochs"] == int(EPOCHS)
    assert meta["params"]["data"]["init_args"]["num_workers"] == 2
    # The model as built: every argument, those linked from the data included.
    assert meta["params"]["model"]["init_args"]["num_classes"] == 10
    assert meta["params"]["model"]["init_args"]["input_shape"] == [1, 8, 8]
    # The CLI was started without PYTHONHASHSEED: it must have restarted itself with it.
    assert meta["determinism"]["python_hash_seed"] == "0"
    assert meta["determinism"]["hash_seed_fixed_at_start"] is True
    assert meta["determinism"]["seed_workers"] is True
    assert meta["determinism"]["deterministic_algorithms"] is True


def test_metrics_and_curves_cover_every_epoch_and_step(runs: dict[str, Path]) -> None:

    metrics = json.loads((runs["a"] / "metrics.json").read_text())
    steps = (runs["a"] / "plots/train_loss.csv").read_text().splitlines()
    epochs = (runs["a"] / "plots/val.csv").read_text().splitlines()
    assert metrics["epochs"] == int(EPOCHS) and len(epochs) == int(EPOCHS) + 1
    assert metrics["steps"] == len(steps) - 1 > 0
    assert 0 <= metrics["val_acc"] <= 1


def test_checkpoint_frequency_and_trace_detail_do_not_change_the_bits(
    runs: dict[str, Path],
) -> None:
    # Saving a checkpoint or tracing reads the random state but must never consume it. (The
    # files differ: the weights file's metadata records the params, these included.)
    a, every = _weights(runs["a"]), _weights(runs["every_epoch"])
    assert sha256_state_dict(every) == sha256_state_dict(a)


def test_compare_says_identical_for_the_same_seed(runs: dict[str, Path]) -> None:
    result = run_cli("compare", runs["a"], runs["b"], cwd=runs["a"])
    assert result.returncode == 0, result.stderr
    assert "IDENTICAL: the same bits" in result.stdout and "same run ID" in result.stdout
    here = run_cli("compare", ".", runs["b"], cwd=runs["a"])  # a run named by "."
    assert here.returncode == 0 and "IDENTICAL: the same bits" in here.stdout, here.stderr


def test_compare_blames_the_seed_from_step_zero(runs: dict[str, Path], tmp_path: Path) -> None:
    plot = tmp_path / "loss.png"
    text = run_cli("compare", runs["a"], runs["other_seed"], "--plot", plot, cwd=tmp_path)
    assert text.returncode == 1, text.stderr
    assert "traces diverge at step 0 (row 0): batch differs first" in text.stdout
    assert "params.seed: 42 -> 43" in text.stdout
    assert plot.read_bytes().startswith(b"\x89PNG")
    report = json.loads(
        run_cli("compare", runs["a"], runs["other_seed"], "--json", cwd=tmp_path).stdout
    )
    assert report["trace"]["first_step"] == 0
    assert {d["key"] for d in report["inputs"]} == {"params.seed", "determinism.seed"}
    rows = {row["name"]: row for row in report["weights"]}
    assert not rows["net.0.weight"]["equal"] and rows["net.0.weight"]["max_abs_diff"] > 0


def test_gpu_accelerator_without_cuda_is_one_line_naming_the_key(
    prepared: Path, env_record: Path, tmp_path: Path
) -> None:
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA: the refusal is for hosts without it")
    (tmp_path / "model.safetensors").write_bytes(b"earlier model")
    gpu = run_cli(
        *train_argv(prepared, env_record, tmp_path, "-S", "train.accelerator=gpu"), cwd=tmp_path
    )
    assert gpu.returncode == 2, gpu.stderr
    lines = gpu.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in gpu.stderr, gpu.stderr
    assert "train.accelerator: gpu" in lines[0] and "train.accelerator=cpu" in lines[0]
    assert (tmp_path / "model.safetensors").read_bytes() == b"earlier model"
    # Negative control: the check is the accelerator's, not any train command's.
    cpu = run_cli(
        *train_argv(prepared, env_record, tmp_path, "-S", "train.max_epochs=1"), cwd=tmp_path
    )
    assert cpu.returncode == 0, cpu.stderr
    assert (tmp_path / "model.safetensors").read_bytes() != b"earlier model"
