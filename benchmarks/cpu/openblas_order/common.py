"""What ``check_model.py`` and ``avx512_experiment.py`` share: the C model's build and
bindings, the pinned OpenBLAS's ``sgemm``, the core-type guard, and a printer that can
keep a copy of its lines (``--out``)."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

from reprotrain.cpu.profile import host_cpu_flags
from reprotrain.cpu.routed import openblas_library

MODEL_SOURCE = Path(__file__).resolve().with_name("haswell_model.c")
ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112
#: Core types whose kernels need AVX-512: never loaded on a CPU without ``avx512f``.
AVX512_CORES = frozenset({"SkylakeX"})
#: mode 2's K blocks: SkylakeX's SGEMM Q and UNROLL_M (param.h).
SKYLAKEX_Q, SKYLAKEX_UNROLL_M = 448, 16


def build_model(folder: Path) -> Path:
    """Compile ``haswell_model.c`` into ``folder``; the shared library's path."""
    if shutil.which("gcc") is None:
        sys.exit("gcc is needed to build haswell_model.c (apt-get install gcc)")
    target = folder / "haswell_model.so"
    subprocess.run(
        ["gcc", "-O2", "-ffp-contract=off", "-fPIC", "-shared", "-o", str(target),
         str(MODEL_SOURCE), "-lm"],
        check=True,
    )  # fmt: skip
    return target


def load_model(path: Path | str) -> ctypes.CDLL:
    """The built model, with ``model()``'s argument types set."""
    lib = ctypes.CDLL(str(path))
    n, i, f, p = ctypes.c_long, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    lib.model.argtypes = [i, n, n, n, f, p, p, f, p, n, n, p]
    lib.model.restype = i
    return lib


def run_model(lib: ctypes.CDLL, mode: int, a: np.ndarray, b: np.ndarray, c: np.ndarray,
              beta: float, alpha: float = 1.0, q: int = 0, um: int = 0) -> np.ndarray:  # fmt: skip
    """``c = alpha * a @ b + beta * c`` (in place, row-major) in the order of ``mode``;
    the map (``c``'s shape, bool) of the outputs mode 0 sums with split accumulators."""
    a, b = np.ascontiguousarray(a, np.float32), np.ascontiguousarray(b, np.float32)
    (m, k), n = a.shape, b.shape[1]
    mark = np.zeros((m, n), np.uint8)
    lib.model(mode, m, n, k, alpha, a.ctypes.data, b.ctypes.data, beta, c.ctypes.data, q, um,
              mark.ctypes.data)  # fmt: skip
    return mark.astype(bool)


def refuse_unrunnable(cores: list[str]) -> None:
    """Exit with one line where a core type needs AVX-512 and this CPU lacks ``avx512f``
    (its kernels would die of SIGILL)."""
    wanted = sorted(AVX512_CORES.intersection(cores))
    if wanted and "avx512f" not in host_cpu_flags():
        sys.exit(f"refused: {', '.join(wanted)} needs AVX-512 and this CPU has no avx512f")


def load_openblas(core: str) -> ctypes.CDLL:
    """The pinned OpenBLAS at ``core`` and one thread (read when it loads: call this once, in
    a process of its own), with ``scipy_cblas_sgemm``'s argument types set."""
    refuse_unrunnable([core])
    os.environ["OPENBLAS_CORETYPE"], os.environ["OPENBLAS_NUM_THREADS"] = core, "1"
    try:
        blas = ctypes.CDLL(str(openblas_library()))
    except FileNotFoundError as err:
        sys.exit(str(err))
    blas.scipy_openblas_get_corename.restype = ctypes.c_char_p
    i, f, p = ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    blas.scipy_cblas_sgemm.argtypes = [i] * 6 + [f, p, i, p, i, f, p, i]
    return blas


def _ld(x: np.ndarray) -> int:
    """A row-major matrix's leading dimension (a row slice's stride; for a contiguous one its
    width: NumPy's strides of size-1 dimensions are arbitrary)."""
    return x.shape[1] if x.flags.c_contiguous else x.strides[0] // x.itemsize


def sgemm(blas: ctypes.CDLL, a: np.ndarray, b: np.ndarray, c: np.ndarray, ta: bool, tb: bool,
          beta: float, alpha: float = 1.0) -> None:  # fmt: skip
    """Row-major ``c = alpha * op(a) @ op(b) + beta * c``, ``a`` (``b``) stored transposed
    when ``ta`` (``tb``); float32, rows contiguous (row slices allowed)."""
    m, n = c.shape
    k = a.shape[0] if ta else a.shape[1]
    blas.scipy_cblas_sgemm(ROW_MAJOR, TRANS if ta else NO_TRANS, TRANS if tb else NO_TRANS,
                           m, n, k, alpha, a.ctypes.data, _ld(a), b.ctypes.data, _ld(b), beta,
                           c.ctypes.data, _ld(c))  # fmt: skip


def kblocks(k: int, q: int = 320, um: int = 8) -> list[tuple[int, int]]:
    """The (start, length) K blocks of level3.c (Haswell's Q and UNROLL_M by default)."""
    out, ls = [], 0
    while ls < k:
        length = k - ls
        if length >= 2 * q:
            length = q
        elif length > q:
            length = (length // 2 + um - 1) // um * um
        out.append((ls, length))
        ls += length
    return out


class Report:
    """Print lines as they come, and keep them for ``--out``."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, line: str) -> None:
        print(line, flush=True)
        self.lines.append(line)

    def save(self, out: str | None) -> None:
        if out:
            Path(out).write_text("\n".join(self.lines) + "\n")
