"""Does a compiled loop abort at one thread? Issue 64's glibc abort, looked for on this host.

Issue 64 saw ``malloc(): unaligned tcache chunk detected`` from a plain loop whose
Linear-GELU-LayerNorm-Linear-Tanh-Linear model trained with AdamW under ``torch.compile``,
at one thread and ATen's AVX-512 level (an AMD Zen 5, torch 2.13); never with two threads
or at AVX2. This reruns that loop in fresh processes, plain torch with
``OMP_NUM_THREADS=1`` and under ``reprotrain run --cpu-profile native``, across widths,
batch sizes (some leave a ragged last batch) and what is compiled (the model, the whole
step, or the optimizer's step), each with a cold Inductor cache of its own::

    .venv/bin/python benchmarks/cpu/compiled_abort_sweep.py

One line per case: its exit code (a signal shows as a negative number) and final loss;
the exit code is 1 when any case failed, with the end of its output.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # python benchmarks/<group>/<script>.py: import from the root

from benchmarks._common.child import TAIL_LINES, child_env

#: (width, batch size, what is compiled): issue 64's shape at the widths later sessions tried.
CASES = (
    (64, 32, "model"),
    (64, 48, "step"),
    (7, 30, "step"),
    (33, 30, "optimizer"),
    (256, 32, "model"),
    (777, 50, "step"),
    (1024, 32, "optimizer"),
)
WAYS = ("plain torch", "reprotrain native")


def child(width: int, batch: int, compiled: str) -> None:
    """Three epochs of the loop; prints the last loss."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    net = nn.Sequential(
        *(nn.Linear(width, width), nn.GELU(), nn.LayerNorm(width)),
        *(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1)),
    )
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    x = torch.randn(batch * 7 + batch // 3, width)
    y = torch.randn(x.shape[0], 1)

    def step(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = ((net(xb) - yb) ** 2).mean()
        loss.backward()
        optimizer.step()
        return loss

    if compiled == "model":
        net = torch.compile(net)
    elif compiled == "step":
        step = torch.compile(step)
    else:
        optimizer.step = torch.compile(optimizer.step)
    for _ in range(3):
        for i in range(0, x.shape[0], batch):
            loss = step(x[i : i + batch], y[i : i + batch])
    print(f"loss {float(loss):.6f}")


def run(way: str, case: tuple[int, int, str], cache: Path) -> tuple[int, str, str]:
    """One case in a fresh process: its exit code, last printed line and end of all output."""
    me = [sys.executable, __file__, "--child", *map(str, case)]
    if way == "reprotrain native":
        me = [sys.executable, "-m", "reprotrain", "run", "--cpu-profile", "native", "--", *me]
    env = child_env(OMP_NUM_THREADS="1", TORCHINDUCTOR_CACHE_DIR=str(cache))
    done = subprocess.run(me, env=env, capture_output=True, text=True, check=False)
    printed = done.stdout.strip().splitlines()
    lines = (done.stdout + done.stderr).strip().splitlines()
    return done.returncode, printed[-1] if printed else "", "\n".join(lines[-TAIL_LINES:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", nargs=3, metavar=("WIDTH", "BATCH", "COMPILED"))
    args = parser.parse_args()
    if args.child:
        width, batch, compiled = args.child
        child(int(width), int(batch), compiled)
        return
    failed = 0
    with tempfile.TemporaryDirectory(prefix="compiled-abort-") as scratch:
        for n, case in enumerate(CASES):
            for way in WAYS:
                code, last, tail = run(way, case, Path(scratch) / f"{n}-{way.replace(' ', '-')}")
                width, batch, compiled = case
                print(
                    f"{way:18s} width {width:4d} batch {batch:2d} {compiled:9s} exit {code} {last}"
                )
                if code != 0:
                    failed += 1
                    print(tail)
    print(f"{failed} of {len(CASES) * len(WAYS)} runs failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
