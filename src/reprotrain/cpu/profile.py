"""CPU determinism profiles: which kernels the CPU runs, fixed before torch starts.

On a CPU the bits follow the kernels ATen, oneDNN and MKL pick for the
machine's instruction set, and the thread count (measured:
``benchmarks/cpu/cpu_pins.sh``). A profile fixes both, so the bits stop depending
on which x86-64 CPU runs the job:

``portable`` (the default)
    * ``ATEN_CPU_CAPABILITY=avx2``: ATen's vectorised kernels at the AVX2 level
      (x86-64-v3: every x86-64 server CPU since about 2015 has AVX2 and FMA). An
      AVX-512 host is capped to it; a CPU without AVX2 cannot run it, and
      :meth:`CpuProfile.problems` says so rather than silently running ``default``
      kernels.
    * ``MKL_CBWR=COMPATIBLE,STRICT``: MKL's one SSE2 code path, with fixed cache
      sizes and reduction order (MKL's conditional numerical reproducibility).
      The ISA-named branches (``AVX2``...) exist only on Intel CPUs; elsewhere MKL
      falls back to ``AUTO`` without a word, so only ``COMPATIBLE`` means the
      same thing on Intel and AMD. Kept for what still reaches MKL (``mv``,
      linear algebra), not for the routed products.
    * oneDNN off (``torch.backends.mkldnn.enabled = False``): convolutions run as
      ATen's im2col + GEMM. oneDNN's JIT kernels choose their blocking from
      the ISA and the cache sizes it detects, which no variable pins; with it off,
      ``ONEDNN_MAX_CPU_ISA`` no longer changes the bits (tested).
    * The project's kernels (:mod:`reprotrain.cpu.kernels`): matrix products
      and the convolution's GEMM on one pinned OpenBLAS build at its Haswell
      level (``OPENBLAS_CORETYPE``) in fixed blocks, and dropout's mask on ATen's
      generator on every vendor (torch draws it with MKL on Intel CPUs only). So
      a training step of the shipped recipes makes no MKL call at all.
    * ``TORCHINDUCTOR_CPP_MARCH=x86-64-v3``: a ``torch.compile``'d model's C++ is built
      for the same level (Inductor's vectors already follow ``ATEN_CPU_CAPABILITY``;
      its default ``-march=native`` would enable what the host has), and its matrix
      products (``out=`` overloads) are routed like eager ones
      (:mod:`reprotrain.provenance.toolchain`, docs/compile.md).
    * ``threads`` threads share the routed GEMM's fixed blocks, while ATen's own
      kernels run on one intra-op thread (``OMP_NUM_THREADS=1``,
      ``MKL_NUM_THREADS=1``) and one inter-op thread. A reduction that ATen split
      across threads would add in an order that follows the thread count; a block
      is computed the same way by whichever thread takes it. So ``threads``
      changes the speed alone and is not in the record: runs at 1 and at 2
      threads are one cache entry and one run ID (tested). On 2 cores the GEMM's
      second thread gained more than ATen's (``benchmarks/cpu/portable_threads.py``).

``native``
    The host's own kernels (fastest), with ``threads`` intra-op threads: the split
    of a reduction follows the thread count, and the CPU's instruction-set level
    decides the bits, so both stay in the key.

The variables only work when set at process start, so :meth:`variables` is
what :func:`reprotrain.determinism.reexec_with_fixed_hash_seed` exports when
it restarts the interpreter; DataLoader workers and DDP ranks inherit them.
:meth:`apply` does the in-process part after torch is imported and reports
what is not in force.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reprotrain.cpu.routed import OPENBLAS_VARIABLES, ROUTED, ROW_BLOCK, openblas_version

PROFILES = ("portable", "native")
#: ATen's level under ``portable``, and the CPU flags it needs.
PORTABLE_ATEN_LEVEL = "avx2"
PORTABLE_REQUIRES = ("avx2", "fma")
PORTABLE_MKL_BRANCH = "COMPATIBLE,STRICT"
#: ``-march`` of a compiled model's C++ under ``portable``: the pinned ATen level's.
PORTABLE_MARCH = "x86-64-v3"
#: Where Linux lists the CPU's instruction-set flags.
CPUINFO = Path("/proc/cpuinfo")


def host_cpu_flags(cpuinfo: Path = CPUINFO) -> frozenset[str]:
    """The instruction-set flags this CPU reports (``/proc/cpuinfo``); none where unreadable.

    The one reader of the flags: the environment record and the profile's check take
    them from here.
    """
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    found = re.search(r"^flags\s*:\s*(.+)$", text, re.M)
    return frozenset(found.group(1).split()) if found else frozenset()


#: The profile a launcher (``reprotrain run --cpu-profile``) started the process under, as
#: ``name:threads``: what :func:`launched_profile` reads for ``configure_determinism``.
LAUNCHED = "REPROTRAIN_CPU_PROFILE"


def launched_profile(environ: Mapping[str, str] = os.environ) -> CpuProfile | None:
    """The profile :data:`LAUNCHED` names; None where it is not set.

    Raises ValueError naming the variable when its value is not ``name:threads``.
    """
    if LAUNCHED not in environ:
        return None
    name, _, threads = environ[LAUNCHED].partition(":")
    try:
        return CpuProfile(name, int(threads or "1"))
    except ValueError as err:
        raise ValueError(
            f"{LAUNCHED}={environ[LAUNCHED]}: {err}; reprotrain run sets it "
            "(portable:1), or unset it"
        ) from None


#: Variables a profile leaves alone but that would change kernels if it did not neutralise them.
NEUTRALISED = ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


@dataclass(frozen=True)
class CpuProfile:
    """A CPU profile (``portable`` or ``native``) and its intra-op thread count."""

    name: str = "portable"
    threads: int = 1

    def __post_init__(self) -> None:
        if self.name not in PROFILES:
            raise ValueError(f"CPU profile {self.name!r}: expected one of {', '.join(PROFILES)}")
        if type(self.threads) is not int or self.threads < 1:
            raise ValueError(f"CPU threads {self.threads!r}: expected an integer >= 1")

    @property
    def portable(self) -> bool:
        return self.name == "portable"

    @property
    def aten_threads(self) -> int:
        """ATen's intra-op threads: ``threads`` under ``native``; one under ``portable``,
        where ``threads`` threads share the routed GEMM's blocks instead."""
        return 1 if self.portable else self.threads

    def variables(self) -> dict[str, str]:
        """The variables this profile needs in place when the interpreter starts."""
        threads = str(self.aten_threads)
        pinned = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
        if self.portable:
            pinned["ATEN_CPU_CAPABILITY"] = PORTABLE_ATEN_LEVEL
            pinned["MKL_CBWR"] = PORTABLE_MKL_BRANCH
            pinned["TORCHINDUCTOR_CPP_MARCH"] = PORTABLE_MARCH
            pinned.update(OPENBLAS_VARIABLES)
        return pinned

    def contradictions(self, environ: Mapping[str, str] = os.environ) -> list[str]:
        """Exported variables that disagree with the profile, each as ``NAME=value (needs X)``."""
        return [
            f"{name}={environ[name]} (needs {value})"
            for name, value in self.variables().items()
            if name in environ and environ[name] != value
        ]

    def describe(self) -> str:
        return f"CPU profile {self.name} ({self.threads} thread{'s' * (self.threads > 1)})"

    def record(self) -> dict[str, Any]:
        """What the profile fixes, for the environment record (no host facts).

        ``threads`` only under ``native``: under ``portable`` it decides the speed alone.
        """
        out: dict[str, Any] = {"profile": self.name}
        if not self.portable:
            out["threads"] = self.threads
        else:
            out.update(pins=self.variables(), onednn=False, requires=list(PORTABLE_REQUIRES))
            out["kernels"] = {
                "routed": list(ROUTED),
                "openblas": openblas_version(),
                "row_block": ROW_BLOCK,
            }
        return out

    def missing_features(self, cpu_flags: set[str] | frozenset[str] | None = None) -> list[str]:
        """The CPU flags this profile needs that ``cpu_flags`` lacks (None: this CPU's,
        :func:`host_cpu_flags`)."""
        if not self.portable:
            return []
        flags = host_cpu_flags() if cpu_flags is None else cpu_flags
        return [f for f in PORTABLE_REQUIRES if f not in flags]

    def unsupported_here(
        self,
        cpu_flags: set[str] | frozenset[str] | None = None,
        way_out: str = "set cpu.profile: native",
    ) -> str | None:
        """One line when this CPU cannot run the profile's kernels, else None.

        ``portable`` pins ATen's AVX2 level and OpenBLAS's Haswell kernel, which both
        need AVX2 and FMA: forced onto a CPU without them, the pinned OpenBLAS dies of an
        illegal instruction (and ATen quietly runs other kernels). So the callers check
        this before any process starts under the profile's variables.
        """
        if not (missing := self.missing_features(cpu_flags)):
            return None
        return (
            f"the portable CPU profile needs a CPU with {' and '.join(PORTABLE_REQUIRES).upper()} "
            f"(x86-64-v3: the pinned ATen level and OpenBLAS kernel), and this one lacks "
            f"{', '.join(missing).upper()} (/proc/cpuinfo); {way_out} (this CPU's own kernels: "
            "its bits then follow the CPU)"
        )

    def apply(self) -> list[str]:
        """Set the in-process part (oneDNN, thread pools); return what is not in force.

        Call it after the process started with :meth:`variables` exported and
        before any model runs. The returned problems void the profile's promise.
        """
        import torch

        from reprotrain.cpu import kernels

        start = "it must be set when the process starts (reexec_with_fixed_hash_seed)"
        problems = [
            f"{item}: exported against the {self.describe()}; {start}"
            for item in self.contradictions()
        ]
        problems += [
            f"{name} is not set; the {self.describe()} needs it: {start}"
            for name in self.variables()
            if name not in os.environ
        ]
        torch.backends.mkldnn.enabled = not self.portable
        torch.set_num_threads(self.aten_threads)
        if unsupported := self.unsupported_here():
            kernels.disable()  # the pinned OpenBLAS would die of SIGILL here
            problems.append(unsupported)
        elif not self.portable:
            kernels.disable()
        else:
            try:
                kernels.enable(self.threads)
            except kernels.KernelsUnavailable as err:
                problems.append(f"the {self.describe()} cannot route its kernels: {err}")
        if torch.get_num_interop_threads() != 1:
            try:
                torch.set_num_interop_threads(1)
            except RuntimeError:
                problems.append(
                    "torch's inter-op thread pool had already started; apply the CPU profile "
                    "before running any model"
                )
        capability = torch.backends.cpu.get_cpu_capability()
        if self.portable and not unsupported and capability != PORTABLE_ATEN_LEVEL.upper():
            problems.append(
                f"ATen dispatches {capability} kernels, not {PORTABLE_ATEN_LEVEL.upper()}: "
                "ATEN_CPU_CAPABILITY was not set at start; the portable profile cannot give the "
                "reference bits here, use the native profile"
            )
        return problems
