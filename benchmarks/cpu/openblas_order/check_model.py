"""Check the C model of the Haswell SGEMM order (``haswell_model.c``) against the pinned OpenBLAS.

The pinned ``scipy-openblas32`` runs at ``OPENBLAS_CORETYPE=Haswell`` and one thread, in a
process of its own (OpenBLAS reads the core type when it loads), on 352 row-major float32
products (both transposes, beta 0 and 1; the shapes of ``openblas_cores.py`` plus eight
wider ones) of standard-normal inputs. Per shape it prints how many outputs the full
Haswell model (mode 0) gets wrong (expected 0), how many a pure single-FMA-chain kernel
fed Haswell's K blocks (mode 1: the best a SkylakeX-style kernel can do by K chunking)
gets wrong, and how many outputs lie in split-accumulator tiles; then the totals. Needs
gcc (the model is built into a temporary directory), NumPy and the lock's
``scipy-openblas32``; a minute or two. Run from the repository root::

    .venv/bin/python benchmarks/cpu/openblas_order/check_model.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))  # python benchmarks/<group>/<folder>/<script>.py: root imports

from benchmarks._common.child import child_env, run_json
from benchmarks.cpu.openblas_order.common import (
    Report,
    build_model,
    load_model,
    load_openblas,
    run_model,
    sgemm,
)

CORE = "Haswell"
SHAPES = [(m, n, k) for m in (1, 17, 128) for n in (5, 65, 576) for k in (1, 64, 144, 2048)]
SHAPES += [(128, 256, 1024), (128, 1024, 256), (64, 2304, 768), (128, 768, 768),
           (128, 144, 576), (100, 333, 700), (128, 64, 640), (128, 64, 641)]  # fmt: skip


def measure(model_path: str) -> dict:
    """In this process: the core OpenBLAS runs, one line per shape shown, the totals."""
    blas = load_openblas(CORE)
    mod = load_model(model_path)
    rng = np.random.default_rng(1)
    lines, total, bad0, bad1, split, outputs = [], 0, 0, 0, 0, 0
    for m, n, k in SHAPES:
        for ta in (False, True):
            for tb in (False, True):
                for beta in (0.0, 1.0):
                    a = rng.standard_normal((m, k)).astype(np.float32)
                    b = rng.standard_normal((k, n)).astype(np.float32)
                    start = rng.standard_normal((m, n)).astype(np.float32)
                    got = start.copy()
                    sgemm(blas, np.ascontiguousarray(a.T) if ta else a,
                          np.ascontiguousarray(b.T) if tb else b, got, ta, tb, beta)  # fmt: skip
                    want0, want1 = start.copy(), start.copy()
                    mark = run_model(mod, 0, a, b, want0, beta)
                    run_model(mod, 1, a, b, want1, beta)
                    d0 = int((got.view(np.uint32) != want0.view(np.uint32)).sum())
                    d1 = int((got.view(np.uint32) != want1.view(np.uint32)).sum())
                    total, bad0, bad1 = total + 1, bad0 + (d0 > 0), bad1 + (d1 > 0)
                    split, outputs = split + int(mark.sum()), outputs + m * n
                    if d0 or (ta, tb, beta) == (False, False, 0.0):
                        lines.append(
                            f"{m:4d}x{n:5d}x{k:5d} ta={ta:d} tb={tb:d} beta={beta:.0f}: "
                            f"full model differs in {d0}, single-chain model in {d1} "
                            f"of {m * n} (split-tile outputs {int(mark.sum())})"
                        )
    lines.append(
        f"{total} products: full Haswell model exact in {total - bad0}; single chain with "
        f"Haswell K blocks exact in {total - bad1}; split-tile outputs {split}/{outputs} "
        f"= {split / outputs:.1%}"
    )
    return {"core": blas.scipy_openblas_get_corename().decode(), "lines": lines}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the report to this file")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # the built model's path
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child)))
        return
    say = Report()
    with tempfile.TemporaryDirectory(prefix="haswell_model-") as folder:
        model_path = build_model(Path(folder))
        env = child_env(OPENBLAS_CORETYPE=CORE, OPENBLAS_NUM_THREADS="1")
        got = run_json([__file__, "--child", model_path], f"core type {CORE}", env=env)
    say(f"asked {CORE}, runs {got['core']}")
    for line in got["lines"]:
        say(line)
    say.save(args.out)


if __name__ == "__main__":
    main()
