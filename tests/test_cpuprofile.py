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

from reprotrain.cpu.profile import CpuProfile, host_cpu_flags
from reprotrain.hashing import load_safetensors, sha256_file, sha256_state_dict
from reprotrain.provenance.environment import (
    DECIDING_CPU_FIELDS,
    bit_deciding,
    capture_environment,
)
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
NO_FMA = {**FAKE_CPU, "REPROTRAIN_TEST_CPU": "no-fma"}


def _train(prepared: Path, env: Path, out: Path, *extra: str, **variables: str) -> tuple:
    """Fingerprints of the trained weights and of the per-step trace's tensors.

    Tensors, not file bytes: the files' metadata records the determinism mode, and the
    runs that emulate another CPU must use deterministic: warn.
    """
    result = run_cli(*train_argv(prepared, env, out, *SHORT, *extra), cwd=out.parent, **variables)
    assert result.returncode == 0, result.stderr
    files = (out / "model.safetensors", out / "trace.safetensors")
    return tuple(sha256_state_dict(load_safetensors(f)[0]) for f in files)


def _threads(out: Path) -> tuple[int, int]:
    """ATen's intra-op and inter-op threads in a training run (its run.json)."""
    runtime = json.loads((out / "run.json").read_text())["inputs"]["torch_runtime"]
    return runtime["num_threads"], runtime["num_interop_threads"]


#: A training run's files whose md5 dvc.lock holds.
TRACKED = ("model.safetensors", "trace.safetensors", "metrics.json", "run.json")
#: The runs at cpu.threads: 2, by their folder.
TWO = {"portable, 2 threads": "p2", "native, 2 threads": "n2"}


