"""Can OpenBLAS's SkylakeX (AVX-512) SGEMM reproduce the pinned Haswell bits, and at what cost?

For an AVX-512 host (Intel Xeon since Skylake-SP, AMD Zen 4/5). Each core type runs in a
process of its own (OpenBLAS reads ``OPENBLAS_CORETYPE`` when it loads) and computes 326
row-major float32 products (both transposes, beta 0 and 1, the routed GEMM's shapes: at
most 128 rows; plus three wide ones, beta 0) three ways:

* ``plain``: one ``sgemm`` call;
* ``chunked``: one call per Haswell K block (Q=320 and the UNROLL_M=8 rounding of
  level3.c), beta 1 after the first: C gathers the blocks' sums as Haswell's driver does;
* ``fixed``: chunked, then the outputs of Haswell's split-accumulator tiles (m8n4, the
  outer 8-row strips of the n12 panels) recomputed Haswell's way: per K block, two
  single-chain products (even k plus the K%8 tail; odd k) added, then added to C (alpha 1).

The parent compares each way's bits with Haswell-plain and with the C model
(``haswell_model.c``: mode 0 Haswell, mode 1 one chain over Haswell's K blocks, mode 2 one
chain over SkylakeX's, Q=448 and UNROLL_M=16), and prints each way's time on four
transformer-like blocks (one thread; ``fixed`` includes the plain and chunked calls) next
to ``torch.mm`` (MKL) where torch is installed. What the source predicts (0.3.28-0.3.34):
Haswell: plain == chunked == fixed == model 0. SkylakeX: plain == model 2 except on its
small-matrix path (M*N*K <= 1e6); chunked == model 1, off Haswell only in split tiles;
fixed == Haswell except where the small-matrix path's kernels sum otherwise.

SkylakeX runs only when asked and the CPU has ``avx512f``. On an AVX2 host,
``--fixed-via-model`` lets the C model's single chain (mode 1) stand in for the core's
``sgemm`` in ``fixed``, which checks this script's logic. Needs gcc (the model is built into
a temporary directory), NumPy and the lock's ``scipy-openblas32``; minutes. Run from the
repository root::

    .venv/bin/python benchmarks/cpu/openblas_order/avx512_experiment.py --cores Haswell SkylakeX
    .venv/bin/python benchmarks/cpu/openblas_order/avx512_experiment.py --fixed-via-model  # AVX2
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))  # python benchmarks/<group>/<folder>/<script>.py: root imports

from benchmarks._common.child import child_env, run_json
from benchmarks.cpu.openblas_order.common import (
    SKYLAKEX_Q,
    SKYLAKEX_UNROLL_M,
    Report,
    build_model,
    kblocks,
    load_model,
    load_openblas,
    refuse_unrunnable,
    run_model,
    sgemm,
)

CORES = ("Haswell", "SkylakeX")
WAYS = ("plain", "chunked", "fixed")
SHAPES = [(m, n, k) for m in (1, 17, 128) for n in (5, 65, 576) for k in (1, 64, 144, 700)]
SHAPES += [(16, 20, 40), (8, 30, 33), (100, 333, 700), (128, 64, 641)]
BIG = [(128, 256, 1024), (128, 1024, 256), (64, 2304, 768)]  # NN and NT, beta 0 only
TIMED = [(128, 256, 1024), (128, 1024, 256), (64, 2304, 768), (128, 144, 576)]


class Ways:
    """One core's three ways of computing a product."""

    def __init__(self, blas: ctypes.CDLL, mod: ctypes.CDLL, via_model: bool) -> None:
        self.blas, self.mod, self.via_model = blas, mod, via_model

    def single(self, a: np.ndarray, b: np.ndarray, c: np.ndarray) -> None:
        """``c = a @ b`` (beta 0): the core's sgemm, or with ``via_model`` the model's chain."""
        if self.via_model:
            run_model(self.mod, 1, a, b, c, 0.0)
        else:
            sgemm(self.blas, a, b, c, False, False, 0.0)

    def split_map(self, m: int, n: int) -> np.ndarray:
        """Where Haswell keeps split accumulators in an m x n C (from model mode 0)."""
        c = np.zeros((m, n), np.float32)
        return run_model(self.mod, 0, np.zeros((m, 1)), np.zeros((1, n)), c, 0.0)

    def __call__(self, a: np.ndarray, b: np.ndarray, start: np.ndarray, ta: bool, tb: bool,
                 beta: float, only: str | None = None) -> dict[str, np.ndarray]:  # fmt: skip
        """The ways (all, or the one ``only`` names) of ``op(a) @ op(b) + beta * start``."""
        m, n = start.shape
        k = a.shape[0] if ta else a.shape[1]
        out = {}
        if only in (None, "plain"):
            out["plain"] = start.copy()
            sgemm(self.blas, a, b, out["plain"], ta, tb, beta)
            if only:
                return out
        c = start.copy()
        for i, (k0, kc) in enumerate(kblocks(k)):
            ak = a[k0 : k0 + kc] if ta else a[:, k0 : k0 + kc]
            bk = b[:, k0 : k0 + kc] if tb else b[k0 : k0 + kc]
            sgemm(self.blas, np.ascontiguousarray(ak), np.ascontiguousarray(bk), c, ta, tb,
                  beta if i == 0 else 1.0)  # fmt: skip
        out["chunked"] = c
        if only == "chunked":
            return out
        fixed = c.copy()
        mask = self.split_map(m, n)
        if mask.any() and k > 0:
            rows, cols = np.nonzero(mask.any(1))[0], np.nonzero(mask.any(0))[0]
            sub = np.zeros((len(rows), len(cols)), np.float32)
            if beta != 0.0:
                sub = start[np.ix_(rows, cols)] * np.float32(beta)
            a_rows = np.ascontiguousarray((a.T if ta else a)[rows])
            b_cols = np.ascontiguousarray((b.T if tb else b)[:, cols])
            for k0, kc in kblocks(k):
                if kc >= 8:
                    body = kc // 8 * 8
                    even = np.r_[np.arange(k0, k0 + body, 2), np.arange(k0 + body, k0 + kc)]
                    odd = np.arange(k0 + 1, k0 + body, 2)
                    s0, s1 = np.zeros_like(sub), np.zeros_like(sub)
                    self.single(np.ascontiguousarray(a_rows[:, even]), b_cols[even], s0)
                    self.single(np.ascontiguousarray(a_rows[:, odd]), b_cols[odd], s1)
                    s = s0 + s1
                else:
                    s = np.zeros_like(sub)
                    self.single(np.ascontiguousarray(a_rows[:, k0 : k0 + kc]),
                                b_cols[k0 : k0 + kc], s)  # fmt: skip
                sub = sub + s  # alpha 1: fma(1, s, C) == round(C + s)
            whole = fixed.copy()
            whole[np.ix_(rows, cols)] = sub
            fixed = np.where(mask, whole, fixed)
        out["fixed"] = fixed
        return out


