"""The environment record: byte-stable, blind to hosts and times, and sensitive to what matters."""

from __future__ import annotations

import copy
import json
import os
import re
import socket
import subprocess
from pathlib import Path

import pytest

from reprotrain.hashing import canonical_json, sha256_file
from reprotrain.provenance.environment import (
    capture_environment,
    environment_sha256,
    git_state,
    lock_status,
)
from tests.helpers import ROOT, cli_env, commit_all, run_checked, run_cli

LOCK = ROOT / "requirements-cpu.lock"


def test_capture_is_byte_stable_and_holds_no_host_pid_or_path() -> None:
    first = canonical_json(capture_environment(LOCK, ignore_packages=["reprotrain"]))
    second = canonical_json(capture_environment(LOCK, ignore_packages=["reprotrain"]))
    assert first == second
    for secret in (socket.gethostname(), str(ROOT)):
        assert secret not in first
    # as a number of its own: a hash in the record may hold the pid's digits (cf30153c...)
    assert not re.search(rf"(?<![0-9A-Za-z]){os.getpid()}(?![0-9A-Za-z])", first), os.getpid()


def test_record_names_what_decides_the_bits() -> None:
    record = capture_environment(LOCK)
    assert record["torch"]["version"].startswith("2.13.0")
    assert record["cpu"]["model"] and "avx2" in record["cpu"]["dispatch_flags"]
    assert record["host"]["libc"].startswith("glibc") and "libc" not in record["os"]
    assert record["container"] == {"base_image": "none", "image_id": "none"}
    assert "CUBLAS_WORKSPACE_CONFIG" in record["variables"]


def test_venv_matches_its_lock_exactly() -> None:
    status = lock_status(LOCK, ignore_packages=["reprotrain"])
    assert status["exact"], status["drift"]


