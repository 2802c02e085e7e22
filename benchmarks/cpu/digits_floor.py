"""Why the digits CNN's portable step stays above 1.3x native: its pinned GEMMs alone, side by side.

Figures in fresh processes, one round after another (alternating order), all at
one thread, on the digits recipe's model and batch (64 images of 8x8, convolutions
1 -> 16 -> 32 channels, Adam):

* ``native step``: one training step (forward, loss, backward, Adam) under ``native``
  (oneDNN's convolutions at the host's ISA: AVX-512 where the CPU has it);
* ``portable step``: the same under ``portable``;
* ``portable, cols not kept``: the same with no forward's columns kept for the
  backward (``portable_conv.KEEP_BYTES = 0``: the weight gradient copies them anew,
  as before session 31), to show what keeping them saves;
* ``portable conv GEMMs``: only the five routed GEMMs those two convolutions make per
  step (forward, weight gradient, and the second one's input gradient), at the
  pinned OpenBLAS's Haswell level: a floor for the portable step, before im2col,
  col2im, the linear layers, dropout, pooling and Adam;
* ``portable conv copies``: only the im2col and col2im copies around those GEMMs
  (each convolution's columns, made by its forward and kept for its weight gradient;
  the second one's gradient added back into its input), as ``portable_conv`` makes
  them.

Prints each median in ms and its ratio to the native step. Where ``portable conv
GEMMs`` alone is already most of ``1.3 x native``, the target cannot be met at the
pinned AVX2 level on that host. Run from the repository root after ``make venv``::

    .venv/bin/python benchmarks/cpu/digits_floor.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # python benchmarks/<group>/<script>.py: import from the root

from benchmarks._common.child import child_env, run_json
from benchmarks._common.workloads import cpu_model

STEPS = 200


def measure(what: str) -> float:
    """Median ms of ``what`` in this process (started under its profile's variables)."""
    import time

    import torch

    from reprotrain.cpu.profile import CpuProfile
    from reprotrain.determinism import configure_determinism
    from reprotrain.recipes.digits import Classifier

    configure_determinism(
        0, True, cpu_profile=CpuProfile("native" if what == "native" else "portable")
    )
    g = torch.Generator().manual_seed(0)
    if what == "copies":
        from reprotrain.cpu import conv as portable_conv

        conv = ((1, 1), (1, 1), (1, 1), False, (0, 0), 1)  # the recipe's: 3x3, padding 1
        layers = [
            (torch.randn(64, c, 8, 8, generator=g), torch.randn(o, c, 3, 3, generator=g))
            for c, o in ((1, 16), (16, 32))
        ]
        grad_cols = portable_conv._columns(*layers[1], conv).clone()  # not the workspace

        def step(_: int) -> None:
            for x, weight in layers:  # the forward's, kept for the weight gradient
                portable_conv._columns(x, weight, conv)
            portable_conv._image(grad_cols, *layers[1], conv)  # input gradient, second

    elif what == "gemms":
        shapes = [(32, 144, 4096), (144, 32, 4096), (32, 4096, 144), (16, 9, 4096), (16, 4096, 9)]
        pairs = [
            (torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)) for m, k, n in shapes
        ]

        def step(_: int) -> None:
            for a, b in pairs:
                a @ b
    else:
        if what == "uncached":
            from reprotrain.cpu import conv as portable_conv

            portable_conv.KEEP_BYTES = 0  # every weight gradient copies its columns anew
        model = Classifier((1, 8, 8), 10)
        batch = (torch.randn(64, 1, 8, 8, generator=g), torch.randint(0, 10, (64,), generator=g))
        optimizer = model.configure_optimizers()
        model.train()

        def step(i: int) -> None:
            model.training_step(batch, i).backward()
            optimizer.step()
            optimizer.zero_grad()

    for i in range(20):
        step(i)
    times = []
    for i in range(STEPS):
        start = time.perf_counter()
        step(i)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def _child(what: str) -> float:
    from reprotrain.cpu.profile import CpuProfile

    profile = CpuProfile("native" if what == "native" else "portable")
    pins = {*CpuProfile("portable").variables(), *profile.variables()}  # none left from a shell
    env = child_env(pins, **{**profile.variables(), "PYTHONHASHSEED": "0"})
    return run_json([__file__, "--child", what], what, env=env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child)))
        return
    names = {
        "native": "native step",
        "portable": "portable step",
        "uncached": "portable, cols not kept",
        "gemms": "portable conv GEMMs",
        "copies": "portable conv copies",
    }
    order = list(names)
    runs: dict[str, list[float]] = {what: [] for what in names}
    for round_ in range(args.rounds):
        for what in order if round_ % 2 == 0 else reversed(order):
            runs[what].append(_child(what))
    print(f"CPU: {cpu_model()}; digits step, 1 thread; {args.rounds} rounds; medians")
    native = statistics.median(runs["native"])
    for what, label in names.items():
        ms = statistics.median(runs[what])
        print(f"{label:24s} {ms:7.2f} ms  x{ms / native:.2f} native")
    print(f"{'1.3 x native':24s} {1.3 * native:7.2f} ms")


if __name__ == "__main__":
    main()
