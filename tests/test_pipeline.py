"""`dvc repro` end to end in a temporary copy of the repository.

Slow by nature (three full pipeline runs, about a minute and a half on two
cores): it is the guarantee the product makes, so it runs in `make test`.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers import ROOT, cli_env


def _run(*cmd: str, cwd: Path) -> str:
    result = subprocess.run(
        cmd, cwd=cwd, env=cli_env(), capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh git repository holding this checkout's files (tracked or not, never ignored)."""
    files = _run("git", "ls-files", "-z", "-co", "--exclude-standard", cwd=ROOT).split("\0")
    dest = tmp_path_factory.mktemp("repo")
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    _run("git", "init", "-q", cwd=dest)
    _run("git", "add", "-A", cwd=dest)
    _run("git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "copy", cwd=dest)
    _run("dvc", "repro", cwd=dest)
    return dest


def test_repro_then_forced_repro_gives_a_byte_identical_dvc_lock(repo: Path) -> None:
    first = (repo / "dvc.lock").read_bytes()
    outputs = {
        p: (repo / p).read_bytes() for p in ("reports/metrics.json", "reports/train_metrics.json")
    }
    _run("dvc", "repro", "--force", cwd=repo)
    assert (repo / "dvc.lock").read_bytes() == first
    assert all((repo / p).read_bytes() == data for p, data in outputs.items())
    assert "up to date" in _run("dvc", "status", cwd=repo)


def test_nothing_tracked_holds_a_path_time_or_host(repo: Path) -> None:
    import socket

    for path in [repo / "dvc.lock", *sorted((repo / "reports").rglob("*.*"))]:
        text = path.read_text()
        assert str(repo) not in text and socket.gethostname() not in text, path
    assert not (repo / "lightning_logs").exists()


def test_plots_render_in_dvc_format(repo: Path) -> None:
    shown = json.loads(_run("dvc", "plots", "show", "--json", cwd=repo))["data"]
    assert set(shown) == {"train_loss", "validation", "confusion"}
    rows = shown["validation"][0]["content"]["data"]["values"]
    assert {row["epoch"] for row in rows} == {str(epoch) for epoch in range(10)}
    assert {"val_loss", "val_acc"} <= set(rows[0])


def test_dvc_exp_run_with_a_param_override(repo: Path) -> None:
    _run("dvc", "exp", "run", "-S", "seed=7", "--name", "seed7", cwd=repo)
    shown = json.loads(_run("dvc", "exp", "show", "--json", cwd=repo))
    experiments = [e for rev in shown for e in (rev.get("experiments") or [])]
    names = {e.get("name") for e in experiments}
    assert "seed7" in names, shown
    params = json.loads(_run("dvc", "params", "diff", "HEAD", "seed7", "--json", cwd=repo))
    assert (params["params.yaml"]["seed"]["old"], params["params.yaml"]["seed"]["new"]) == (42, 7)
