"""The GPU evidence script, dry-run on the CPU, and the docs' GPU rows generated from it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import save_file

from benchmarks.gpu import gpu_evidence, gpu_rows
from reprotrain.hashing import load_safetensors
from tests.helpers import ROOT, cli_env, run_cli, train_argv

#: The tests that read ``evidence``, a CPU dry run of every step (about 200 s on 2 cores):
#: in ``make test-slow``, which CI runs too.
needs_dry_run = pytest.mark.slow


@pytest.fixture(scope="module")
def evidence(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One dry run on the CPU, checked against the CUDA lock: so it drifts, in evidence mode."""
    out = tmp_path_factory.mktemp("gpu-evidence")
    result = _dry_run(out, "--work", str(out / "work"))
    assert result.returncode == 0, result.stdout + result.stderr
    return out


def _dry_run(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu" / "gpu_evidence.py"), "--device", "cpu"]
    cmd += ["--quick", "--out", str(out), "--lock", str(ROOT / "requirements.lock"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=cli_env(), check=False)


def _load(folder: Path, name: str) -> dict:
    return json.loads((folder / f"{name}.json").read_text())


@needs_dry_run
@pytest.mark.parametrize("step", gpu_evidence.STEPS)
def test_every_step_writes_its_output_naming_device_and_drift(evidence: Path, step: str) -> None:
    entry = _load(evidence, step)
    assert entry["schema"] == gpu_evidence.SCHEMA and entry["step"] == step
    assert entry["device"] == "cpu" and entry["device_name"]
    assert entry["evidence_mode"] is True and entry["lock"].endswith("requirements.lock")
    assert any(d["package"] == "torch" for d in entry["lock_drift"]), entry["lock_drift"]
    assert entry["status"] == "ok", entry.get("error")
    assert isinstance(entry["result"], dict) and entry["seconds"] >= 0


@needs_dry_run
def test_twin_runs_are_identical_and_the_figures_are_read_from_the_runs(evidence: Path) -> None:
    twin = _load(evidence, "twin_deterministic")["result"]
    assert twin["identical"] is True and twin["max_abs_weight_diff"] == 0.0
    assert twin["first_diverging_step"] is None
    first, second = twin["runs"]  # what compares two GPU models' evidence
    assert first == second and first["run_id"] and len(first["model_sha256"]) == 64
    settings = _load(evidence, "settings")["result"]["workloads"]["conv"]
    assert settings["cells"]["library"]["same_bits_every_run"] is True
    assert len(settings["effects"]["all four, as deterministic: true sets them"]["ci95"]) == 2
    assert _load(evidence, "ddp_twin")["result"]["identical"] is True
    compiled = _load(evidence, "twin_compiled")["result"]  # pipelines/lm-compiled, compiled
    assert compiled["identical"] is True and compiled["runs"][0]["run_id"] != first["run_id"]
    ways = _load(evidence, "compile")["result"]["ways"]
    assert ways["lightning compiled"]["ratio"] == 1.0 and ways["reprotrain portable"]["ratio"] > 0
    bench = _load(evidence, "bench")["result"]["workloads"]["conv"]["determinism_cost"]
    assert len(bench["ci95"]) == 2
    ops = _load(evidence, "ops")["result"]
    assert [op["name"] for op in ops["ops"]] == ["Tensor.index_add_"]
    assert _load(evidence, "docker")["result"] == {
        "ran": False,
        "reason": "--device cpu: the GPU container check needs a GPU",
    }


@needs_dry_run
def test_summary_names_device_builds_and_every_difference_from_the_lock(evidence: Path) -> None:
    summary = _load(evidence, "summary")
    assert set(summary["steps"]) == set(gpu_evidence.STEPS)
    assert summary["facts"]["torch"] and "cudnn" in summary["facts"]
    drift = summary["facts"]["lock"]["drift"]
    markdown = (evidence / "summary.md").read_text()
    assert summary["device_name"] in markdown
    for d in drift:
        assert f"- {d['package']}: installed {d['installed']}, lock {d['locked']}" in markdown


@needs_dry_run
def test_a_twin_that_differs_is_reported_with_how_much_and_where(
    evidence: Path, tmp_path: Path
) -> None:
    same = evidence / "work" / "det-1"
    other = Path(shutil.copytree(same, tmp_path / "other"))
    tensors, _ = load_safetensors(other / "model.safetensors")
    name = sorted(tensors)[0]
    tensors[name].view(-1)[0] += 0.5
    save_file(tensors, other / "model.safetensors")
    result = gpu_evidence.compare_runs(same, other)
    assert result["identical"] is False and result["files_equal"]["model.safetensors"] is False
    assert result["tensors_different"] == 1
    assert result["max_abs_weight_diff"] == pytest.approx(0.5, abs=1e-6)
    assert gpu_evidence.compare_runs(same, evidence / "work" / "det-2")["identical"] is True


@needs_dry_run
def test_rerun_runs_the_named_step_and_keeps_the_others(evidence: Path, tmp_path: Path) -> None:
    out = Path(shutil.copytree(evidence, tmp_path / "gpu", ignore=shutil.ignore_patterns("work")))
    before = {step: (out / f"{step}.json").read_bytes() for step in gpu_evidence.STEPS}
    result = _dry_run(out, "--rerun", "docker")
    assert result.returncode == 0, result.stdout + result.stderr
    for step in gpu_evidence.STEPS:
        assert ((out / f"{step}.json").read_bytes() == before[step]) == (step != "docker"), step
    summary = _load(out, "summary")
    assert "--rerun docker" in _load(out, "docker")["command"]
    assert summary["steps"]["bench"]["command"] == _load(evidence, "bench")["command"]
    assert "| bench | ok, kept |" in (out / "summary.md").read_text()
    # Nothing earlier to keep: refused before any step runs.
    refused = _dry_run(tmp_path / "empty", "--rerun", "docker")
    assert refused.returncode != 0 and not (tmp_path / "empty" / "docker.json").exists()
    assert "holds no earlier output of twin_deterministic" in refused.stderr


def test_without_evidence_mode_the_train_stage_refuses_the_drift(
    prepared: Path, tmp_path: Path
) -> None:
    env = tmp_path / "env.json"
    record = run_cli("env", "--lock", ROOT / "requirements.lock", "--out", env, cwd=ROOT)
    assert record.returncode == 0, record.stderr
    refused = run_cli(*train_argv(prepared, env, tmp_path), cwd=tmp_path)
    assert refused.returncode == 3
    assert "installed packages differ from" in refused.stderr
    assert not (tmp_path / "model.safetensors").exists()


@needs_dry_run
def test_cpu_dry_run_outputs_never_fill_the_gpu_rows(evidence: Path) -> None:
    assert gpu_rows.load_evidence(evidence) is None
    assert "not yet measured" in gpu_rows.render("tradeoff", None)


@needs_dry_run
def test_gpu_outputs_fill_the_rows(evidence: Path, tmp_path: Path) -> None:
    fake = Path(shutil.copytree(evidence, tmp_path / "gpu"))
    summary = _load(fake, "summary") | {"device": "cuda", "device_name": "Test GPU"}
    (fake / "summary.json").write_text(json.dumps(summary))
    loaded = gpu_rows.load_evidence(fake)
    rows = gpu_rows.render("tradeoff", loaded)
    assert "yes, 2 of 2" in rows and "Test GPU" in rows and "determinism" in rows and "%" in rows
    # The dry run's settings step trains the conv only: the transformer's row stays owed.
    assert rows.count("not yet measured") == 1
    assert "of 1:" in gpu_rows.render("lab", loaded)
    assert "yes, 2 of 2" in gpu_rows.render("ddp", loaded)


def test_the_docs_gpu_rows_match_docs_gpu() -> None:
    assert gpu_rows.main(["--check"]) == 0


def test_a_stale_gpu_row_is_caught() -> None:
    text = "before\n<!-- gpu-rows:ddp -->\nold row\n<!-- /gpu-rows:ddp -->\nafter\n"
    new = gpu_rows.update(text, "ddp", None)
    assert new != text and "not yet measured" in new and new.endswith("after\n")
    with pytest.raises(ValueError, match="gpu-rows:lab"):
        gpu_rows.update(text, "lab", None)


def test_every_committed_gpu_folder_feeds_the_rows_and_the_models_table() -> None:
    folders = {p.parent.name for p in (ROOT / "docs" / "gpu").glob("*/twin_deterministic.json")}
    assert folders == set(gpu_rows.FOLDERS + gpu_rows.SHARED)
    assert all((ROOT / "docs" / "gpu" / f / "summary.json").is_file() for f in gpu_rows.FOLDERS)
    table = gpu_rows.render_models()
    assert table.count("| yes, 2 of 2 |") == len(folders)
    assert "not yet measured" in table.splitlines()[-1]  # digests from one model only


def test_two_models_with_other_weights_are_said_to_differ(tmp_path: Path, monkeypatch) -> None:
    for name, digest in (("a100", "1" * 64), ("h100", "2" * 64)):
        (tmp_path / name).mkdir()
        run = {"run_id": "r" * 64, "model_sha256": digest}
        entry = {"device_name": name, "lock_drift": [], "result": {"identical": True,
                 "runs": [run, run]}}  # fmt: skip
        (tmp_path / name / "twin_deterministic.json").write_text(json.dumps(entry))
    monkeypatch.setattr(gpu_rows, "GPU_DOCS", tmp_path)
    assert "trained different bits: a100, h100" in gpu_rows.render_models(("a100", "h100"))
