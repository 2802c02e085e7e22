"""Explain how two environment records differ, and which differences void bitwise equality.

Bitwise reproducibility holds only on the same GPU model, the same torch /
CUDA / cuDNN / cuBLAS / NCCL builds, the same CPU instruction set and the same
thread counts and determinism flags: those differences "void" the guarantee.
Others "may matter" (Python, numpy, driver, OS, the installed set) or are
provenance only; the environment record's ``host`` section is informational
(under ``cpu.profile: portable`` it holds the CPU model and flags, and always
Python's patch level and glibc, shown by tests not to change the bits). The
verdict comes from the small rule table ``ENV_RULES``, matched on whole words
of the dotted key, first match wins; extend it there. ``compare_inputs`` does
the same for two runs' input records (run.json ``inputs``): the keys that
differ are why two run IDs differ. No torch import: ``reprotrain env --diff``,
the checklist and a verify whose runs are identical stay fast.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "EnvDiff",
    "EnvRule",
    "InputDiff",
    "classify_env_key",
    "compare_environments",
    "compare_inputs",
    "flatten_record",
]

Verdict = Literal["voids", "may matter", "no"]


@dataclass(frozen=True)
class EnvRule:
    """Keys whose lowercase dotted name contains ``pattern`` as a whole word get ``verdict``."""

    pattern: str
    verdict: Verdict
    why: str


#: First match wins; unmatched keys are "no". Word boundaries are ".", "_", "-" and the ends.
ENV_RULES: tuple[EnvRule, ...] = (
    EnvRule(
        r"host\.python|host\.libc",
        "no",
        "informational: shown not to change the bits (tests/test_portability.py)",
    ),
    EnvRule(r"host", "no", "informational: not part of the cache key (docs/cpu-profile.md)"),
    EnvRule(r"gpus?|device_name|device_model", "voids", "GPU model changes kernels"),
    EnvRule(r"compute_capability|sm|arch_list|cuda_arch", "voids", "GPU architecture"),
    EnvRule(r"torch|pytorch", "voids", "torch build"),
    EnvRule(r"cuda|cudnn|cublas|nccl|cufft|curand|rocm|hip", "voids", "GPU library build"),
    EnvRule(r"cpu|isa|machine|avx\w*|amx\w*|mkl\w*|onednn|\w*blas", "voids", "CPU kernels"),
    EnvRule(r"threads|num_threads|omp_num_threads|interop_threads", "voids", "reduction order"),
    EnvRule(
        r"world_size_invariant", "voids", "invariant mode: the world size no longer decides bits"
    ),
    EnvRule(r"world_size|backend|num_nodes|devices|accelerator|precision", "voids", "topology"),
    EnvRule(r"strategy", "voids", "topology"),
    EnvRule(r"determinis\w*|\w*hash_?seed|\w*tf32\w*|matmul_precision", "voids", "flags"),
    EnvRule(r"python|lightning|numpy|driver|platform|os|kernel|g?libc", "may matter", "stack"),
    EnvRule(r"lock|packages|container|image|image_id|base_image", "may matter", "installed set"),
)


def classify_env_key(key: str) -> tuple[Verdict, str]:
    """The verdict and reason for one dotted environment key, from ``ENV_RULES``."""
    lowered = key.lower()
    for rule in ENV_RULES:
        if re.search(rf"(?<![a-z0-9])(?:{rule.pattern})(?![a-z0-9])", lowered):
            return rule.verdict, rule.why
    return "no", "provenance only"


@dataclass(frozen=True)
class EnvDiff:
    key: str
    a: Any
    b: Any
    verdict: Verdict
    why: str

    @property
    def voids(self) -> bool:
        return self.verdict == "voids"

    def to_text(self) -> str:
        return f"{self.key}: {self.a!r} -> {self.b!r} [{self.verdict}: {self.why}]"


_ABSENT = object()


def flatten_record(value: Any, prefix: str = "") -> dict[str, Any]:
    """Nested mappings and lists of records -> ``{"a.b.0.c": value}``."""
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(flatten_record(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    if isinstance(value, (list, tuple)) and any(isinstance(v, (Mapping, list)) for v in value):
        out = {}
        for index, item in enumerate(value):
            out.update(flatten_record(item, f"{prefix}.{index}"))
        return out
    return {prefix: list(value) if isinstance(value, tuple) else value}


def compare_environments(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[EnvDiff]:
    """Fields (dotted keys) whose values differ, each with whether it voids the guarantee."""
    flat_a, flat_b = flatten_record(a), flatten_record(b)
    out = []
    for key in sorted(set(flat_a) | set(flat_b)):
        va, vb = flat_a.get(key, _ABSENT), flat_b.get(key, _ABSENT)
        if va != vb:
            verdict, why = classify_env_key(key)
            va, vb = (None if v is _ABSENT else v for v in (va, vb))
            out.append(EnvDiff(key, va, vb, verdict, why))
    return out


@dataclass(frozen=True)
class InputDiff:
    """One run input (dotted key) with different values; ``None`` where a run lacks it."""

    key: str
    a: Any
    b: Any

    def to_text(self) -> str:
        return f"{self.key}: {self.a!r} -> {self.b!r}"


def compare_inputs(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[InputDiff]:
    """The inputs that differ between two runs' input records (e.g. run.json ``inputs``)."""
    flat_a, flat_b = flatten_record(a), flatten_record(b)
    return [
        InputDiff(key, flat_a.get(key), flat_b.get(key))
        for key in sorted(set(flat_a) | set(flat_b))
        if flat_a.get(key, _ABSENT) != flat_b.get(key, _ABSENT)
    ]
