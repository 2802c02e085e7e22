"""Stage evaluate: identical weights give identical metric bytes; bad model files are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reprotrain.provenance.dvcchecksum import md5_file
from tests.helpers import ROOT, run_cli, stage_argv


def _run(stage: str, work: Path, prepared: Path, model: Path, *extra: str):
    plots = ("--plots", work / f"{stage}-plots") if stage == "train" else ()
    return run_cli(
        stage,
        *extra,
        *("--data", prepared, "--model", model, "--metrics", work / f"{stage}.json"),
        *plots,
        cwd=work,
    )


@pytest.fixture(scope="module")
def model(prepared: Path, env_record: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("model")
    out = work / "model.safetensors"
    extra = (
        *("--params", str(ROOT / "params.yaml"), "-S", "train.max_epochs=1"),
        *("-S", f"data.init_args.path={prepared}"),
        *("--env", str(env_record), "--run-record", str(work / "run.json")),
        *("--checkpoints", str(work / "ckpt")),
    )
    assert _run("train", work, prepared, out, *extra).returncode == 0
    return out


def test_evaluate_twice_gives_identical_bytes(tmp_path: Path, prepared: Path, model: Path) -> None:
    first, second = tmp_path / "1", tmp_path / "2"
    for work in (first, second):
        work.mkdir()
        result = _run("evaluate", work, prepared, model)
        assert result.returncode == 0, result.stderr
    assert (first / "evaluate.json").read_bytes() == (second / "evaluate.json").read_bytes()
    metrics = json.loads((first / "evaluate.json").read_text())
    # Exactly what the module's test_step logs, and the sample count.
    assert set(metrics) == {"test_samples", "test_loss", "test_acc"}
    assert metrics["test_samples"] == 270 and 0 <= metrics["test_acc"] <= 1


def test_corrupt_model_file_is_refused(tmp_path: Path, prepared: Path, model: Path) -> None:
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(model.read_bytes()[:100])
    result = _run("evaluate", tmp_path, prepared, bad)
    assert result.returncode == 2
    assert "not a reprotrain model file" in result.stderr
    assert not (tmp_path / "evaluate.json").exists()


def test_tampered_weights_are_refused_by_hash_before_loading(repo_copy: Path) -> None:
    model = repo_copy / "models/model.safetensors"
    recorded = md5_file(model)
    blob = bytearray(model.read_bytes())
    blob[-1] ^= 1  # a weight bit: the file still parses, only the hash can tell
    model.write_bytes(bytes(blob))
    before = (repo_copy / "reports/metrics.json").read_bytes()
    result = run_cli(*stage_argv(repo_copy, "evaluate"), cwd=repo_copy)
    assert result.returncode == 2
    assert "models/model.safetensors: md5" in result.stderr and recorded in result.stderr
    assert (repo_copy / "reports/metrics.json").read_bytes() == before
