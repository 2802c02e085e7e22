"""The real Dockerfile builds, and the pipeline in the image reruns to the same bits.

No container registry is reachable from CI, so the digest-pinned python base
cannot be pulled. A stand-in is made instead: Debian bookworm (debootstrap
minbase) with Debian's Python 3.11, python3-venv and ca-certificates, the OS
the real base is built on, imported with ``docker import``. The real
Dockerfile is built on it through its ``BASE_IMAGE`` build argument, with the
real ``requirements.lock`` (torch with CUDA, about 2.7 GB, every wheel
hash-checked), and the default command (``dvc repro``) runs twice on CPU, each
time on a fresh copy of this checkout mounted at /workspace.

The runs use a UID the image has no passwd entry for (4321 when the tests run
as root, else the caller's), as ``make docker-repro --user`` does: the image
sets HOME, USER and LOGNAME so neither git nor DVC looks the UID up, and the
copy is owned by that UID so the container can write its outputs.

Where the network intercepts TLS (as on our build machines), the host's extra
CA certificates are copied into the stand-in base so pip inside the build can
verify PyPI; the Dockerfile itself carries no such thing. Both images are kept
(tagged) so a rerun reuses Docker's layer cache; containers are always removed.
Run with ``make test-container`` (about 10 minutes on a fresh machine).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from reprotrain.hashing import sha256_file
from reprotrain.provenance.environment import environment_sha256
from tests.helpers import ROOT, copy_checkout

pytestmark = pytest.mark.container

STANDIN = "reprotrain-standin:bookworm-1"
IMAGE = "reprotrain:test"
#: Outputs whose bytes must agree between the two container runs.
OUTPUTS = (
    "models/model.safetensors",
    "models/trace.safetensors",
    "reports/train_metrics.json",
    "reports/metrics.json",
    "reports/run.json",
    "reports/environment.json",
    "reports/plots/train/train_loss.csv",
    "reports/plots/train/val.csv",
    "dvc.lock",
)
HOST_CA_DIR = Path("/usr/local/share/ca-certificates")


def _run(*cmd: str | Path, timeout: int = 1800, stdin: int | None = None) -> str:
    result = subprocess.run(
        [str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, stdin=stdin
    )
    assert result.returncode == 0, f"{' '.join(map(str, cmd))}\n{result.stdout}\n{result.stderr}"
    return result.stdout + result.stderr


def _image_id(name: str) -> str | None:
    result = subprocess.run(
        ["docker", "image", "inspect", "--format", "{{.Id}}", name],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return result.stdout.strip() if result.returncode == 0 else None


@pytest.fixture(scope="module")
def docker() -> None:
    if shutil.which("docker") is None:
        pytest.skip("no docker client: apt-get install docker.io (.ci/run does)")
    info = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=60)
    if info.returncode != 0:
        pytest.skip("no Docker engine answers `docker info`: start dockerd (.ci/run does)")


def _make_standin(root: Path) -> None:
    """debootstrap bookworm with Python 3.11 into ``root`` and import it as STANDIN."""
    if os.geteuid() != 0:
        pytest.fail(f"building the stand-in base {STANDIN} needs root (debootstrap, chroot)")
    if shutil.which("debootstrap") is None:
        pytest.fail("debootstrap not found: apt-get install debootstrap (.ci/run does)")
    packages = "python3,python3-venv,ca-certificates"
    _run("debootstrap", "--variant=minbase", f"--include={packages}", "bookworm", root)
    extra_cas = sorted(HOST_CA_DIR.glob("*.crt")) if HOST_CA_DIR.is_dir() else []
    for cert in extra_cas:
        shutil.copy2(cert, root / "usr/local/share/ca-certificates" / cert.name)
    if extra_cas:
        _run("chroot", root, "update-ca-certificates")
    tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
    try:
        _run(
            "docker",
            "import",
            "--change",
            "ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt",
            "--change",
            "ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt",
            "-",
            STANDIN,
            stdin=tar.stdout.fileno(),
        )
    finally:
        tar.stdout.close()
        assert tar.wait() == 0, f"tar of {root} failed"


@pytest.fixture(scope="module")
def image(docker: None, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The real Dockerfile built on the stand-in base; returns the image ID."""
    if _image_id(STANDIN) is None:
        _make_standin(tmp_path_factory.mktemp("standin") / "root")
    _run("docker", "build", "--build-arg", f"BASE_IMAGE={STANDIN}", "-t", IMAGE, ROOT)
    image_id = _image_id(IMAGE)
    assert image_id and image_id.startswith("sha256:")
    return image_id


@pytest.fixture
def run_as() -> str:
    """A UID:GID with no passwd entry in the image when we can chown, else the caller's."""
    return "4321:4321" if os.geteuid() == 0 else f"{os.getuid()}:{os.getgid()}"


