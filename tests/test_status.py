"""`reprotrain status` and `verify --reference`: the CI gates of a committed reference."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, commit_all, run_checked, run_cli

FAKE_CPU = {"PYTHONPATH": str(ROOT / "tests" / "inject"), "REPROTRAIN_TEST_CPU": "xeon-avx512"}


def test_status_is_clean_after_repro_also_on_another_cpu_family(repo_copy: Path) -> None:
    result = run_cli("status", cwd=repo_copy)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "up to date" in result.stdout
    assert run_cli("status", cwd=repo_copy, **FAKE_CPU).returncode == 0


def test_status_names_what_would_change(repo_copy: Path) -> None:
    """Negative control: a changed param and a changed profile are each reported."""
    params = repo_copy / "params.yaml"
    params.write_text(params.read_text().replace("lr: 0.005", "lr: 0.004"))
    result = run_cli("status", "--json", cwd=repo_copy)
    assert result.returncode == 1
    changes = json.loads(result.stdout)["changes"]
    assert any(c.startswith("train:") and "params.yaml" in c for c in changes), changes
    params.write_text(params.read_text().replace("profile: portable", "profile: native"))
    result = run_cli("status", cwd=repo_copy)
    assert result.returncode == 1 and "env: cpu.profile: 'portable' -> 'native'" in result.stdout


def test_status_names_another_pipelines_stage_by_its_pipeline(repo_copy: Path) -> None:
    params = repo_copy / "pipelines/lm/params.yaml"
    params.write_text(params.read_text().replace("max_epochs:", "max_epochs: 1 #", 1))
    changes = json.loads(run_cli("status", "--json", cwd=repo_copy).stdout)["changes"]
    assert any(c.startswith("pipelines/lm/dvc.yaml:train:") for c in changes), changes
    assert not any(c.startswith("train:") for c in changes), changes  # control: root's train


@pytest.mark.slow
def test_verify_reference_names_a_tampered_file_alone_and_reproduces_the_rest(
    repo_copy: Path,
) -> None:
    # One run checks both sides: every other tracked file (dvc.lock with each output's md5,
    # both pipelines' reports) reproduces byte for byte, and the tampered one is named.
    # The REPRODUCED verdict itself: test_user_project.py's check-reference, and .ci/run.
    metrics = repo_copy / "reports" / "metrics.json"
    metrics.write_text(metrics.read_text().replace("0.", "0.0", 1))
    commit_all(repo_copy, "a reference no run gives")
    differs = run_cli("verify", "--reference", "HEAD", cwd=repo_copy)
    out = differs.stdout
    assert differs.returncode == 1, out + differs.stderr
    assert "NOT REPRODUCED" in out and "IDENTICAL" not in out
    header = "outputs this run changed against HEAD:\n"
    assert header in out, out
    changed = out.split(header, 1)[1].split("likely cause", 1)[0].strip().splitlines()
    assert len(changed) == 1 and changed[0].strip().startswith("reports/metrics.json"), out
    assert "nothing differs there" in out and "model and trace: the same bits" in out, out


def _dvc_added_input_repo(repo: Path) -> None:
    """A git + DVC repo whose one stage reads data/raw.txt, added with `dvc add`, run once."""
    repo.mkdir()
    run_checked("git", "init", "-q", cwd=repo)
    run_checked(sys.executable, "-m", "dvc", "init", "-q", cwd=repo)
    (repo / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    (repo / "data").mkdir()
    (repo / "data" / "raw.txt").write_text("raw\n")
    run_checked(sys.executable, "-m", "dvc", "add", "-q", "data/raw.txt", cwd=repo)
    (repo / "dvc.yaml").write_text(
        "stages:\n  copy:\n    cmd: cp data/raw.txt out.txt\n"
        "    deps: [data/raw.txt]\n    outs: [out.txt]\n"
    )
    run_checked(sys.executable, "-m", "dvc", "repro", "-q", cwd=repo)
    commit_all(repo, "a stage on dvc-added data")


def test_verify_reference_names_dvc_data_that_no_cache_or_remote_has(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    _dvc_added_input_repo(repo)
    # Control: the data is in this repository's DVC cache, and the clone reads it there.
    held = run_cli("verify", "--reference", "HEAD", cwd=repo)
    assert held.returncode == 0 and "REPRODUCED" in held.stdout, held.stdout + held.stderr
    shutil.rmtree(repo / ".dvc" / "cache")  # as in a fresh clone with no remote
    lost = run_cli("verify", "--reference", "HEAD", cwd=repo)
    assert lost.returncode == 2, lost.stdout + lost.stderr
    (line,) = lost.stderr.strip().splitlines()
    assert "missing data 'source': data/raw.txt" in line  # DVC's own words, kept
    assert "data/raw.txt is tracked by DVC" in line and "`dvc pull`" in line
