"""The bits of every kernel the portable profile routes, on fixed inputs: hosts compare in seconds.

Each row runs one routed op of ``reprotrain.cpu.kernels`` (``cpuprofile.ROUTED``)
on inputs of the shipped recipes' shapes (the language model's GEMMs at batch 32 x 64
tokens, width 64 and 144; the digits network's convolutions; dropout's mask; the square
root of Adam's update over every float32 exponent) and prints
the first 16 hex digits of the sha256 of its outputs, then one line over all rows. Inputs
are integers from a seeded ``torch.Generator`` divided by 251 (IEEE division rounds the
same on every CPU): the same bits anywhere, and their sums round, so a sum's order shows;
the square root's are seeded bit patterns of positive float32s.
The same rows follow with torch's own kernels (the profile's kernels off: MKL, oneDNN
off), the control, whose digits differ between vendors where MKL's do. Equal
``portable`` digits on two hosts = the routed kernels give the same bits there;
docs/cpu-profile.md keeps a column per host. Restarts itself under the portable
profile's variables (OpenBLAS and ATen read them at start). Run from the
repository root::

    .venv/bin/python benchmarks/cpu/kernel_bits.py [--threads N]
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from collections.abc import Callable
from pathlib import Path

from reprotrain.cpu.profile import CpuProfile
from reprotrain.determinism import reexec_with_fixed_hash_seed


def _rows(g: object) -> dict[str, Callable[[], list[object]]]:
    import torch
    import torch.nn.functional as F

    def ints(*shape: int) -> torch.Tensor:
        return (
            torch.randint(-512, 512, shape, generator=g).float() / 251
        )  # IEEE division: exact-rounded everywhere

    def conv(n: int, c: int, o: int, size: int) -> Callable[[], list[torch.Tensor]]:
        def run() -> list[torch.Tensor]:
            x, w, b = ints(n, c, size, size).requires_grad_(), ints(o, c, 3, 3), ints(o)
            w.requires_grad_()
            y = F.conv2d(x, w, b, padding=1)
            return [y, *torch.autograd.grad(y.square().sum(), [x, w])]

        return run

    def gemm(rows: int, width: int, out: int) -> Callable[[], list[torch.Tensor]]:
        def run() -> list[torch.Tensor]:
            x, w, b = ints(rows, width), ints(out, width), ints(out)
            return [x @ w.t(), torch.addmm(b, x, w.t()), (x @ w.t()).t() @ x]

        return run

    def attention(batch: int, time: int, width: int) -> Callable[[], list[torch.Tensor]]:
        def run() -> list[torch.Tensor]:
            q, k = ints(batch, time, width), ints(batch, time, width)
            return [torch.bmm(q, k.transpose(1, 2)), torch.baddbmm(q[:, :, :4], q, k[:, :4].mT)]

        return run

    def dropout() -> list[torch.Tensor]:
        torch.manual_seed(0)
        return [F.dropout(torch.ones(32, 64, 64), 0.1, True)]

    def square_root() -> list[torch.Tensor]:
        # every positive finite float32 is one bit pattern in [0, 0x7F800000): all exponents
        x = torch.randint(0, 0x7F800000, (1 << 20,), generator=g, dtype=torch.int32)
        return [torch.sqrt(x.view(torch.float32))]

    return {
        "lm gemm 2048x64 -> 256": gemm(2048, 64, 256),
        "lm gemm 2048x144 -> 576": gemm(2048, 144, 576),
        "lm gemm 2048x144 -> 65 (head)": gemm(2048, 144, 65),
        "lm attention bmm 128x64x36": attention(128, 64, 36),
        "digits conv 64x1x8x8 -> 16": conv(64, 1, 16, 8),
        "digits conv 64x16x4x4 -> 32": conv(64, 16, 32, 4),
        "dropout mask 32x64x64, p 0.1": dropout,
        "adam sqrt 1M float32": square_root,
    }


def table(routed: bool, threads: int) -> list[tuple[str, str, float]]:
    import torch

    from reprotrain.cpu import kernels as portable_kernels

    torch.backends.mkldnn.enabled = False
    portable_kernels.enable(threads) if routed else portable_kernels.disable()
    g = torch.Generator().manual_seed(0)
    out = []
    for name, run in _rows(g).items():
        start = time.perf_counter()
        tensors = run()
        seconds = time.perf_counter() - start
        digest = hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in tensors))
        out.append((name, digest.hexdigest()[:16], seconds))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    reexec_with_fixed_hash_seed(CpuProfile("portable", args.threads).variables())
    import torch

    torch.set_num_threads(args.threads)
    print(f"CPU: {_cpu()}; torch {torch.__version__}; {args.threads} thread(s)")
    for routed in (True, False):
        rows = table(routed, args.threads)
        label = "portable" if routed else "torch's own (control)"
        total = hashlib.sha256("".join(d for _, d, _ in rows).encode()).hexdigest()[:16]
        for name, digest, seconds in rows:
            print(f"{label:22s} {name:32s} {digest}  ({seconds * 1000:.1f} ms)")
        print(f"{label:22s} {'all rows':32s} {total}")


def _cpu() -> str:
    fields: dict[str, str] = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    family, model = fields.get("cpu family"), fields.get("model")
    return f"{fields.get('vendor_id')} {fields.get('model name')} (family {family}, model {model})"


if __name__ == "__main__":
    sys.exit(main())