@pytest.fixture
def container_name() -> Iterator[str]:
    name = f"reprotrain-test-{uuid.uuid4().hex[:12]}"
    yield name
    subprocess.run(["docker", "rm", "-f", name], capture_output=True, timeout=120)


def _checkout_for(directory: Path, run_as: str) -> Path:
    repo = copy_checkout(directory)
    if os.geteuid() == 0:
        _run("chown", "-R", run_as, repo)
    return repo


def _docker_argv(name: str, image_id: str, run_as: str, repo: Path | None) -> list[str]:
    """``docker run`` with the image's default command, as ``make docker-repro`` runs it."""
    mount = ["-v", f"{repo}:/workspace"] if repo else []
    identity = ["-e", f"REPROTRAIN_IMAGE_ID={image_id}"]
    return ["docker", "run", "--rm", "--name", name, "--user", run_as, *identity, *mount, image_id]


def _docker_run(name: str, image_id: str, run_as: str, repo: Path | None, *cmd: str) -> str:
    return _run(*_docker_argv(name, image_id, run_as, repo), *cmd)


def test_image_runs_as_non_root_and_records_its_base_and_id(
    image: str, container_name: str, run_as: str
) -> None:
    config = json.loads(_run("docker", "image", "inspect", "--format", "{{json .Config}}", image))
    assert config["User"] == "1000:1000"
    assert config["Cmd"] == ["dvc", "repro"]
    assert config["WorkingDir"] == "/workspace"
    # Any command replaces the default one (`reprotrain verify` is run this way).
    out = _docker_run(
        container_name,
        image,
        run_as,
        None,
        "reprotrain",
        "env",
        "--lock",
        "/opt/reprotrain/requirements.lock",
    )
    record = json.loads(out[out.index("{") : out.rindex("}") + 1])
    assert record["container"] == {"base_image": STANDIN, "image_id": image}
    assert record["lock"]["file"] == "requirements.lock"
    assert record["lock"]["exact"] is True, record["lock"]["drift"]
    assert record["torch"]["version"] == "2.13.0"
    assert record["torch"]["cuda"], "the image must hold the CUDA build of torch"


def test_two_container_runs_of_the_pipeline_give_identical_bits(
    image: str, container_name: str, run_as: str, tmp_path: Path
) -> None:
    repos = []
    for attempt in ("first", "second"):
        (tmp_path / attempt).mkdir()
        repo = _checkout_for(tmp_path / attempt, run_as)
        log = _docker_run(f"{container_name}-{attempt}", image, run_as, repo)
        assert "Running stage 'train'" in log, log
        repos.append(repo)
    first, second = repos
    for name in OUTPUTS:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name

    # The run is tied to the image and to the container's lock.
    record = json.loads((first / "reports/environment.json").read_text())
    assert record["container"] == {"base_image": STANDIN, "image_id": image}
    assert (record["lock"]["file"], record["lock"]["exact"]) == ("requirements.lock", True)
    inputs = json.loads((first / "reports/run.json").read_text())["inputs"]
    assert inputs["environment_sha256"] == environment_sha256(record)
    assert inputs["lock_sha256"] == sha256_file(ROOT / "requirements.lock")
    # DVC's hash state lives on the mounted volume, not in the discarded container.
    assert any((first / ".dvc/tmp/site_cache").rglob("*")), "site cache not on the volume"

    # A third container on the same repository: the environment record comes out
    # byte-identical, so DVC keeps the trained model instead of retraining.
    again = _docker_run(f"{container_name}-again", image, run_as, first)
    assert "Stage 'train' didn't change, skipping" in again, again
    for name in OUTPUTS:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name

    # Another command in place of the default one: rerun-and-compare inside the image.
    verified = _docker_run(f"{container_name}-verify", image, run_as, first, "reprotrain", "verify")
    assert "reprotrain verify: IDENTICAL" in verified, verified


def test_the_container_refuses_packages_that_drift_from_the_mounted_lock(
    image: str, container_name: str, run_as: str, tmp_path: Path
) -> None:
    # Negative control for the lock check: the repository's requirements.lock now
    # pins another numpy than the image holds, so `train` must refuse (exit 3).
    repo = copy_checkout(tmp_path)
    lock = repo / "requirements.lock"
    lock.write_text(re.sub(r"(?m)^numpy==\S+", "numpy==1.0.0", lock.read_text(), count=1))
    if os.geteuid() == 0:
        _run("chown", "-R", run_as, repo)
    result = subprocess.run(
        _docker_argv(container_name, image, run_as, repo),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert result.returncode != 0
    assert "installed packages differ from requirements.lock: numpy" in result.stderr
    assert "exited with 3" in result.stderr
    assert not (repo / "models/model.safetensors").exists()