@pytest.fixture(scope="module")
def runs(prepared: Path, env_record: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = tmp_path_factory.mktemp("profiles")
    warn = ("--deterministic", "warn")
    native = ("-S", "cpu.profile=native")
    two = ("-S", "cpu.threads=2")
    out = {
        "portable": _train(prepared, env_record, work / "p"),
        "portable, old CPU": _train(
            prepared, env_record, work / "p-old", *warn, **OLD_CPU, **OLD_ATEN
        ),
        "portable, AVX-512 asked": _train(prepared, env_record, work / "p-new", *warn, **NEW_CPU),
        "native": _train(prepared, env_record, work / "n", *native),
        "native, old oneDNN": _train(prepared, env_record, work / "n-old", *native, **OLD_CPU),
        "native, old ATen": _train(prepared, env_record, work / "n-aten", *native, **OLD_ATEN),
        # cpu.threads: 2 (make test exports OMP_NUM_THREADS=1, which native at 2 contradicts)
        "portable, 2 threads": _train(prepared, env_record, work / "p2", *two),
        "native, 2 threads": _train(
            prepared, env_record, work / "n2", *native, *two, OMP_NUM_THREADS="2"
        ),
    }
    out["threads"] = {name: _threads(work / folder) for name, folder in TWO.items()}
    out["bytes"] = {
        folder: tuple(sha256_file(work / folder / f) for f in TRACKED) for folder in ("p", "p2")
    }
    return out


def test_portable_gives_the_same_bits_whatever_the_cpu_dispatches(runs: dict) -> None:
    assert runs["portable, old CPU"] == runs["portable"]
    assert runs["portable, AVX-512 asked"] == runs["portable"]


def test_native_follows_the_cpu_dispatch(runs: dict) -> None:
    """Negative control: the same capping changes the bits when nothing pins the kernels."""
    assert runs["native, old oneDNN"] != runs["native"]
    assert runs["native, old ATen"] != runs["native"]
    assert runs["native"] != runs["portable"]


def test_portable_gives_the_same_bits_at_any_thread_count(runs: dict) -> None:
    """cpu.threads under portable: the GEMM's threads share fixed blocks; ATen runs on one."""
    assert runs["portable, 2 threads"] == runs["portable"]
    assert runs["threads"]["portable, 2 threads"] == (1, 1)  # ATen's intra-op, inter-op
    # and it moves no tracked byte: the files DVC hashes are the same bytes
    assert runs["bytes"]["p2"] == runs["bytes"]["p"]


def test_native_at_two_threads_trains_other_bits_than_at_one(runs: dict) -> None:
    """Negative control: native's threads are ATen's, and its reductions split by them."""
    assert runs["threads"]["native, 2 threads"] == (2, 1)
    assert runs["native, 2 threads"] != runs["native"]


def test_the_thread_count_leaves_the_record_only_under_portable() -> None:
    one, two = CpuProfile("portable", 1), CpuProfile("portable", 2)
    assert one.record() == two.record() and "threads" not in two.record()
    assert two.variables()["OMP_NUM_THREADS"] == two.variables()["MKL_NUM_THREADS"] == "1"
    native = CpuProfile("native", 2)
    assert native.record()["threads"] == 2 and native.variables()["OMP_NUM_THREADS"] == "2"
    assert native.record() != CpuProfile("native", 1).record()


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


def test_which_cpu_facts_decide_the_bits_under_each_profile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under portable no fact of the host CPU is in the key, its vendor neither (an Intel
    Xeon and AMD EPYCs trained the same bits: docs/cpu/); under native, and with no
    profile, they are; each fact of another CPU moves exactly the keys it decides."""
    import reprotrain.cpu.profile as cpuprofile
    import reprotrain.provenance.environment as environment

    profiles = {"portable": CpuProfile("portable"), "native": CpuProfile("native"), "none": None}

    def keys() -> dict:
        return {
            name: bit_deciding(capture_environment(LOCK, cpu_profile=profile))
            for name, profile in profiles.items()
        }

    here, facts = keys(), environment.cpu_facts()
    whole = capture_environment(LOCK, cpu_profile=CpuProfile("portable"))
    assert whole["host"]["cpu"] == facts  # every fact still recorded, as information
    assert {"vendor", "model", "dispatch_flags", "usable_cpus"}.isdisjoint(whole["cpu"])
    other = {
        "vendor": "AuthenticAMD" if facts["vendor"] == "GenuineIntel" else "GenuineIntel",
        "model": "Another CPU",
        "dispatch_flags": ["avx2", "fma", "avx512f"],
        "usable_cpus": facts["usable_cpus"] + 62,
    }
    assert DECIDING_CPU_FIELDS["portable"] == ()
    for field, value in other.items():
        monkeypatch.setattr(environment, "cpu_facts", lambda f=field, v=value: {**facts, f: v})
        there = keys()
        for name in profiles:
            decides = field in DECIDING_CPU_FIELDS[name]
            assert (there[name] != here[name]) == decides, (field, name)
            assert there[name]["cpu"].get(field, value) == value, (field, name)
    # negative control: what does decide the bits under portable still moves its key
    monkeypatch.setattr(environment, "cpu_facts", lambda: facts)
    monkeypatch.setattr(cpuprofile, "openblas_version", lambda: "0.3.99")
    assert keys()["portable"] != here["portable"]


def test_dvc_repro_on_another_cpu_family_is_a_cache_hit(repo_copy: Path) -> None:
    out = run_checked("dvc", "repro", cwd=repo_copy, **FAKE_CPU)
    assert "Running stage 'env'" in out
    assert "Running stage 'train'" not in out and "Running stage 'prepare'" not in out
    assert run_checked("git", "status", "--porcelain", cwd=repo_copy) == ""
    host = json.loads((repo_copy / "reports" / "host.json").read_text())
    assert host["cpu"]["model"].startswith("Intel")
    # Under portable cpu.threads decides the speed alone: another count is a cache hit too,
    # and moves no tracked byte but the user's own edit of params.yaml.
    params = repo_copy / "params.yaml"
    assert params.read_text().count("  threads: 1\n") == 1
    params.write_text(params.read_text().replace("  threads: 1\n", "  threads: 2\n"))
    out = run_checked("dvc", "repro", cwd=repo_copy)
    assert "Running stage 'train'" not in out and "Running stage 'prepare'" not in out
    changed = run_checked("git", "status", "--porcelain", cwd=repo_copy).split()
    assert changed[1::2] == ["params.yaml"], changed
    # negative control: a setting that decides the bits moves dvc.lock (and retrains)
    native = params.read_text().replace("  profile: portable\n", "  profile: native\n")
    params.write_text(native.replace("  threads: 2\n", "  threads: 1\n"))
    out = run_checked("dvc", "repro", "env", cwd=repo_copy)
    changed = run_checked("git", "status", "--porcelain", cwd=repo_copy).split()
    assert "dvc.lock" in changed and "reports/environment.json" in changed, changed


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


def test_a_cublas_setting_that_is_not_deterministic_is_refused_by_the_first_stage(
    tmp_path: Path,
) -> None:
    out = tmp_path / "environment.json"
    refused = run_cli("env", "--lock", LOCK, "--out", out, cwd=ROOT,
                      CUBLAS_WORKSPACE_CONFIG="garbage")  # fmt: skip
    assert refused.returncode == 3
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "CUBLAS_WORKSPACE_CONFIG=garbage" in lines[0], lines
    assert not out.exists()
    # Control: a deterministic value passes.
    done = run_cli("env", "--lock", LOCK, "--out", out, cwd=ROOT, CUBLAS_WORKSPACE_CONFIG=":16:8")
    assert done.returncode == 0, done.stderr


def test_a_cpu_without_avx2_or_fma_is_named_with_the_way_out() -> None:
    portable = CpuProfile("portable")
    assert portable.unsupported_here({"avx2", "fma", "sse4_2"}) is None
    line = portable.unsupported_here({"avx", "sse4_2"})
    assert line is not None and "\n" not in line
    assert "lacks AVX2, FMA" in line and "cpu.profile: native" in line
    assert "lacks FMA (" in (portable.unsupported_here({"avx2"}) or "")
    assert CpuProfile("native").unsupported_here(frozenset()) is None  # its own kernels
    assert "fma" in host_cpu_flags()  # this CPU (the suite needs AVX2 and FMA itself)


def test_configure_determinism_refuses_such_a_cpu_and_routes_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import reprotrain.cpu.profile as cpuprofile
    from reprotrain.cpu import kernels as portable_kernels

    monkeypatch.setattr(cpuprofile, "host_cpu_flags", lambda: frozenset({"avx", "avx2"}))
    problems = CpuProfile("portable").apply()
    try:
        assert [p for p in problems if "lacks FMA" in p], problems
        assert portable_kernels._state["library"] is None  # no pinned OpenBLAS call: no SIGILL
    finally:
        monkeypatch.undo()
        CpuProfile("native").apply()


def test_the_env_stage_and_run_refuse_such_a_cpu_before_anything_is_written(
    tmp_path: Path,
) -> None:
    out = tmp_path / "environment.json"
    refused = run_cli("env", "--lock", LOCK, "--out", out, cwd=ROOT, **NO_FMA)
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 1, refused.stderr
    assert "lacks FMA" in lines[0] and "set cpu.profile: native" in lines[0]
    assert not out.exists()
    mark = tmp_path / "started"
    started = run_cli(
        "run", "--cpu-profile", "portable", "--", "touch", mark, cwd=tmp_path, **NO_FMA
    )
    assert started.returncode == 2 and "use --cpu-profile native" in started.stderr
    assert not mark.exists()
    # control: the same CPU under native, and this CPU's own flags, pass
    ran = run_cli("run", "--cpu-profile", "native", "--", "touch", mark, cwd=tmp_path, **NO_FMA)
    assert ran.returncode == 0 and mark.exists(), ran.stderr
    assert run_cli("env", "--lock", LOCK, "--out", out, cwd=ROOT).returncode == 0


def test_every_cpu_recorded_since_sqrt_was_routed_trained_the_same_bits() -> None:
    """docs/cpu/<host>/: each host's side of both recipes (benchmarks/cpu/vendor_side.sh). Those
    made with sqrt routed (a kernel digest in host.json) hold one set of bits across Intel
    and AMD, AVX2 and AVX-512; the older amd-zen4 side (sqrt through MKL) is the control."""
    sides = {p.parent.name: p.parent for p in (ROOT / "docs" / "cpu").glob("*/host.json")}
    hosts = {name: json.loads((side / "host.json").read_text()) for name, side in sides.items()}
    routed = {name: host for name, host in hosts.items() if "kernel_bits_all_rows" in host}
    assert {"intel-xeon", "amd-zen3", "amd-zen5"} <= set(routed)
    assert {host["cpu"]["vendor_id"] for host in routed.values()} == {
        "GenuineIntel",
        "AuthenticAMD",
    }
    assert len({host["kernel_bits_all_rows"] for host in routed.values()}) == 1
    weights = {json.dumps(host["weights_sha256_state_dict"]) for host in routed.values()}
    assert len(weights) == 1
    for recipe in ("digits", "lm"):
        traces = {
            sha256_state_dict(load_safetensors(sides[name] / f"{recipe}-trace.safetensors")[0])
            for name in routed
        }
        assert len(traces) == 1, recipe
    assert json.dumps(hosts["amd-zen4"]["weights_sha256_state_dict"]) not in weights