def _best(fn: Callable[[], object], reps: int = 20, rounds: int = 5) -> float:
    """The best of ``rounds`` mean times of ``reps`` calls, in seconds."""
    best = float("inf")
    for _ in range(rounds):
        began = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - began) / reps)
    return best


def measure(core: str, model_path: str, folder: str, via_model: bool) -> dict:
    """In this process: every way of every product into ``folder``/``core``.npz (and, at
    Haswell, the model's three modes), the core OpenBLAS runs, the keys, the times."""
    blas = load_openblas(core)
    mod = load_model(model_path)
    ways = Ways(blas, mod, via_model)
    rng = np.random.default_rng(0)
    cases = [(s, ta, tb, beta) for s in SHAPES for ta in (0, 1) for tb in (0, 1)
             for beta in (0.0, 1.0)]  # fmt: skip
    cases += [(s, 0, tb, 0.0) for s in BIG for tb in (0, 1)]
    arrays = {}
    for (m, n, k), ta, tb, beta in cases:
        a = rng.standard_normal((m, k)).astype(np.float32)
        b = rng.standard_normal((k, n)).astype(np.float32)
        start = rng.standard_normal((m, n)).astype(np.float32)
        key = f"{m}x{n}x{k}/{ta}{tb}/{beta:.0f}"
        got = ways(np.ascontiguousarray(a.T) if ta else a, np.ascontiguousarray(b.T) if tb else b,
                   start, bool(ta), bool(tb), beta)  # fmt: skip
        arrays.update({f"{key}|{way}": c for way, c in got.items()})
        if core == "Haswell":  # the model is the same for every core: once
            for mode, (q, um) in ((0, (0, 0)), (1, (0, 0)), (2, (SKYLAKEX_Q, SKYLAKEX_UNROLL_M))):
                arrays[f"{key}|model{mode}"] = start.copy()
                run_model(mod, mode, a, b, arrays[f"{key}|model{mode}"], beta, q=q, um=um)
    times = {}
    torch = None
    if core == "Haswell":
        try:
            import torch
        except ImportError:
            torch = None
        else:
            torch.set_num_threads(1)
    for m, n, k in TIMED:
        a = rng.standard_normal((m, k)).astype(np.float32)
        b = rng.standard_normal((k, n)).astype(np.float32)
        c = np.zeros((m, n), np.float32)
        for way in WAYS:  # fixed: with the plain and chunked calls it starts from
            only = None if way == "fixed" else way
            call = partial(ways, a, b, c, False, False, 0.0, only)
            times[f"{m}x{n}x{k}/{way}"] = _best(call)
        if torch is not None:
            ta_, tb_, tc_ = (torch.from_numpy(x) for x in (a, b, c))
            call = partial(torch.mm, ta_, tb_, out=tc_)
            times[f"{m}x{n}x{k}/torch.mm"] = _best(call)
    np.savez(Path(folder) / f"{core}.npz", **arrays)
    return {"core": blas.scipy_openblas_get_corename().decode(),
            "keys": sorted({key.split("|")[0] for key in arrays}), "t": times}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cores",
        nargs="+",
        choices=CORES,
        default=["Haswell"],
        help="core types to run (Haswell always runs first: the reference)",
    )
    parser.add_argument(
        "--fixed-via-model",
        action="store_true",
        help="the model's single chain stands in for sgemm in 'fixed' (AVX2)",
    )
    parser.add_argument("--out", help="also write the report to this file")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)  # core, model, folder
    args = parser.parse_args()  # fmt: skip
    if args.child:
        print(json.dumps(measure(*args.child, via_model=args.fixed_via_model)))
        return
    cores = list(dict.fromkeys(["Haswell", *args.cores]))
    refuse_unrunnable(cores)
    say = Report()
    runs, results = {}, {}
    with tempfile.TemporaryDirectory(prefix="avx512_experiment-") as folder:
        model_path = build_model(Path(folder))
        for core in cores:
            argv = [__file__, "--child", core, model_path, folder]
            if args.fixed_via_model:
                argv.append("--fixed-via-model")
            env = child_env(OPENBLAS_CORETYPE=core, OPENBLAS_NUM_THREADS="1")
            runs[core] = run_json(argv, f"core type {core}", env=env)
            with np.load(Path(folder) / f"{core}.npz") as saved:
                results[core] = dict(saved)
    ref, ref_t = results["Haswell"], runs["Haswell"]["t"]
    if args.fixed_via_model:
        say("fixed: the C model's single chain stands in for each core's sgemm")
    for core, run in runs.items():
        got_all, keys = results[core], run["keys"]
        say(f"== asked {core}, runs {run['core']}")
        for way in WAYS:
            products = outputs_differ = outputs = 0
            equal, first = [0, 0, 0], []
            for key in keys:
                got = got_all[f"{key}|{way}"].view(np.uint32)
                differ = int((got != ref[f"{key}|plain"].view(np.uint32)).sum())
                products, outputs_differ = products + (differ > 0), outputs_differ + differ
                outputs += got.size
                if differ and len(first) < 4:
                    first.append(f"{key}:{differ}")
                for mode in range(3):
                    equal[mode] += bool((got == ref[f"{key}|model{mode}"].view(np.uint32)).all())
            say(f"  {way:8s}: differs from Haswell-plain in {products}/{len(keys)} products, "
                f"{outputs_differ}/{outputs} outputs (e.g. {', '.join(first) or '-'}); "
                f"bit-equal to model0 (Haswell) in {equal[0]}, model1 (single chain, Haswell "
                f"K blocks) in {equal[1]}, model2 (single chain, SkylakeX K blocks) in "
                f"{equal[2]} of {len(keys)}")  # fmt: skip
        for key, t in run["t"].items():
            base = ref_t[key.split("/")[0] + "/plain"]
            say(f"  time {key:24s} {t * 1e6:10.1f} us  ({t / base:5.2f}x Haswell plain)")
    say.save(args.out)


if __name__ == "__main__":
    main()
