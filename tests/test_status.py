"""`reprotrain status` and `verify --reference`: the CI gates of a committed reference."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import ROOT, commit_all, run_cli

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


@pytest.mark.slow
def test_verify_reference_passes_on_the_committed_run_and_names_a_tampered_file(
    repo_copy: Path,
) -> None:
    same = run_cli("verify", "--reference", cwd=repo_copy)
    assert same.returncode == 0, same.stdout + same.stderr
    assert "REPRODUCED: HEAD's reference" in same.stdout and "NOT" not in same.stdout
    metrics = repo_copy / "reports" / "metrics.json"
    metrics.write_text(metrics.read_text().replace("0.", "0.0", 1))
    commit_all(repo_copy, "a reference no run gives")
    differs = run_cli("verify", "--reference", "HEAD", cwd=repo_copy)
    assert differs.returncode == 1
    assert "reports/metrics.json" in differs.stdout and "NOT REPRODUCED" in differs.stdout
    assert "IDENTICAL" not in differs.stdout
