"""Where the portable profile's second thread goes: the GEMM threads against ATen's threads.

Times a training step of the language-model recipe's 1.0M ``TinyGPT`` (n_layer 4,
n_head 4, n_embd 144, batch 32 x 64 tokens, AdamW) in one process under the
portable profile's kernels, four ways, alternating in every round: the routed
GEMM's threads (``portable_kernels.enable(N)``) at 1 or 2, and ATen's own
intra-op threads (``torch.set_num_threads``) at 1 or 2. ``cpu.threads: 2`` is
the way ``gemm 2, aten 1`` (``CpuProfile.aten_threads``: ATen stays on one
thread under portable, so that the bits do not follow the thread count); the
``aten 2`` ways show what ATen's second thread would add. Prints each way's
median step over the rounds' medians and its ratio to ``gemm 1, aten 1``.
Restarts itself under the portable profile's variables at 2 threads, as
``kernel_bits.py`` does (``OMP_WAIT_POLICY`` as exported: OpenMP's default
spins a while after each region; ``OMP_WAIT_POLICY=PASSIVE`` in front of the
command makes ATen's threads sleep instead). Run from the repository root::

    .venv/bin/python benchmarks/cpu/portable_threads.py [--rounds 4] [--steps 6]
"""

from __future__ import annotations

import argparse
import statistics
import time

from reprotrain.cpu.profile import CpuProfile
from reprotrain.determinism import reexec_with_fixed_hash_seed

WAYS = ((1, 1), (2, 1), (1, 2), (2, 2))  # (GEMM threads, ATen threads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per way and round")
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    reexec_with_fixed_hash_seed(CpuProfile("portable", 2).variables())
    import torch

    from reprotrain.cpu import kernels as portable_kernels
    from reprotrain.recipes.language_model import TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(vocab_size=65, block_size=64, n_layer=4, n_head=4, n_embd=144)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 65, (32, 65), generator=torch.Generator().manual_seed(0))
    x, y = tokens[:, :-1], tokens[:, 1:]

    def step() -> None:
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    medians: dict[tuple[int, int], list[float]] = {way: [] for way in WAYS}
    for _ in range(args.rounds):
        for gemm, aten in WAYS:
            portable_kernels.enable(gemm)
            torch.set_num_threads(aten)
            for _ in range(args.warmup):
                step()
            times = []
            for _ in range(args.steps):
                start = time.perf_counter()
                step()
                times.append(time.perf_counter() - start)
            medians[(gemm, aten)].append(statistics.median(times))
    base = statistics.median(medians[WAYS[0]])
    print(f"TinyGPT 1.0M, batch 32 x 64, {args.rounds} rounds of {args.steps} steps")
    for (gemm, aten), runs in medians.items():
        step_s = statistics.median(runs)
        rounds = ", ".join(f"{r * 1e3:.0f}" for r in runs)
        print(
            f"  gemm {gemm}, aten {aten}: {step_s * 1e3:6.1f} ms  x{step_s / base:.3f} "
            f"(gemm 1, aten 1)  | rounds (ms): {rounds}"
        )


if __name__ == "__main__":
    main()
