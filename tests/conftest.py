"""Shared fixtures: the repository root, a CLI runner, and a prepared dataset."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from reprotrain.determinism import reexec_with_fixed_hash_seed
from tests.helpers import ROOT, commit_all, copy_checkout, run_checked, run_cli


def pytest_configure(config: pytest.Config) -> None:
    # In-process tests call configure_determinism(mode=True), which fails closed
    # unless the hash seed was fixed at interpreter start: restart pytest with it.
    reexec_with_fixed_hash_seed()


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default digits dataset, prepared once per session by the real CLI."""
    work = tmp_path_factory.mktemp("prepared")
    (work / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    out = work / "dataset.safetensors"
    result = run_cli("prepare", "--raw-dir", work, "--out", out, cwd=work)
    assert result.returncode == 0, result.stderr
    return out


@pytest.fixture(scope="session")
def env_record(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An environment record of this machine, written by the real `reprotrain env`."""
    out = tmp_path_factory.mktemp("env") / "environment.json"
    result = run_cli("env", "--lock", ROOT / "requirements-cpu.lock", "--out", out, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    return out


@pytest.fixture
def restore_torch_flags() -> Iterator[None]:
    """Put torch's global determinism flags back after a test changes them."""
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    yield
    torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[2:]


@pytest.fixture(scope="session")
def dvc_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of this checkout after `dvc repro`, with the results committed. Do not modify."""
    repo = copy_checkout(tmp_path_factory.mktemp("repo"))
    run_checked("dvc", "repro", cwd=repo)
    commit_all(repo, "results")
    return repo


@pytest.fixture
def repo_copy(dvc_repo: Path, tmp_path: Path) -> Path:
    """A private copy of ``dvc_repo`` (git history and DVC cache included) to modify."""
    return Path(shutil.copytree(dvc_repo, tmp_path / "repo", symlinks=True))
