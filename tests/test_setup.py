"""`make venv` on a fresh machine: which interpreter, and whether PyTorch's CPU index is added.

tools/find-python and tools/torch-index are what the Makefile asks; these tests run them
(and make itself) under simulated machines: no Python 3.11 anywhere, a broken one, pip's
machine config and find-links isolated with and without a stand-in for the local mirror.
Nothing is installed or downloaded (`pip index versions` reads file names only).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from reprotrain.provenance.environment import read_lock_pins
from tests.helpers import ROOT

MINOR = f"{sys.version_info.major}.{sys.version_info.minor}"
CPU_INDEX = "--extra-index-url https://download.pytorch.org/whl/cpu"


def _bare_machine(tmp_path: Path, *programs: tuple[str, str]) -> dict[str, str]:
    """An environment whose PATH holds bash and ``programs`` (name, script) only; no pyenv, uv."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "bash").symlink_to(shutil.which("bash") or "/bin/bash")
    for name, script in programs:
        (bin_dir / name).write_text(script)
        (bin_dir / name).chmod(0o755)
    return {"HOME": str(tmp_path / "home"), "PATH": str(bin_dir)}


def _find_python(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(ROOT / "tools" / "find-python"), MINOR],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_machine_without_python_gets_one_line_naming_what_to_install(tmp_path: Path) -> None:
    found = _find_python(_bare_machine(tmp_path))
    assert found.returncode == 1 and found.stdout == ""
    lines = found.stderr.splitlines()
    assert len(lines) == 1
    assert f"apt install python{MINOR}-venv" in lines[0]
    assert "make docker-repro" in lines[0]


def test_make_venv_stops_with_that_line_and_creates_nothing(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    env = _bare_machine(tmp_path)
    make = shutil.which("make")
    assert make is not None
    done = subprocess.run(
        [make, "-C", str(ROOT), "venv", f"VENV={venv}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "no usable Python" in done.stderr and "command not found" not in done.stderr
    assert not venv.exists()


def test_a_python_on_path_is_found_and_a_broken_one_is_skipped(tmp_path: Path) -> None:
    working = f'#!/bin/sh\nexec "{sys.executable}" "$@"\n'
    found = _find_python(_bare_machine(tmp_path / "ok", (f"python{MINOR}", working)))
    assert found.returncode == 0, found.stderr
    assert found.stdout.strip() == str(tmp_path / "ok" / "bin" / f"python{MINOR}")
    # negative control: a Python without venv/ensurepip (Debian without pythonX.Y-venv)
    broken = f'#!/bin/sh\nexec "{sys.executable}" -c "raise SystemExit(1)"\n'
    found = _find_python(_bare_machine(tmp_path / "broken", (f"python{MINOR}", broken)))
    assert found.returncode == 1 and "no usable Python" in found.stderr


def _torch_index(lock: Path, **pip_env: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update({"PIP_CONFIG_FILE": "/dev/null", "PIP_FIND_LINKS": "", **pip_env})
    return subprocess.run(
        [str(ROOT / "tools" / "torch-index"), sys.executable, str(lock)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _stand_in_mirror(folder: Path) -> Path:
    """A find-links folder listing the CPU lock's torch wheel by name (an empty file)."""
    version = read_lock_pins(ROOT / "requirements-cpu.lock")["torch"]
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    folder.mkdir()
    (folder / f"torch-{version}-{tag}-{tag}-manylinux_2_28_x86_64.whl").write_bytes(b"")
    return folder


def test_cpu_index_is_added_only_where_the_pip_sources_lack_the_pinned_wheel(
    tmp_path: Path,
) -> None:
    lock = ROOT / "requirements-cpu.lock"
    mirror = _stand_in_mirror(tmp_path / "wheels")
    with_mirror = _torch_index(lock, PIP_FIND_LINKS=str(mirror), PIP_NO_INDEX="1")
    assert with_mirror.returncode == 0 and with_mirror.stdout == "", with_mirror.stderr
    # a user's machine: pip's own config and find-links isolated, PyPI only
    without = _torch_index(lock)
    assert without.returncode == 0, without.stderr
    assert without.stdout.strip() == CPU_INDEX


def test_the_container_lock_needs_no_extra_index(tmp_path: Path) -> None:
    # its torch is the CUDA build on PyPI: no `+cpu`, nothing to add (nothing is asked)
    done = _torch_index(ROOT / "requirements.lock", PIP_NO_INDEX="1")
    assert done.returncode == 0 and done.stdout == ""


@pytest.mark.parametrize("lock", ["requirements-cpu.lock", "requirements.lock"])
def test_makefile_passes_the_decision_to_the_hash_checked_install(lock: str) -> None:
    make = shutil.which("make")
    assert make is not None
    dry = subprocess.run(
        [make, "-C", str(ROOT), "-n", "venv", "VENV=/nonexistent/venv", f"LOCK={lock}"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert f"tools/torch-index /nonexistent/venv/bin/python {lock}" in dry
    assert f"pip install --require-hashes --no-deps $extra -r {lock}" in dry
