"""The CPU profile: under `portable` the bits do not follow the CPU's instruction set.

Older or newer CPUs are emulated on this one by capping what each library dispatches
to (ONEDNN_MAX_CPU_ISA, MKL_ENABLE_INSTRUCTIONS, ATEN_CPU_CAPABILITY): under `portable`
the trained bytes stay the same, under `native` the same capping changes them
(negative control). A host of another CPU family is faked for the environment record
(tests/inject): under `portable` it is a DVC cache hit.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from reprotrain.cpuprofile import CpuProfile
from reprotrain.hashing import load_safetensors, sha256_state_dict
from reprotrain.provenance.environment import bit_deciding, capture_environment
from tests.helpers import ROOT, run_checked, run_cli, run_in_process, train_argv

LOCK = ROOT / "requirements-cpu.lock"
SHORT = ("-S", "train.max_epochs=1", "-S", "data.init_args.num_workers=0")
#: A CPU of about 2010 (SSE4.2, no AVX) as each library would see it; ATen's variable
#: contradicts the profile, so those runs use deterministic: warn (the profile wins).
OLD_CPU = {"ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}
OLD_ATEN = {"ATEN_CPU_CAPABILITY": "default"}
#: An AVX-512 host as the libraries would pick it (capped to what this CPU has).
NEW_CPU = {
    "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
    "MKL_ENABLE_INSTRUCTIONS": "AVX512",
    "ATEN_CPU_CAPABILITY": "avx512",
}
FAKE_CPU = {"PYTHONPATH": str(ROOT / "tests" / "inject"), "REPROTRAIN_TEST_CPU": "xeon-avx512"}


def _train(prepared: Path, env: Path, out: Path, *extra: str, **variables: str) -> tuple:
    """Fingerprints of the trained weights and of the per-step trace's tensors.

    Tensors, not file bytes: the files' metadata records the determinism mode, and the
    runs that emulate another CPU must use deterministic: warn.
    """
    result = run_cli(*train_argv(prepared, env, out, *SHORT, *extra), cwd=out.parent, **variables)
    assert result.returncode == 0, result.stderr
    files = (out / "model.safetensors", out / "trace.safetensors")
    return tuple(sha256_state_dict(load_safetensors(f)[0]) for f in files)


@pytest.fixture(scope="module")
def runs(prepared: Path, env_record: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = tmp_path_factory.mktemp("profiles")
    warn = ("--deterministic", "warn")
    native = ("-S", "cpu.profile=native")
    return {
        "portable": _train(prepared, env_record, work / "p"),
        "portable, old CPU": _train(
            prepared, env_record, work / "p-old", *warn, **OLD_CPU, **OLD_ATEN
        ),
        "portable, AVX-512 asked": _train(prepared, env_record, work / "p-new", *warn, **NEW_CPU),
        "native": _train(prepared, env_record, work / "n", *native),
        "native, old oneDNN": _train(prepared, env_record, work / "n-old", *native, **OLD_CPU),
        "native, old ATen": _train(prepared, env_record, work / "n-aten", *native, **OLD_ATEN),
    }


def test_portable_gives_the_same_bits_whatever_the_cpu_dispatches(runs: dict) -> None:
    assert runs["portable, old CPU"] == runs["portable"]
    assert runs["portable, AVX-512 asked"] == runs["portable"]


def test_native_follows_the_cpu_dispatch(runs: dict) -> None:
    """Negative control: the same capping changes the bits when nothing pins the kernels."""
    assert runs["native, old oneDNN"] != runs["native"]
    assert runs["native, old ATen"] != runs["native"]
    assert runs["native"] != runs["portable"]


def test_the_thread_count_reaches_the_training_process(
    prepared: Path, env_record: Path, tmp_path: Path
) -> None:
    out = tmp_path / "t2"
    _train(prepared, env_record, out, "-S", "cpu.threads=2", OMP_NUM_THREADS="2")
    runtime = json.loads((out / "run.json").read_text())["inputs"]["torch_runtime"]
    assert (runtime["num_threads"], runtime["num_interop_threads"]) == (2, 1)
    assert runtime["cpu_capability"] == "AVX2"


def test_openmp_sleeps_between_regions_only_under_portable_above_one_thread() -> None:
    paced = CpuProfile("portable", 2)
    assert paced.pacing() == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert not CpuProfile("portable", 1).pacing() and not CpuProfile("native", 2).pacing()
    # speed alone: never a pin (so an exported value is no contradiction) nor in the record
    assert "OMP_WAIT_POLICY" not in {**paced.variables(), **paced.record()["pins"]}
    assert not paced.contradictions({"OMP_WAIT_POLICY": "ACTIVE", "OMP_NUM_THREADS": "2"})


def test_a_contradicting_variable_is_refused_with_one_line(tmp_path: Path) -> None:
    out = tmp_path / "environment.json"
    refused = run_cli("env", "--lock", LOCK, "--out", out, cwd=ROOT, ATEN_CPU_CAPABILITY="avx512")
    assert refused.returncode == 3
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "ATEN_CPU_CAPABILITY=avx512" in lines[0]
    assert "cpu.profile" in lines[0] and "unset" in lines[0]
    assert not out.exists()
    warn = tmp_path / "params.yaml"
    warn.write_text(
        (ROOT / "params.yaml").read_text().replace("deterministic: true", "deterministic: warn")
    )
    warned = run_cli(
        "env",
        "--lock",
        LOCK,
        "--params",
        warn,
        "--out",
        out,
        cwd=ROOT,
        ATEN_CPU_CAPABILITY="avx512",
    )
    assert warned.returncode == 0 and "warning" in warned.stderr
    assert json.loads(out.read_text())["variables"]["ATEN_CPU_CAPABILITY"] == "avx2"


@pytest.mark.parametrize(
    ("override", "key"), [("cpu.profile=fast", "cpu.profile"), ("cpu.threads=0", "cpu.threads")]
)
def test_bad_profile_params_name_the_key(override: str, key: str) -> None:
    result = run_in_process("params", "--params", ROOT / "params.yaml", "-S", override)
    assert result.returncode == 2 and key in result.stderr
    with pytest.raises(ValueError, match="CPU"):
        CpuProfile(*(("fast", 1) if key == "cpu.profile" else ("portable", 0)))


def test_another_cpu_model_of_the_vendor_leaves_the_key_alone_only_under_portable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import reprotrain.provenance.environment as environment

    here = {
        p: bit_deciding(capture_environment(LOCK, cpu_profile=CpuProfile(p)))
        for p in ("portable", "native")
    }
    whole = capture_environment(LOCK, cpu_profile=CpuProfile("portable"))
    assert "model" not in whole["cpu"] and whole["host"]["cpu"]["model"]
    assert "kernel" not in whole["os"] and whole["host"]["kernel"]
    vendor = whole["cpu"]["vendor"]
    other = {"model": "Xeon", "dispatch_flags": ["avx2", "avx512f"], "usable_cpus": 64}
    monkeypatch.setattr(environment, "cpu_facts", lambda: {**other, "vendor": vendor})
    there = {p: bit_deciding(capture_environment(LOCK, cpu_profile=CpuProfile(p))) for p in here}
    assert there["portable"] == here["portable"]
    assert there["native"] != here["native"]
    # Another vendor: an Intel Xeon trained other bits than AMD EPYCs under portable.
    monkeypatch.setattr(environment, "cpu_facts", lambda: {**other, "vendor": vendor + "-other"})
    elsewhere = bit_deciding(capture_environment(LOCK, cpu_profile=CpuProfile("portable")))
    assert elsewhere != here["portable"] and elsewhere["cpu"]["vendor"] == vendor + "-other"


def test_dvc_repro_on_another_cpu_family_is_a_cache_hit(repo_copy: Path) -> None:
    out = run_checked("dvc", "repro", cwd=repo_copy, **FAKE_CPU)
    assert "Running stage 'env'" in out
    assert "Running stage 'train'" not in out and "Running stage 'prepare'" not in out
    assert run_checked("git", "status", "--porcelain", cwd=repo_copy) == ""
    host = json.loads((repo_copy / "reports" / "host.json").read_text())
    assert host["cpu"]["model"].startswith("Intel")


_EMULATION_PROBE = """
import os, subprocess, sys
os.environ.pop("REPROTRAIN_TEST_ATEN_LEVEL", None)
if sys.argv[1:]:
    os.environ["REPROTRAIN_TEST_ATEN_LEVEL"] = sys.argv[1]
import tests.conftest  # what every pytest process of the suite imports first
import torch
child = "import torch; print(torch.backends.cpu.get_cpu_capability())"
started = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True)
print(torch.backends.cpu.get_cpu_capability(), "ATEN_CPU_CAPABILITY" in os.environ,
      started.stdout.strip())
"""


def test_the_emulated_aten_level_holds_in_pytest_processes_only() -> None:
    """`make test`: this process at another level, what it starts at the host's."""
    probe = (sys.executable, "-c", _EMULATION_PROBE)
    host = run_checked(*probe, cwd=ROOT, PYTHONPATH=str(ROOT)).split()
    assert host[0] != "DEFAULT" and host[1] == "False" and host[2] == host[0]
    emulated = run_checked(*probe, "default", cwd=ROOT, PYTHONPATH=str(ROOT)).split()
    assert emulated == ["DEFAULT", "False", host[0]]
