"""Time of one recorded training step against a plain one (``reprotrain.oprecord``).

A plain PyTorch loop (forward, backward, Adam step) on CPU, for the
pipeline's default network (batch 64) and a ~10M-parameter MLP (batch 64).
Each repeat times one plain step and one recorded step, interleaved, after
warm-up steps; a recorded step is ``record_step`` with a one-step window, so
it includes everything a user pays to record a step: the modes, a
fingerprint of every op output and outside input, the fetch, and writing
the recording's file. Reported per model: the median plain and recorded step
time and their ratio, and the number of ops in a step. Goal (issue 16):
ratio <= 3. Off (no window), ``record_step`` is a null context and costs
nothing measurable; that is not timed here.

Measured on the shared 2-core build host (``--repeats 9 --threads 1``):
pipeline network 5.69 ms plain, 19.19 ms recorded, 3.37x; MLP 100.7 ms,
231.2 ms, 2.30x (docs/any-script.md says where the time goes).

    .venv/bin/python benchmarks/op_record_overhead.py [--repeats 15] [--threads N] [--json PATH]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from _workspace import ROOT
from reprotrain.atomic import atomic_write_text
from reprotrain.determinism import configure_determinism, reexec_with_fixed_hash_seed
from reprotrain.hashing import canonical_json, load_safetensors
from reprotrain.oprecord import record_step
from reprotrain.pipeline.config import load_params
from reprotrain.pipeline.model import build_network
from trace_overhead import MLP


def pipeline_network() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    params = load_params(ROOT / "params.yaml", [])
    net = build_network(params.model, (1, 8, 8), 10)
    return net, torch.randn(64, 1, 8, 8), torch.randint(0, 10, (64,))


def mlp() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The ~10M-parameter MLP of benchmarks/trace_overhead.py, without Lightning."""
    return MLP().net, torch.randn(64, 1024), torch.randint(0, 10, (64,))


def measure(name: str, build: Callable[[], tuple[nn.Module, Any, Any]], repeats: int) -> dict:
    configure_determinism(0, True)
    net, x, y = build()
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)

    def step() -> None:
        loss = F.cross_entropy(net(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    plain, recorded = [], []
    with tempfile.TemporaryDirectory() as out:
        for index in range(3 + repeats):  # the first 3 pairs warm up
            start = time.perf_counter()
            step()
            middle = time.perf_counter()
            with record_step(net, index, optimizer, steps=(index, index), out=out, batch=(x, y)):
                step()
            end = time.perf_counter()
            if index >= 3:
                plain.append(middle - start)
                recorded.append(end - middle)
        ops = len(load_safetensors(Path(out) / "ops-rank0.safetensors")[0]["ops"])
    size = sum(p.numel() for p in net.parameters())
    result = {
        "model": f"{name} ({size:,} parameters, batch 64)",
        "ops_per_step": ops,
        "plain_ms": statistics.median(plain) * 1e3,
        "recorded_ms": statistics.median(recorded) * 1e3,
    }
    result["ratio"] = result["recorded_ms"] / result["plain_ms"]
    print(
        f"  {result['model']:45s} {ops:5d} ops  plain {result['plain_ms']:8.2f} ms  "
        f"recorded {result['recorded_ms']:8.2f} ms  ratio {result['ratio']:.2f}"
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--json", type=Path, help="also write the figures here as JSON")
    cli = parser.parse_args()
    reexec_with_fixed_hash_seed()
    if cli.threads:
        torch.set_num_threads(cli.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {cli.repeats} repeats")
    results = [
        measure("pipeline network", pipeline_network, cli.repeats),
        measure("MLP", mlp, cli.repeats),
    ]
    if cli.json:
        atomic_write_text(cli.json, canonical_json({"torch": torch.__version__, "models": results}))


if __name__ == "__main__":
    main()
