"""Two training steps of a shipped recipe's model under a CPU profile, for MKL_VERBOSE.

    MKL_VERBOSE=1 python mkl_calls.py digits|lm portable|native

Prints ``MARK start`` and ``MARK stepped`` around the steps (forward, loss, backward,
optimizer step), so the MKL lines between them are the steps' own calls. The caller
exports the profile's variables (they only work from process start).
"""

from __future__ import annotations

import sys

import torch

from reprotrain.cpuprofile import CpuProfile
from reprotrain.determinism import configure_determinism
from reprotrain.recipes.digits import Classifier
from reprotrain.recipes.language_model import TinyGPT


def main() -> None:
    recipe, profile = sys.argv[1], CpuProfile(sys.argv[2])
    configure_determinism(0, True, cpu_profile=profile)
    if recipe == "digits":
        model = Classifier((1, 8, 8), 10)
        batch = (torch.randn(64, 1, 8, 8), torch.randint(0, 10, (64,)))
    else:
        model = TinyGPT(vocab_size=40, block_size=64)
        batch = (torch.randint(0, 40, (32, 64)), torch.randint(0, 40, (32, 64)))
    optimizer = model.configure_optimizers()
    model.train()
    print("MARK start", flush=True)
    for step in range(2):
        loss = model.training_step(batch, step)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    print("MARK stepped", flush=True)


if __name__ == "__main__":
    main()
