"""Shared fixtures: the repository root, a CLI runner, and a prepared dataset.

``REPROTRAIN_TEST_ATEN_LEVEL`` (``make test`` sets ``default``) runs the pytest
processes themselves at another ATen level than the CPU profile pins, as on a
host whose own level is not the pin (an AVX-512 CPU under the portable
profile's AVX2): ATen reads ``ATEN_CPU_CAPABILITY`` once, so this module sets
it, imports torch, makes ATen choose, and removes it again, so the processes a
test starts inherit nothing that contradicts the profile. A test that trains
or checks the profile in the pytest process then meets the refusal a user on
such a host would.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

EMULATED_LEVEL = os.environ.get("REPROTRAIN_TEST_ATEN_LEVEL")
if EMULATED_LEVEL:
    os.environ["ATEN_CPU_CAPABILITY"] = EMULATED_LEVEL
import torch  # noqa: E402  (after the emulated level is exported)

if EMULATED_LEVEL:
    if torch.backends.cpu.get_cpu_capability() != EMULATED_LEVEL.upper():
        raise RuntimeError(
            f"REPROTRAIN_TEST_ATEN_LEVEL={EMULATED_LEVEL}: ATen chose "
            f"{torch.backends.cpu.get_cpu_capability()}; torch was imported before this conftest"
        )
    del os.environ["ATEN_CPU_CAPABILITY"]

from reprotrain._zygote import VARIABLE as ZYGOTE  # noqa: E402
from reprotrain.determinism import reexec_with_fixed_hash_seed  # noqa: E402
from tests.helpers import (  # noqa: E402
    ROOT,
    built_once,
    commit_all,
    copy_checkout,
    run_checked,
    run_cli,
)


def pytest_configure(config: pytest.Config) -> None:
    # In-process tests call configure_determinism(mode=True), which fails closed
    # unless the hash seed was fixed at interpreter start: restart pytest with it.
    reexec_with_fixed_hash_seed()
    # The commands' restarts fork from warm interpreters (src/reprotrain/_zygote.py), one
    # folder per run, shared by the xdist workers; REPROTRAIN_TEST_ZYGOTE=0 turns it off.
    if not hasattr(config, "workerinput") and os.environ.get("REPROTRAIN_TEST_ZYGOTE") != "0":
        os.environ[ZYGOTE] = tempfile.mkdtemp(prefix="reprotrain-zygote-")


def pytest_unconfigure(config: pytest.Config) -> None:
    """The run's warm interpreters end with it (they would after two idle minutes)."""
    if hasattr(config, "workerinput") or not (folder := os.environ.pop(ZYGOTE, None)):
        return
    for pid_file in Path(folder).glob("*.pid"):
        with contextlib.suppress(ValueError, ProcessLookupError, FileNotFoundError):
            os.kill(int(pid_file.read_text()), signal.SIGTERM)
    shutil.rmtree(folder, ignore_errors=True)


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
def dvc_repo(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Path:
    """This checkout after `make repro`'s `dvc repro`s, results committed. Do not modify.

    Built once per pytest run: the first xdist worker to ask runs `dvc repro` in
    the run's shared temp folder; every worker then gets its own copy, so no two
    workers' git or DVC commands touch one repository at once.
    """

    def build(built: Path) -> None:
        built.mkdir()
        copy_checkout(built)
        run_checked("dvc", "repro", cwd=built)  # each pipeline, as `make repro`
        run_checked("dvc", "repro", "pipelines/lm/dvc.yaml", cwd=built)
        run_checked("dvc", "repro", "pipelines/lm-compiled/dvc.yaml", cwd=built)
        commit_all(built, "results")

    built = built_once(tmp_path_factory.getbasetemp(), worker_id, "dvc_repo", build)
    return Path(shutil.copytree(built, tmp_path_factory.mktemp("repo") / "r", symlinks=True))


@pytest.fixture
def repo_copy(dvc_repo: Path, tmp_path: Path) -> Path:
    """A private copy of ``dvc_repo`` (git history and DVC cache included) to modify."""
    return Path(shutil.copytree(dvc_repo, tmp_path / "repo", symlinks=True))
