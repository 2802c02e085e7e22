"""`verify --reference`: one verdict, from what a rerun in a clone changed against git.

The quick tests commit this checkout's real reference files (dvc.yaml, dvc.lock,
reports/) into a small repository, change them as a rerun elsewhere would, and
classify the change; the slow one runs `make check-reference`'s command end to end.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml

from reprotrain.commands._exit_codes import EXIT_RECORD_DIFFERS
from reprotrain.commands._git import changed_paths
from reprotrain.commands._reference import classify_changes
from tests.helpers import ROOT, commit_all, run_checked, run_cli

REFERENCE_FILES = (
    "dvc.yaml",
    "dvc.lock",
    "params.yaml",
    "reports/environment.json",
    "reports/run.json",
    "reports/metrics.json",
    "reports/train_metrics.json",
    # the second pipeline, in a subfolder (its stages' wdir is the root)
    "pipelines/lm/dvc.yaml",
    "pipelines/lm/dvc.lock",
    "pipelines/lm/reports/environment.json",
    "pipelines/lm/reports/run.json",
)


@pytest.fixture
def reference(tmp_path: Path) -> Path:
    repo = tmp_path / "ref"
    for name in REFERENCE_FILES:
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, repo / name)
    run_checked("git", "init", "-q", cwd=repo)
    commit_all(repo, "reference")
    return repo


def _rewrite_record(repo: Path, field: tuple[str, str], value: str, pipeline: str = "") -> None:
    """As a rerun on another host would: one environment field, and what follows from it,
    in the pipeline whose folder is ``pipeline`` ("" the root's)."""
    folder = repo / pipeline
    env_file = folder / "reports" / "environment.json"
    record = json.loads(env_file.read_text())
    record[field[0]][field[1]] = value
    env_file.write_text(json.dumps(record, sort_keys=True))
    run = json.loads((folder / "reports" / "run.json").read_text())
    run["inputs"]["environment_sha256"] = "0" * 64
    run["run_id"] = "1" * 64
    (folder / "reports" / "run.json").write_text(json.dumps(run, sort_keys=True))
    lock = yaml.safe_load((folder / "dvc.lock").read_text())
    records = [
        f"{pipeline}/reports/{name}".lstrip("/") for name in ("environment.json", "run.json")
    ]
    for stage in lock["stages"].values():
        for dep in stage.get("deps", []):
            if dep["path"] == records[0]:
                dep["md5"] = "2" * 32
        for out in stage.get("outs", []):
            if out["path"] == records[1]:
                out["md5"] = "3" * 32
    (folder / "dvc.lock").write_text(yaml.safe_dump(lock, sort_keys=False))


def _change_model_md5(repo: Path, pipeline: str = "") -> None:
    lock_file = repo / pipeline / "dvc.lock"
    lock = yaml.safe_load(lock_file.read_text())
    for out in lock["stages"]["train"]["outs"]:
        if out["path"].endswith("models/model.safetensors"):
            out["md5"] = "4" * 32
    lock_file.write_text(yaml.safe_dump(lock, sort_keys=False))


def test_an_unchanged_clone_is_reproduced(reference: Path) -> None:
    changes = classify_changes(reference, "HEAD", changed_paths(reference))
    assert changes.outputs_identical and changes.record_identical


def test_a_record_only_change_names_its_fields_and_keeps_outputs_identical(
    reference: Path,
) -> None:
    _rewrite_record(reference, ("os", "system"), "Plan9")
    changes = classify_changes(reference, "HEAD", changed_paths(reference))
    assert changes.outputs_identical, changes.outputs
    assert [d.key for d in changes.environment] == ["os.system"]
    assert [d.key for d in changes.inputs] == ["environment_sha256"]
    assert set(changes.record_files) == {
        "dvc.lock",
        "reports/environment.json",
        "reports/run.json",
    }
    assert any("os.system: 'Linux' -> 'Plan9'" in line for line in changes.record_lines())


def test_a_changed_model_is_an_output_difference_whatever_the_record(reference: Path) -> None:
    # negative control: the same record change plus one output md5
    _rewrite_record(reference, ("os", "system"), "Plan9")
    _change_model_md5(reference)
    changes = classify_changes(reference, "HEAD", changed_paths(reference))
    assert not changes.outputs_identical
    assert changes.outputs == [
        f"dvc.lock: train/models/model.safetensors md5 {_committed_model_md5()} -> {'4' * 32}"
    ]
    assert [d.key for d in changes.environment] == ["os.system"]


def test_a_record_only_change_in_every_pipeline_is_one_verdict_listing_all_files(
    reference: Path,
) -> None:
    # another CPU vendor under native, say: both pipelines' records and locks move
    for pipeline in ("", "pipelines/lm"):
        _rewrite_record(reference, ("os", "system"), "Plan9", pipeline)
    changes = classify_changes(reference, "HEAD", changed_paths(reference))
    assert changes.outputs_identical, changes.outputs
    assert sorted(changes.record_files) == sorted(
        f"{folder}{name}"
        for folder in ("", "pipelines/lm/")
        for name in ("dvc.lock", "reports/environment.json", "reports/run.json")
    )
    assert [d.key for d in changes.environment] == ["os.system"]  # said once, not twice
    # negative control: the subfolder pipeline's model is an output like the root's
    _change_model_md5(reference, "pipelines/lm")
    changes = classify_changes(reference, "HEAD", changed_paths(reference))
    assert [line.split(" md5 ")[0] for line in changes.outputs] == [
        "pipelines/lm/dvc.lock: train/pipelines/lm/models/model.safetensors"
    ]


def test_changed_metrics_and_new_files_are_output_differences(reference: Path) -> None:
    metrics = reference / "reports" / "metrics.json"
    metrics.write_text(metrics.read_text().replace("0.", "1.", 1))
    (reference / "reports" / "extra.csv").write_text("a\n")
    changes = classify_changes(reference, "HEAD", changed_paths(reference))
    assert changes.outputs == ["reports/extra.csv: new, not at HEAD", "reports/metrics.json"]
    assert changes.record_identical


def _committed_model_md5() -> str:
    lock = yaml.safe_load((ROOT / "dvc.lock").read_text())
    return next(
        out["md5"]
        for out in lock["stages"]["train"]["outs"]
        if out["path"] == "models/model.safetensors"
    )


@pytest.mark.slow
def test_check_reference_says_same_outputs_record_differs_with_its_own_exit_code(
    repo_copy: Path,
) -> None:
    # the committed record says another OS; a rerun here trains the same bits
    env_file = repo_copy / "reports" / "environment.json"
    record = json.loads(env_file.read_text())
    record["os"]["system"] = "Plan9"
    env_file.write_text(json.dumps(record, sort_keys=True))
    commit_all(repo_copy, "a reference recorded elsewhere")
    result = run_cli("verify", "--reference", "HEAD", cwd=repo_copy)
    out = result.stdout
    assert result.returncode == EXIT_RECORD_DIFFERS, out + result.stderr
    assert "SAME OUTPUTS, RECORD DIFFERS" in out
    assert "os.system: 'Plan9' -> 'Linux'" in out
    assert "NOT REPRODUCED" not in out and "IDENTICAL" not in out


def test_a_stale_dep_in_dvc_lock_is_a_record_difference_not_an_output(reference: Path) -> None:
    # the lock or the code changed since the reference was made; the outputs did not
    lock = yaml.safe_load((reference / "dvc.lock").read_text())
    for dep in lock["stages"]["train"]["deps"]:
        if dep["path"] == "requirements-cpu.lock":
            dep["md5"] = "5" * 32
    (reference / "dvc.lock").write_text(yaml.safe_dump(lock, sort_keys=False))
    changes = classify_changes(reference, "HEAD", changed_paths(reference))
    assert changes.outputs_identical, changes.outputs
    assert len(changes.lock_inputs) == 1
    assert changes.lock_inputs[0].startswith("train dep requirements-cpu.lock: ")
    assert changes.lock_inputs[0].endswith(f"-> '{'5' * 32}'")


@pytest.mark.slow
def test_check_reference_in_a_clone_with_no_dvc_cache_names_the_first_diverging_step(
    repo_copy: Path, tmp_path: Path
) -> None:
    # A fresh clone has no DVC cache and no remote: the committed weights are out of
    # reach, the committed trace (tracked in git) is not.
    clone = tmp_path / "clone"
    run_checked("git", "clone", "-q", repo_copy, clone, cwd=tmp_path)
    assert not (clone / ".dvc" / "cache").exists()
    inject = str(ROOT / "tests" / "inject")
    result = run_cli(
        "verify", "--reference", "HEAD", cwd=clone, PYTHONPATH=inject,
        REPROTRAIN_TEST_NOISE_FROM_STEP="3",
    )  # fmt: skip
    out = result.stdout
    assert result.returncode == 1, out + result.stderr
    assert "NOT REPRODUCED" in out and "not reachable" not in out, out
    assert "only one run has weights" in out, out
    # the injected layer (tests/inject) changes the network from the start: step 0 here
    assert re.search(r"traces diverge at step \d+ \(row \d+\): \w+ differs first", out), out