def test_a_drifted_pin_is_listed(tmp_path: Path) -> None:
    lock = tmp_path / "requirements.lock"
    lock.write_text(LOCK.read_text().replace("\nnumpy==", "\nnumpy==0.0.1-was-"))
    status = lock_status(lock, ignore_packages=["reprotrain"])
    assert not status["exact"]
    assert [d["package"] for d in status["drift"]] == ["numpy"]


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("torch", "version"), "2.13.1"),
        (("gpu",), [{"name": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0"}]),
        (("lock", "sha256"), "0" * 64),
        (("variables", "OMP_NUM_THREADS"), "7"),
    ],
)
def test_any_recorded_change_changes_the_sha256(path: tuple[str, ...], value: object) -> None:
    record = capture_environment(LOCK)
    changed = copy.deepcopy(record)
    node = changed
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    assert environment_sha256(changed) != environment_sha256(record)
    assert environment_sha256(copy.deepcopy(record)) == environment_sha256(record)


def test_git_state_sees_dirt_but_not_excluded_outputs(tmp_path: Path) -> None:
    run_checked("git", "init", "-q", cwd=tmp_path)
    (tmp_path / "code.py").write_text("x = 1\n")
    (tmp_path / "reports").mkdir()
    (tmp_path / "reports" / "m.json").write_text("{}\n")
    commit_all(tmp_path, "init")
    assert git_state(tmp_path)["dirty"] is False
    (tmp_path / "reports" / "m.json").write_text('{"a": 1}\n')
    assert git_state(tmp_path, exclude=["reports"])["dirty"] is False
    assert git_state(tmp_path)["dirty"] is True
    (tmp_path / "code.py").write_text("x = 2\n")
    assert git_state(tmp_path, exclude=["reports"])["dirty"] is True


def test_git_state_outside_a_repository(tmp_path: Path) -> None:
    assert git_state(tmp_path) == {"commit": None, "dirty": None}


def test_env_command_explains_which_differences_void_the_guarantee(tmp_path: Path) -> None:
    record = capture_environment(LOCK)
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(record))
    changed = copy.deepcopy(record)
    changed["gpu"] = [{"name": "NVIDIA H200"}]
    changed["container"]["image_id"] = "sha256:" + "1" * 64
    b.write_text(json.dumps(changed))
    result = run_cli("env", "--diff", a, b, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "differences void the bitwise guarantee" in lines[0]
    assert any(line.strip().startswith("gpu") and "[voids" in line for line in lines)
    assert any("container.image_id" in line and "[voids" not in line for line in lines)
    same = run_cli("env", "--diff", a, a, cwd=tmp_path)
    assert "identical environments" in same.stdout


def test_env_stage_is_fast_because_it_never_imports_torch() -> None:
    code = (
        "import sys; from reprotrain.pipeline.stages.env import record_environment; "
        f"record_environment(__import__('pathlib').Path({str(LOCK)!r})); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run(
        [os.sys.executable, "-c", code], env=cli_env(), capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False"


def test_outside_a_container_the_record_says_no_image(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REPROTRAIN_BASE_IMAGE", raising=False)
    monkeypatch.delenv("REPROTRAIN_IMAGE_ID", raising=False)
    assert capture_environment(None)["container"] == {"base_image": "none", "image_id": "none"}


def test_inside_the_image_the_record_carries_its_digest_and_id(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    outside = capture_environment(LOCK)
    base = "python:3.11-slim-bookworm@sha256:" + "0b" * 32
    image_id = "sha256:" + "1f" * 32
    monkeypatch.setenv("REPROTRAIN_BASE_IMAGE", base)
    monkeypatch.setenv("REPROTRAIN_IMAGE_ID", image_id)
    inside = capture_environment(LOCK)
    assert inside["container"] == {"base_image": base, "image_id": image_id}
    assert environment_sha256(inside) != environment_sha256(outside)


def _env_stage(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    out = tmp_path / "environment.json"
    result = run_cli("env", "--out", out, cwd=ROOT, **env)
    return result, (json.loads(out.read_text()) if out.is_file() else {})


def test_env_stage_checks_the_cpu_lock_by_default(tmp_path: Path) -> None:
    result, record = _env_stage(tmp_path, REPROTRAIN_LOCK="")
    assert result.returncode == 0, result.stderr
    assert record["lock"]["file"] == "requirements-cpu.lock"
    assert record["lock"]["exact"] is True


def test_env_stage_checks_the_lock_named_by_reprotrain_lock(tmp_path: Path) -> None:
    # The container's lock (CUDA torch) on this CPU venv: the variable really switches
    # the lock, and the drift that `train` would refuse shows up.
    result, record = _env_stage(tmp_path, REPROTRAIN_LOCK="requirements.lock")
    assert result.returncode == 0, result.stderr
    assert record["lock"]["file"] == "requirements.lock"
    assert record["lock"]["sha256"] == sha256_file(ROOT / "requirements.lock")
    drifted = {d["package"]: d for d in record["lock"]["drift"]}
    assert drifted["torch"] == {"package": "torch", "locked": "2.13.0", "installed": "2.13.0+cpu"}
    assert "drift" in result.stdout


def test_env_stage_names_a_missing_lock_and_the_variable(tmp_path: Path) -> None:
    result, record = _env_stage(tmp_path, REPROTRAIN_LOCK="no-such.lock")
    assert result.returncode == 2
    assert "no-such.lock: lock file not found" in result.stderr
    assert "REPROTRAIN_LOCK" in result.stderr
    assert record == {}


def test_env_prints_outside_a_repository_under_the_default_profile(tmp_path: Path) -> None:
    # As `docker run IMAGE reprotrain env` does in a bare container: no params.yaml there.
    result = run_cli("env", "--lock", LOCK, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "no params.yaml here: recorded under the default params' CPU profile" in result.stdout
    record = json.loads(result.stdout[result.stdout.index("{") : result.stdout.rindex("}") + 1])
    assert record["cpu"]["profile"] == "portable"
    # Negative controls: a params file named but absent, or a record to write, needs one.
    named = run_cli("env", "--lock", LOCK, "--params", "nope.yaml", cwd=tmp_path)
    assert named.returncode == 2 and "nope.yaml: file not found" in named.stderr
    written = run_cli("env", "--lock", LOCK, "--out", tmp_path / "e.json", cwd=tmp_path)
    assert written.returncode == 2 and "params.yaml: file not found" in written.stderr
    assert not (tmp_path / "e.json").exists()


class _Dist:
    """A distribution as importlib.metadata gives one: its name and its direct_url.json."""

    def __init__(self, name: str, direct_url: dict | None) -> None:
        self.metadata = {"Name": name}
        self._text = None if direct_url is None else json.dumps(direct_url)

    def read_text(self, filename: str) -> str | None:
        return self._text if filename == "direct_url.json" else None


def test_a_project_installed_editable_from_the_repository_is_its_own_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from importlib import metadata

    from reprotrain.provenance.environment import editable_packages

    inside, outside = tmp_path / "repo", tmp_path / "elsewhere"
    dists = [
        _Dist("mypkg", {"url": f"file://{inside}", "dir_info": {"editable": True}}),
        _Dist("theirs", {"url": f"file://{outside}", "dir_info": {"editable": True}}),
        _Dist("built", {"url": f"file://{inside}", "dir_info": {}}),  # installed, not editable
        _Dist("numpy", None),
    ]
    monkeypatch.setattr(metadata, "distributions", lambda: dists)
    assert editable_packages(inside) == ["mypkg"]
    assert editable_packages(outside) == ["theirs"]  # control: another repository's
