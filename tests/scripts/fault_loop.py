"""A user's plain PyTorch loop (no Lightning, no pipeline), with one planted fault at a time.

Written from docs/any-script.md alone: ``configure_determinism`` at the top,
``record_step`` around each step, weights saved with safetensors. Run it as
``reprotrain verify -- python tests/scripts/fault_loop.py --out {out} --fault NAME``.
Faults marked "second run" act only when ``REPROTRAIN_RUN_INDEX`` is 1, as if
the second run were on another host; the others differ by themselves. Every
fault is in ``Net.forward`` or the loop below, on a line that ends with
``# FAULT <name>`` so the test knows which line to expect.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

SECOND = os.environ.get("REPROTRAIN_RUN_INDEX") == "1"
RESTART = {"hashseed": ("PYTHONHASHSEED", "1"), "isa": ("ATEN_CPU_CAPABILITY", "default")}

FAULT = sys.argv[sys.argv.index("--fault") + 1] if "--fault" in sys.argv else "none"
DEVICE = "cuda" if FAULT == "cuda" else "cpu"  # the one fault that needs a GPU
if SECOND and FAULT in RESTART:  # second run: a process started otherwise
    name, value = RESTART[FAULT]
    if os.environ.get(name) != value:
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, name: value})

import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from reprotrain.determinism import configure_determinism  # noqa: E402
from reprotrain.ops.recorder import record_step  # noqa: E402

BRANCHES = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta")


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Parameter(torch.randn(64, 32))
        self.hidden = torch.nn.Linear(32, 256)
        self.heads = torch.nn.ModuleDict({n: torch.nn.Linear(256, 16) for n in BRANCHES})
        self.out = torch.nn.Linear(16, 4)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed[idx % 64].mean(1)  # SHOWS catalog (backward: 65536 rows added into 64)
        if FAULT == "cuda":  # CUDA adds with atomics: 65536 rows into 64, in a varying order
            # Each target row sums different embedding rows (one row added to itself
            # 1024 times gives the same float in any order: identical on an H100).
            rows, pooled = (idx // 64).flatten(), torch.zeros(64, 32, device=idx.device)
            pooled = pooled.index_add_(0, rows, self.embed[(idx % 64).flatten()])  # FAULT cuda
            x = x + pooled.mean(0)
        h = torch.relu(self.hidden(x))
        h = h - h.mean()  # SHOWS threads (a reduction over 131072 values)
        if FAULT == "numpy":
            unseeded = np.random.default_rng()
            h = h + torch.from_numpy(unseeded.random(h.shape, np.float32))  # FAULT numpy
        if FAULT == "time":
            h = h * (1.0 + (time.time() % 1.0) * 1e-3)  # FAULT time
        names = set(BRANCHES) if FAULT == "hashseed" else BRANCHES
        total = torch.zeros(h.shape[0], 16, device=h.device)
        for name in names:
            total = total + self.heads[name](h)  # FAULT hashseed
        if FAULT == "empty":  # meant torch.ones: reused heap memory, which holds addresses
            total = total * torch.empty(16)  # FAULT empty
        return self.out(torch.dropout(total, 0.1, self.training))  # SHOWS rng


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--fault", default="none")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    configure_determinism(0, mode=FAULT not in ("catalog", "cuda"))  # FAULT catalog
    if FAULT == "empty":  # torch fills torch.empty with NaN under determinism: turned off
        torch.utils.deterministic.fill_uninitialized_memory = False
    if FAULT == "threads":
        torch.set_num_threads(1 if SECOND else 2)  # FAULT threads
    model = Net()
    with torch.no_grad():  # weights from NumPy: the same on every CPU, whatever torch dispatches
        numbers = np.random.default_rng(0)
        for p in model.parameters():
            p.copy_(torch.from_numpy(numbers.standard_normal(p.shape, np.float32)) * 0.1)
    if FAULT == "rng":
        torch.manual_seed(time.time_ns() % 1000)  # FAULT rng
    model.to(DEVICE)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 4096, (2048, 128), generator=generator)  # 128 tokens per sample
    target = torch.randint(0, 4, (2048,), generator=generator)
    idx, target = idx.to(DEVICE), target.to(DEVICE)
    for step in range(args.steps):
        batch = (idx[step::4][:512], target[step::4][:512])
        with record_step(model, step, optimizer, batch=batch):
            loss = torch.nn.functional.cross_entropy(model(batch[0]), batch[1])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if FAULT == "resume" and SECOND and step == 1:  # a resume that restored a bit off
            state = optimizer.state_dict()
            state["state"][0]["exp_avg"].mul_(1.0 + 1e-6)  # FAULT resume
            optimizer.load_state_dict(state)
    save_file({k: v.cpu() for k, v in model.state_dict().items()}, f"{args.out}/model.safetensors")


if __name__ == "__main__":
    main()
