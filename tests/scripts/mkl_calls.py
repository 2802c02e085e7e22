"""Two training steps of a shipped recipe's model under a CPU profile, for MKL_VERBOSE.

    MKL_VERBOSE=1 python mkl_calls.py digits|lm|lm-compiled portable|native

Prints ``MARK start`` and ``MARK stepped`` around the steps (forward, loss, backward,
optimizer step), so the MKL lines between them are the steps' own calls, then ``OPS``
and the aten overloads the steps called (``sqrt``, ``sqrt_``, ``sqrt.out``), as JSON:
those the dispatcher saw, not an op a kernel calls inside itself (the shipped recipes'
optimizers run one tensor at a time on the CPU, no ``_foreach_`` kernel).
``lm-compiled`` is the LM with SDPA attention and its blocks ``torch.compile``'d: one
step before ``MARK start`` compiles them, and its ``OPS`` are empty (a dispatch mode
would see the compiled code's calls only by breaking its graphs).
The caller exports the profile's variables (they only work from process start).
"""

from __future__ import annotations

import json
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from reprotrain.cpu.profile import CpuProfile
from reprotrain.determinism import configure_determinism
from reprotrain.recipes.digits import Classifier
from reprotrain.recipes.language_model import TinyGPT


class _Calls(TorchDispatchMode):
    """The aten overloads called, named as ``torch.library`` names them."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        overload = func._overloadname
        self.names.add(func._opname + ("" if overload == "default" else f".{overload}"))
        return func(*args, **(kwargs or {}))


def main() -> None:
    recipe, profile = sys.argv[1], CpuProfile(sys.argv[2])
    configure_determinism(0, True, cpu_profile=profile)
    if recipe == "digits":
        model = Classifier((1, 8, 8), 10)
        batch = (torch.randn(64, 1, 8, 8), torch.randint(0, 10, (64,)))
    else:
        compiled = recipe == "lm-compiled"
        attention = "sdpa" if compiled else "manual"
        model = TinyGPT(vocab_size=40, block_size=64, attention=attention, compile=compiled)
        model.configure_model()
        batch = (torch.randint(0, 40, (32, 64)), torch.randint(0, 40, (32, 64)))
    optimizer = model.configure_optimizers()
    model.train()

    def step(number: int) -> None:
        loss = model.training_step(batch, number)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    if recipe == "lm-compiled":
        step(0)  # compiles: Inductor's own work is not the step's
        print("MARK start", flush=True)
        step(1)
        step(2)
        print("MARK stepped", flush=True)
        print("OPS []", flush=True)
        return
    print("MARK start", flush=True)
    with _Calls() as calls:
        for number in range(2):
            step(number)
    print("MARK stepped", flush=True)
    print("OPS", json.dumps(sorted(calls.names)), flush=True)


if __name__ == "__main__":
    main()
