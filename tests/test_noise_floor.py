"""`reprotrain noise-floor` end to end: same-seed runs in fresh processes, measured per mode.

One cheap run (one epoch, no workers, two runs per mode) in a minimal repository; the
negative control re-measures its kept folders after flipping a weight, with no training.
"""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

import pytest
from safetensors.torch import save_file

from reprotrain.commands.noise_floor import measure_mode
from reprotrain.hashing import load_safetensors
from tests.helpers import ROOT, run_cli, run_in_process


def minimal_repo(dest: Path, prepared: Path) -> Path:
    """dvc.yaml, params.yaml, the locks and the prepared data: what the train stage reads."""
    for name in ("dvc.yaml", "params.yaml", "dvc.lock", "requirements-cpu.lock"):
        shutil.copy2(ROOT / name, dest / name)
    (dest / "data/prepared").mkdir(parents=True)
    shutil.copy2(prepared, dest / "data/prepared/dataset.safetensors")
    return dest


@pytest.fixture(scope="module")
def noise_floor(tmp_path_factory: pytest.TempPathFactory, prepared: Path) -> tuple[dict, Path]:
    repo = minimal_repo(tmp_path_factory.mktemp("noise-repo"), prepared)
    work, out = repo / "runs", repo / "noise.json"
    result = run_cli(
        "noise-floor",
        *("--runs", "2", "--workdir", work, "--out", out),
        *("-S", "train.max_epochs=1", "-S", "data.init_args.num_workers=0"),
        cwd=repo,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "first diverging step" in result.stdout  # the table
    return json.loads(out.read_text()), work


def test_deterministic_mode_is_identical_on_cpu(noise_floor: tuple[dict, Path]) -> None:
    report, _ = noise_floor
    assert report["runs_per_mode"] == 2 and report["device"].startswith("cpu")
    mode = report["modes"]["deterministic"]
    assert mode["deterministic"] == "true" and mode["identical"] is True
    assert mode["final_loss_gap"] == 0.0 and mode["max_abs_weight_diff"] == 0.0
    assert mode["l2_weight_diff"] == 0.0 and mode["first_diverging_step"] is None


def test_figures_are_computed_from_the_runs(noise_floor: tuple[dict, Path]) -> None:
    report, work = noise_floor
    for name, mode in report["modes"].items():
        losses = [
            json.loads((work / run["run"] / "train_metrics.json").read_text())["train_loss"]
            for run in mode["runs"]
        ]
        assert [r["final_train_loss"] for r in mode["runs"]] == losses
        assert mode["final_loss_gap"] == max(losses) - min(losses)
        assert [r["run"] for r in mode["runs"]] == [f"{name}-1", f"{name}-2"]
        # Identical means zero everywhere; a difference must show in some figure.
        figures = (mode["final_loss_gap"], mode["max_abs_weight_diff"], mode["l2_weight_diff"])
        assert mode["identical"] == (not any(figures) and mode["first_diverging_step"] is None)
        assert statistics.fmean(losses) > 0


def test_a_flipped_weight_is_reported_as_a_difference(
    noise_floor: tuple[dict, Path], tmp_path: Path
) -> None:
    _, work = noise_floor
    folders = [
        Path(shutil.copytree(work / f"deterministic-{i}", tmp_path / f"r{i}")) for i in (1, 2)
    ]
    tensors, _ = load_safetensors(folders[1] / "model.safetensors")
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += 0.5
    save_file(tensors, folders[1] / "model.safetensors")
    mode = measure_mode(folders, "true")
    assert mode["identical"] is False
    assert mode["max_abs_weight_diff"] == pytest.approx(0.5, rel=1e-6)
    assert mode["l2_weight_diff"] == pytest.approx(0.5, rel=1e-6)


def test_noise_floor_refuses_one_run_and_a_deterministic_override() -> None:
    one = run_in_process("noise-floor", "--runs", "1")
    assert one.returncode == 2 and "at least 2 runs" in one.stderr
    override = run_in_process("noise-floor", "-S", "deterministic=true")
    assert override.returncode == 2 and "drop that override" in override.stderr


def test_a_workdir_holding_earlier_runs_is_refused_before_any_run(tmp_path: Path) -> None:
    work, missing_yaml = tmp_path / "W", tmp_path / "dvc.yaml"
    (work / "default-1").mkdir(parents=True)
    (work / "default-1" / "notes.txt").write_text("mine\n")
    done = run_in_process("noise-floor", "--workdir", work, "--dvc-yaml", missing_yaml)
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert done.stderr == (
        f"reprotrain: error: --workdir {work}: already holds default-1 from before; "
        "name an empty or new folder (noise-floor never deletes runs)\n"
    )
    assert (work / "default-1" / "notes.txt").read_text() == "mine\n"
    assert sorted(p.name for p in work.iterdir()) == ["default-1"]
    # control: a new workdir passes that check; the next one (no dvc.yaml) speaks, no training
    new = tmp_path / "new"
    done = run_in_process("noise-floor", "--workdir", new, "--dvc-yaml", missing_yaml)
    assert done.returncode == 2 and "--workdir" not in done.stderr, done.stderr
    assert done.stderr.startswith(f"reprotrain: error: {missing_yaml}: not found"), done.stderr
