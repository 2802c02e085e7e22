"""The environment that decides the bits, as a record whose bytes change only when it does.

DVC hashes data, code and params but not the machine. :func:`capture_environment`
records what does decide a run's floating-point results: Python; torch and the
CUDA, cuDNN, cuBLAS and NCCL builds it runs on; GPU models, compute capability
and driver; the CPU profile and its pins (:mod:`reprotrain.cpu.profile`), or
under ``native`` the CPU model and the instruction-set features ATen's kernels
dispatch on; the variables that fix thread counts and determinism; the OS;
the lock file's sha256 and whether the installed packages match it
exactly; the container image. Host facts that do not decide the bits sit
apart in its ``host`` section: the CPU model and flags under ``portable``,
core count, memory, kernel, and, shown by ``tests/test_portability.py`` to
leave the default recipe's bits alone, Python's patch level (3.11.2 vs
3.11.7) and the glibc version (2.36 vs 2.41). Python's major.minor stays in
the deciding part (nothing showed it may leave). :func:`bit_deciding` drops
the ``host`` section, and only the rest is a cache key. No time, host name,
PID or absolute path anywhere, so :func:`canonical_json` of the deciding part
is byte-stable and a DVC stage that writes it retrains downstream exactly
when it changes.

It never imports torch (that alone costs more than a second): versions come
from package metadata and ``torch/version.py``, GPUs from ``nvidia-smi``.
Facts only a running torch knows (its thread pools, TF32 switches) are
recorded by the training process itself, see ``torch_runtime``.

Git state is deliberately *not* here: a commit that only touches the README
must not evict the cache. :func:`git_state` reports it for run records.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

from reprotrain.cpu.profile import NEUTRALISED, CpuProfile, host_cpu_flags
from reprotrain.hashing import canonical_json, sha256_file

#: CPU flags that change which SIMD kernels ATen and oneDNN pick.
DISPATCH_FLAGS = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512dq",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)
#: Variables that change kernels, reduction order or thread counts.
SHAPING_VARIABLES = (
    "ATEN_CPU_CAPABILITY",
    "CUBLAS_WORKSPACE_CONFIG",
    "CUDA_LAUNCH_BLOCKING",
    "MKL_CBWR",
    "MKL_ENABLE_INSTRUCTIONS",
    "MKL_NUM_THREADS",
    "NCCL_ALGO",
    "NCCL_PROTO",
    "NVIDIA_TF32_OVERRIDE",
    "OMP_NUM_THREADS",
    "ONEDNN_MAX_CPU_ISA",
    "PYTHONHASHSEED",
    "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE",
)
#: The host CPU's facts (:func:`cpu_facts`) that decide the bits, by CPU profile ("none":
#: no profile). Under ``portable`` none do: the pins and routed kernels give every x86-64
#: CPU with AVX2 and FMA the same bits (tests/test_cpuprofile.py holds this rule).
DECIDING_CPU_FIELDS: dict[str, tuple[str, ...]] = {
    "portable": (),
    "native": ("vendor", "model", "dispatch_flags"),
    "none": ("vendor", "model", "dispatch_flags", "usable_cpus"),
}
#: The record's informational section: host facts that do not decide the bits.
HOST_KEY = "host"
#: Where the host section is written beside the deciding record (``env --host-out``).
HOST_FILE = "host.json"
#: Collective-communication settings: every set ``NCCL_*`` variable but these, which only log.
COLLECTIVE_PREFIX = "NCCL_"
COLLECTIVE_LOGGING = frozenset({"NCCL_DEBUG", "NCCL_DEBUG_FILE", "NCCL_DEBUG_SUBSYS"})
#: Set in the container image (Dockerfile) and by `make docker-repro`.
IMAGE_DIGEST_VARIABLE = "REPROTRAIN_BASE_IMAGE"
IMAGE_ID_VARIABLE = "REPROTRAIN_IMAGE_ID"
_CUDA_PACKAGES = {
    "cudnn": ("nvidia-cudnn-cu13", "nvidia-cudnn-cu12"),
    "cublas": ("nvidia-cublas", "nvidia-cublas-cu12"),
    "nccl": ("nvidia-nccl-cu13", "nvidia-nccl-cu12"),
}


def capture_environment(
    lock: str | Path | None,
    ignore_packages: Iterable[str] = (),
    cpu_profile: CpuProfile | None = None,
) -> dict[str, Any]:
    """The environment record; ``lock`` is the requirements lock this install should match.

    Everything but the ``host`` section decides the bits (:func:`bit_deciding`
    returns it). Under a ``portable`` :class:`~reprotrain.cpu.profile.CpuProfile`
    the CPU's vendor, model and flags are only informational: the profile's pins
    and routed kernels decide the bits instead, on any x86-64 CPU with AVX2 and FMA
    (an Intel Xeon, an AMD EPYC Zen 3 and a Zen 5 trained both recipes to the same
    bits: docs/cpu-profile.md, ``benchmarks/cpu/vendor_check.sh``). Under ``native`` the
    vendor, model and flags decide, and without a profile the usable CPU count does
    too (torch's default thread count follows it): :data:`DECIDING_CPU_FIELDS`.
    """
    cpu = cpu_facts()
    variables = {
        **{name: os.environ.get(name) for name in SHAPING_VARIABLES},
        **collective_variables(),
    }
    # Under portable these no longer change the kernels (oneDNN off, MKL's one code path).
    neutralised = NEUTRALISED if cpu_profile is not None and cpu_profile.portable else ()
    host_variables = {name: variables.pop(name) for name in neutralised}
    profile = "none" if cpu_profile is None else cpu_profile.name
    deciding_cpu = {
        **({} if cpu_profile is None else cpu_profile.record()),
        **{key: cpu[key] for key in DECIDING_CPU_FIELDS[profile]},
    }
    return {
        "python": {"minor": _python_minor(), "implementation": sys.implementation.name},
        "torch": _torch_build(),
        "gpu": _gpus(),
        "cpu": deciding_cpu,
        "os": {"system": platform.system(), "machine": platform.machine()},
        "variables": variables,
        "lock": lock_status(lock, ignore_packages) if lock else None,
        "container": {
            "base_image": os.environ.get(IMAGE_DIGEST_VARIABLE, "none"),
            "image_id": os.environ.get(IMAGE_ID_VARIABLE, "none"),
        },
        HOST_KEY: {
            "cpu": cpu,
            "python": platform.python_version(),
            "libc": "-".join(platform.libc_ver()),
            "kernel": platform.release(),
            "memory_gib": _memory_gib(),
            "variables": host_variables,
        },
    }


def _python_minor() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def bit_deciding(record: Mapping[str, Any]) -> dict[str, Any]:
    """The record without its informational ``host`` section: the cache key's part."""
    return {key: value for key, value in record.items() if key != HOST_KEY}


def _memory_gib() -> float | None:
    try:
        text = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    found = re.search(r"^MemTotal:\s*(\d+) kB", text, re.M)
    return round(int(found.group(1)) / 2**20, 1) if found else None


def collective_variables(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The ``NCCL_*`` variables that are set (algorithm, protocol, channels, transports...)."""
    return {
        name: value
        for name, value in sorted(environ.items())
        if name.startswith(COLLECTIVE_PREFIX) and name not in COLLECTIVE_LOGGING
    }


def environment_sha256(record: Mapping[str, Any]) -> str:
    """sha256 of the record's canonical JSON."""
    return hashlib.sha256(canonical_json(dict(record)).encode()).hexdigest()


def _version(*names: str) -> str | None:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _torch_build() -> dict[str, Any]:
    build: dict[str, Any] = {"version": _version("torch"), "cuda": None, "git": None}
    try:
        text = Path(metadata.distribution("torch").locate_file("torch/version.py")).read_text()
    except (metadata.PackageNotFoundError, OSError):
        text = ""
    for key, name in (("cuda", "cuda"), ("git", "git_version")):
        found = re.search(rf"^{name}\b.*?=\s*'([^']*)'", text, re.M)
        build[key] = found.group(1) if found else None
    for library, packages in _CUDA_PACKAGES.items():
        build[library] = _version(*packages)
    return build


def _gpus() -> list[dict[str, str]]:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    query = "--query-gpu=name,compute_cap,driver_version,memory.total"
    try:
        out = subprocess.run(
            [smi, query, "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError) as err:
        return [{"error": f"nvidia-smi failed: {err}"}]
    keys = ("name", "compute_capability", "driver", "memory")
    return [
        dict(zip(keys, (f.strip() for f in line.split(",")), strict=False))
        for line in out.splitlines()
        if line.strip()
    ]


def cpu_facts() -> dict[str, Any]:
    """This CPU's vendor and model name, its dispatch-relevant flags, and the CPUs usable here."""
    model, vendor = platform.processor() or "unknown", "unknown"
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    if found := re.search(r"^model name\s*:\s*(.+)$", text, re.M):
        model = found.group(1).strip()
    if found := re.search(r"^vendor_id\s*:\s*(.+)$", text, re.M):
        vendor = found.group(1).strip()
    flags = host_cpu_flags()
    return {
        "vendor": vendor,
        "model": model,
        "dispatch_flags": [flag for flag in DISPATCH_FLAGS if flag in flags],
        "usable_cpus": len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
    }


def _canonical_name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock_pins(lock: str | Path) -> dict[str, str]:
    """``{canonical name: version}`` for every ``name==version`` line of a pip lock."""
    pins = {}
    for line in Path(lock).read_text().splitlines():
        if found := re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)", line):
            pins[_canonical_name(found.group(1))] = found.group(2)
    return pins


def lock_status(lock: str | Path, ignore_packages: Iterable[str] = ()) -> dict[str, Any]:
    """The lock's sha256 and every difference between it and the installed packages."""
    pins = read_lock_pins(lock)
    ignored = {_canonical_name(name) for name in ignore_packages}
    installed = {
        _canonical_name(dist.metadata["Name"]): dist.version for dist in metadata.distributions()
    }
    drift = []
    for name in sorted(set(pins) | set(installed)):
        if name in ignored or pins.get(name) == installed.get(name):
            continue
        drift.append({"package": name, "locked": pins.get(name), "installed": installed.get(name)})
    return {
        "file": Path(lock).name,
        "sha256": sha256_file(lock),
        "exact": not drift,
        "drift": drift,
    }


def editable_packages(root: Path) -> list[str]:
    """Distributions installed editable (PEP 610) from a folder inside ``root``: a project's
    own package (``pip install -e .``), whose files the run ID hashes; ``pip freeze`` writes
    it as ``-e <folder>``, which pins no version, so it is no drift from the lock."""
    import json
    from urllib.parse import unquote, urlparse

    names = []
    for dist in metadata.distributions():
        try:
            info = json.loads(dist.read_text("direct_url.json") or "{}")
        except ValueError:
            continue
        if not isinstance(info, dict) or not (info.get("dir_info") or {}).get("editable"):
            continue
        url = str(info.get("url", ""))
        if not url.startswith("file://"):
            continue
        if Path(unquote(urlparse(url).path)).resolve().is_relative_to(root.resolve()):
            names.append(dist.metadata["Name"])
    return sorted(names)


def git_state(repo: str | Path, exclude: Iterable[str] = ()) -> dict[str, Any]:
    """``{"commit": sha or None, "dirty": bool or None}``; ``exclude`` are pathspecs to ignore."""

    def git(*args: str) -> str | None:
        try:
            return subprocess.run(
                ["git", *args], cwd=repo, capture_output=True, text=True, check=True, timeout=30
            ).stdout
        except (OSError, subprocess.SubprocessError):
            return None

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return {"commit": None, "dirty": None}
    status = git("status", "--porcelain", "--", ".", *(f":(exclude){p}" for p in exclude))
    return {"commit": commit.strip(), "dirty": bool(status and status.strip())}


def torch_runtime() -> dict[str, Any]:
    """What only a running torch knows and that shapes results; call it in the training process."""
    import torch

    return {
        "num_threads": torch.get_num_threads(),
        "num_interop_threads": torch.get_num_interop_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cuda_matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        "cudnn_enabled": torch.backends.cudnn.enabled,
        "cudnn_version": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
    }
