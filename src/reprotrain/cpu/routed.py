"""What the portable CPU profile routes, and the OpenBLAS it routes matrix products to.

Light to import (no torch): :mod:`reprotrain.cpu.profile` records these and
exports the OpenBLAS variables; :mod:`reprotrain.cpu.kernels` and
:mod:`reprotrain.cpu.gemm` act on them. Kept here, the kernels need not import
the profile that switches them on, so the four modules form no import circle.
"""

from __future__ import annotations

import importlib.util
from importlib import metadata
from pathlib import Path

#: What the pinned OpenBLAS reads when it loads: its Haswell kernels, one thread per call.
OPENBLAS_VARIABLES = {"OPENBLAS_CORETYPE": "Haswell", "OPENBLAS_NUM_THREADS": "1"}
#: The aten overloads ``portable`` routes to its own kernels (reprotrain.cpu.kernels).
ROUTED = (
    *("mm", "addmm", "bmm", "baddbmm"),
    *("mm.out", "addmm.out", "bmm.out", "baddbmm.out"),  # torch.compile's extern kernels
    *("convolution", "convolution_backward"),
    "bernoulli_.float",
    *("sqrt", "sqrt_", "sqrt.out"),
)
#: The aten ops that ATen hands to MKL's vector math (VML) for float tensors (ATen's
#: ``cpu/vml.h``), each with its in-place and out= overloads: MKL's results differ by CPU
#: vendor (``sqrt`` in Adam's update split the two vendors: docs/cpu-profile.md), so a
#: portable step may call one only where it is routed (tests/test_portable_kernels.py).
_VML_FUNCTIONS = "acos asin atan cos erf erfc erfinv exp log log10 log2 sin sqrt tan tanh trunc"
MKL_VML_OPS = tuple(
    f"{op}{overload}" for op in _VML_FUNCTIONS.split() for overload in ("", "_", ".out")
)
#: Output rows per pinned GEMM call: a constant, so the blocks do not follow the thread count.
ROW_BLOCK = 128


def openblas_version() -> str:
    """The installed scipy-openblas32 (the pinned OpenBLAS), or ``missing``."""
    try:
        return metadata.version("scipy-openblas32")
    except metadata.PackageNotFoundError:
        return "missing"


def openblas_library() -> Path:
    """The pinned OpenBLAS's shared library, found without importing ``scipy_openblas32``
    (its ``__init__`` loads the library, before the caller sets :data:`OPENBLAS_VARIABLES`).

    Raises FileNotFoundError saying what to reinstall when it is missing.
    """
    spec = importlib.util.find_spec("scipy_openblas32")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "scipy-openblas32 is not installed: the portable CPU profile needs the OpenBLAS "
            "build from the lock; run `make venv` (or pip install -r requirements-cpu.lock)"
        )
    folder = Path(spec.submodule_search_locations[0]) / "lib"
    paths = sorted(folder.glob("libscipy_openblas*.so*"))
    if not paths:
        raise FileNotFoundError(f"no libscipy_openblas*.so in {folder}: reinstall the lock")
    return paths[0]
