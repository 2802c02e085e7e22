"""Python's patch level and glibc do not decide the bits: shown, then kept out of the key.

The slow tests train the default recipe (prepare, env, train, in fresh processes) under
two values of a field and compare the bytes: another CPython 3.11 patch level (a second
venv from the same hash-checked lock), and Debian 13's glibc 2.41 (its ``libc6`` unpacked
from Debian's archive, the venv's Python started through its dynamic loader). Both gave
the reference's bits on an AMD EPYC (Zen 4) host: Python 3.11.7 vs 3.11.2, glibc 2.36 vs
2.41. Downloads and the second venv are cached under ``$REPROTRAIN_TEST_CACHE`` (default
``~/.cache/reprotrain-tests``). The quick tests check the consequence: those fields sit in
the record's informational ``host`` section, out of the cache key and the run ID, while a
field that does decide the bits (the CPU profile) still moves both.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pytest

from reprotrain.pipeline.params_file import load_params
from reprotrain.pipeline.stages.env import record_environment, whole_environment
from reprotrain.provenance.environment import environment_sha256
from tests.helpers import ROOT, cli_env

LOCK = ROOT / "requirements-cpu.lock"
CACHE = Path(os.environ.get("REPROTRAIN_TEST_CACHE") or Path.home() / ".cache/reprotrain-tests")
MINOR = f"{sys.version_info.major}.{sys.version_info.minor}"
PATCH = platform.python_version()
#: Debian 13 (trixie): its libc6 is glibc 2.41.
TRIXIE = """Types: deb
URIs: http://deb.debian.org/debian
Suites: trixie
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
"""


def test_deciding_record_holds_python_major_minor_but_no_patch_level_or_glibc() -> None:
    whole = whole_environment(LOCK)
    assert whole["python"] == {"minor": MINOR, "implementation": sys.implementation.name}
    assert "libc" not in whole["os"]
    assert whole["host"]["python"] == PATCH
    assert whole["host"]["libc"].startswith("glibc-")


def test_patch_level_and_glibc_leave_the_cache_key_and_run_id_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    here = record_environment(LOCK)
    monkeypatch.setattr(platform, "python_version", lambda: "3.11.2")
    monkeypatch.setattr(platform, "libc_ver", lambda *a, **k: ("glibc", "2.41"))
    elsewhere = whole_environment(LOCK)
    assert elsewhere["host"]["python"] == "3.11.2" and elsewhere["host"]["libc"] == "glibc-2.41"
    # the run ID covers the environment through this fingerprint (run_record.run_inputs)
    assert environment_sha256(record_environment(LOCK)) == environment_sha256(here)


def test_a_field_that_decides_the_bits_still_moves_the_cache_key() -> None:
    # negative control: cpu.profile native, and its cpu.threads, were shown to change the bits
    params = load_params(ROOT / "params.yaml")
    assert params.cpu.profile == "portable"
    here = environment_sha256(record_environment(LOCK, params))

    def with_cpu(**cpu: Any) -> str:
        changed = dataclasses.replace(params, cpu=dataclasses.replace(params.cpu, **cpu))
        return environment_sha256(record_environment(LOCK, changed))

    native = with_cpu(profile="native")
    assert native != here and with_cpu(profile="native", threads=2) != native
    # portable's threads share the GEMM's fixed blocks: shown not to change the bits
    assert with_cpu(threads=2) == here


def test_env_diff_still_shows_the_patch_level_beside_the_records(tmp_path: Path) -> None:
    for name, python in (("a", "3.11.7"), ("b", "3.11.2")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "environment.json").write_text(json.dumps(record_environment(LOCK)))
        (tmp_path / name / "host.json").write_text(json.dumps({"python": python}))
    from tests.helpers import run_cli

    result = run_cli(
        "env", "--diff", tmp_path / "a/environment.json", tmp_path / "b/environment.json", cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    assert "none voids the bitwise guarantee" in result.stdout
    assert "host.python: '3.11.7' -> '3.11.2' [no: informational: shown not to change" in (
        result.stdout
    )


# --- the evidence: train under two values, compare the bytes (slow) --------------------------


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _train(python: list[str], out: Path, *overrides: str, **env: str) -> dict[str, str]:
    """prepare, env and train of the default recipe by ``python``; sha256 of what they wrote."""
    out.mkdir(parents=True)
    params = str(ROOT / "params.yaml")
    # Run in ``out`` with relative output paths: the data module's path is recorded in the
    # weights file, and must read the same in both runs.
    steps = [
        [
            *("prepare", "--params", params, "--raw-dir", str(ROOT / "data/raw")),
            *("--out", "dataset.safetensors"),
        ],
        [
            *("env", "--params", params, "--lock", str(ROOT / "requirements-cpu.lock")),
            *("--out", "environment.json", "--host-out", "host.json"),
        ],
        [
            *("train", "--params", params, *overrides),
            *("-S", "data.init_args.path=dataset.safetensors"),
            *("--data", "dataset.safetensors", "--env", "environment.json"),
            *("--checkpoints", "ckpt", "--model", "model.safetensors"),
            *("--trace", "trace.safetensors", "--metrics", "metrics.json"),
            *("--plots", "plots", "--run-record", "run.json"),
        ],
    ]
    for step in steps:
        done = subprocess.run(
            [*python, "-m", "reprotrain", *step],
            cwd=out,
            env=cli_env(**env),
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert done.returncode == 0, f"{step[0]}: {done.stderr[-2000:]}"
    files = ("dataset.safetensors", "model.safetensors", "trace.safetensors", "environment.json")
    return {name: _sha256(out / name) for name in files}


def _host(out: Path) -> dict[str, str]:
    return json.loads((out / "host.json").read_text())


@pytest.fixture(scope="module")
def here(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    out = tmp_path_factory.mktemp("here") / "run"
    return out, _train([sys.executable], out)


def _version_of(python: str) -> str | None:
    """``X.Y.Z`` of an interpreter that can make a venv, else None."""
    code = "import sys, venv, ensurepip; print('%d.%d.%d' % sys.version_info[:3])"
    try:
        done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    except OSError:
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _other_patch_level() -> str | None:
    """A Python of this minor at another patch level: on PATH, pyenv's, the distribution's."""
    pyenv = os.environ.get("PYENV_ROOT") or str(Path.home() / ".pyenv")
    candidates = [
        *(str(Path(d) / f"python{MINOR}") for d in os.environ.get("PATH", "").split(os.pathsep)),
        f"/usr/bin/python{MINOR}",
        *map(str, sorted(Path(pyenv).glob(f"versions/{MINOR}.*/bin/python{MINOR}"))),
    ]
    for python in candidates:
        version = _version_of(python)
        if version and version.startswith(f"{MINOR}.") and version != PATCH:
            return python
    return None


def _install_distribution_python() -> None:
    """The distribution's Python of this minor, with venv (Debian bookworm: 3.11.2), as root."""
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, check=False)
    packages = [f"python{MINOR}", f"python{MINOR}-venv"]
    subprocess.run(
        ["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages],
        env=env,
        capture_output=True,
        check=False,
    )


def _venv_from_lock(python: str, version: str) -> Path:
    """A venv of ``python`` with the CPU lock installed (hash-checked), cached by version+lock."""
    venv = CACHE / f"venv-{version}-{_sha256(LOCK)[:12]}"
    stamp = venv / ".installed"
    if stamp.is_file():
        return venv
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([python, "-m", "venv", str(venv)], check=True, capture_output=True)
    vpython = str(venv / "bin" / "python")
    extra = subprocess.run(
        [str(ROOT / "tools" / "torch-index"), vpython, str(LOCK)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    install = subprocess.run(
        [vpython, "-m", "pip", "install", "--require-hashes", "--no-deps", *extra, "-r", str(LOCK)],
        capture_output=True,
        text=True,
    )
    assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-2000:]
    stamp.touch()
    return venv


@pytest.mark.slow
def test_another_python_patch_level_trains_the_same_bits(
    here: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    python = _other_patch_level()
    if python is None:
        _install_distribution_python()
        python = _other_patch_level()
    if python is None:
        pytest.skip(
            f"no second Python {MINOR} patch level here (this is {PATCH}; none on PATH, in "
            f"pyenv, or from apt-get install python{MINOR}-venv)"
        )
    version = _version_of(python)
    venv = _venv_from_lock(python, str(version))
    out = tmp_path / "other"
    # this checkout's code, not an installed copy: the same files the run ID hashes
    other = _train([str(venv / "bin" / "python")], out, PYTHONPATH=str(ROOT / "src"))
    assert _host(out)["python"] == version != _host(here[0])["python"]
    assert other == here[1]  # data, weights, trace and the deciding record: the same bytes
    # negative control: the comparison sees a difference where there is one
    seeded = _train([sys.executable], tmp_path / "seed7", "-S", "seed=7")
    assert seeded["model.safetensors"] != here[1]["model.safetensors"]


def _glibc_241() -> Path:
    """Debian 13's libc6 unpacked under the cache; its lib folder (holds the loader)."""
    root = CACHE / "glibc-trixie"
    lib = root / "root" / "usr" / "lib" / "x86_64-linux-gnu"
    if (lib / "ld-linux-x86-64.so.2").is_file():
        return lib
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        pytest.skip("fetching Debian 13's libc6 needs apt-get and dpkg-deb (a Debian host)")
    if not Path("/usr/share/keyrings/debian-archive-keyring.gpg").is_file():
        pytest.skip("Debian's archive keyring is not here (package debian-archive-keyring)")
    if platform.machine() != "x86_64":
        pytest.skip(f"the glibc test fetches amd64's libc6; this is {platform.machine()}")
    for sub in ("lists/partial", "cache/archives/partial"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    (root / "trixie.sources").write_text(TRIXIE)
    apt = [
        "apt-get",
        *("-o", f"Dir::Etc::SourceList={root / 'trixie.sources'}"),
        *("-o", "Dir::Etc::SourceParts=/dev/null", "-o", f"Dir::State::Lists={root / 'lists'}"),
        *("-o", f"Dir::Cache={root / 'cache'}"),
    ]
    for step in (["update", "-q"], ["download", "libc6"]):
        done = subprocess.run([*apt, *step], cwd=root, capture_output=True, text=True)
        assert done.returncode == 0, f"apt-get {step[0]}: {done.stderr[-1500:]}"
    (deb,) = root.glob("libc6_*.deb")
    subprocess.run(["dpkg-deb", "-x", str(deb), str(root / "root")], check=True)
    return lib


@pytest.mark.slow
def test_glibc_241_trains_the_same_bits_as_this_hosts(
    here: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    lib = _glibc_241()
    # this Python's own libpython first (a shared build, as pyenv's), then the system's libs
    own = (
        [sysconfig.get_config_var("LIBDIR")] if sysconfig.get_config_var("Py_ENABLE_SHARED") else []
    )
    library_path = ":".join([str(lib), *own, "/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu"])
    loader = [str(lib / "ld-linux-x86-64.so.2"), "--library-path", library_path]
    # the unresolved venv path (resolved, the venv is lost); the profile's pins set before,
    # so reprotrain does not restart itself through sys.executable, out of this loader
    params = load_params(ROOT / "params.yaml")
    pins = {**params.cpu.to_profile().variables(), "PYTHONHASHSEED": "0"}
    out = tmp_path / "glibc241"
    other = _train([*loader, sys.executable], out, **pins)
    assert _host(out)["libc"] == "glibc-2.41" != _host(here[0])["libc"]
    assert _host(out)["python"] == PATCH  # the same interpreter, only glibc changed
    assert other == here[1]


def test_checklist_and_compare_still_show_the_patch_level(tmp_path: Path) -> None:
    from reprotrain.commands._rundiff import _with_host
    from reprotrain.commands.checklist import _host_item

    item = _host_item(whole_environment(LOCK), {"python": "3.11.2", "libc": "glibc-2.41"})
    assert item.status == "pass" and f"Python {PATCH}" in item.detail
    assert "python 3.11.2 -> " in item.detail or PATCH == "3.11.2"
    (tmp_path / "environment.json").write_text(json.dumps(record_environment(LOCK)))
    (tmp_path / "host.json").write_text(json.dumps({"python": "3.11.2"}))
    assert _with_host(tmp_path / "environment.json")["host"] == {"python": "3.11.2"}
