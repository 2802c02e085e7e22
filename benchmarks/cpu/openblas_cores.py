"""Which of the pinned OpenBLAS's kernels give the bits of its Haswell ones, and at what speed.

The portable profile forces OpenBLAS's ``Haswell`` core type (AVX2 + FMA) on every
host (docs/cpu-profile.md). On an AVX-512 host that leaves half the vector width
unused; this measures what the AVX-512 core types would give instead. Each core type
runs in its own process (OpenBLAS reads ``OPENBLAS_CORETYPE`` when it loads, and
falls back to what the CPU has: the core it reports is printed) and computes 576
float32 and float64 products (row-major, both transposes, beta 0 and 1) on fixed
inputs: integers from a seeded generator divided by 251, so the products' sums round
and their order shows, of the shapes the routed GEMM calls (at most
``cpuprofile.ROW_BLOCK`` rows, K from 1 to 2048). It prints one digest over all
products, how many differ from Haswell's, and the time of the language model's
widest block (128 x 144 -> 576, float32, one thread) against Haswell's in the same
run. NumPy and the lock's ``scipy-openblas32`` only; seconds. Run from the repository
root::

    .venv/bin/python benchmarks/cpu/openblas_cores.py [--cores Haswell SkylakeX ...]
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # python benchmarks/<group>/<script>.py: import from the root

from benchmarks._common.child import run_json
from reprotrain.cpu.routed import openblas_library

ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112
SHAPES = [(m, n, k) for m in (1, 17, 128) for n in (5, 65, 576) for k in (1, 64, 144, 2048)]


def _library(core: str) -> ctypes.CDLL:
    os.environ["OPENBLAS_CORETYPE"], os.environ["OPENBLAS_NUM_THREADS"] = core, "1"
    try:
        blas = ctypes.CDLL(str(openblas_library()))
    except FileNotFoundError as err:
        sys.exit(str(err))
    blas.scipy_openblas_get_corename.restype = ctypes.c_char_p
    pointer = ctypes.c_void_p
    for prefix, real in (("s", ctypes.c_float), ("d", ctypes.c_double)):
        name = f"scipy_cblas_{prefix}gemm"
        getattr(blas, name).argtypes = [ctypes.c_int] * 6 + [
            *(real, pointer, ctypes.c_int, pointer, ctypes.c_int, real, pointer, ctypes.c_int)
        ]
    return blas


def _gemm(blas: ctypes.CDLL, a: np.ndarray, b: np.ndarray, c: np.ndarray, ta: bool, tb: bool,
          beta: float) -> None:  # fmt: skip
    """``c = a @ b + beta * c`` with ``a`` (``b``) stored transposed when ``ta`` (``tb``)."""
    m, n = c.shape
    k = a.shape[0] if ta else a.shape[1]
    gemm = blas.scipy_cblas_sgemm if c.dtype == np.float32 else blas.scipy_cblas_dgemm
    gemm(ROW_MAJOR, TRANS if ta else NO_TRANS, TRANS if tb else NO_TRANS, m, n, k, 1.0,
         a.ctypes.data, a.shape[1], b.ctypes.data, b.shape[1], beta, c.ctypes.data, n)  # fmt: skip


def measure(core: str) -> dict:
    """In this process: the core OpenBLAS runs, each product's digest, the block's time."""
    blas = _library(core)
    rng = np.random.default_rng(0)
    digests = []
    for dtype in (np.float32, np.float64):
        for ta in (False, True):
            for tb in (False, True):
                for m, n, k in SHAPES:
                    a = (rng.integers(-512, 512, (k, m) if ta else (m, k)) / 251).astype(dtype)
                    b = (rng.integers(-512, 512, (n, k) if tb else (k, n)) / 251).astype(dtype)
                    start = (rng.integers(-512, 512, (m, n)) / 251).astype(dtype)
                    for beta in (0.0, 1.0):
                        c = start.copy()
                        _gemm(blas, a, b, c, ta, tb, beta)
                        digests.append(hashlib.sha256(c.tobytes()).hexdigest()[:16])
    a = (rng.integers(-512, 512, (128, 144)) / 251).astype(np.float32)
    b = (rng.integers(-512, 512, (144, 576)) / 251).astype(np.float32)
    c = np.zeros((128, 576), np.float32)
    best = float("inf")
    for _ in range(5):
        began = time.perf_counter()
        for _ in range(200):
            _gemm(blas, a, b, c, False, False, 0.0)
        best = min(best, (time.perf_counter() - began) / 200)
    return {"core": blas.scipy_openblas_get_corename().decode(), "digests": digests, "s": best}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cores", nargs="+", default=["Haswell", "SkylakeX", "Cooperlake",
                                                       "SapphireRapids", "Zen"])  # fmt: skip
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child)))
        return
    results = {}
    for core in dict.fromkeys(["Haswell", *args.cores]):  # Haswell first: the reference
        results[core] = run_json([__file__, "--child", core], f"core type {core}")
    pinned = results["Haswell"]
    print(f"{len(pinned['digests'])} products; block 128 x 144 -> 576 float32, one thread")
    header = ("asked", "runs", "all products", "differ", "block", "vs pin")
    print("{:16s} {:16s} {:16s} {:>7s} {:>10s} {:>7s}".format(*header))
    for core, got in results.items():
        total = hashlib.sha256("".join(got["digests"]).encode()).hexdigest()[:16]
        differ = sum(x != y for x, y in zip(got["digests"], pinned["digests"], strict=True))
        print(f"{core:16s} {got['core']:16s} {total:16s} {differ:7d} {got['s'] * 1e6:7.1f} us"
              f" {got['s'] / pinned['s']:6.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
