"""Time of one recorded training step against a plain one (``reprotrain.ops.recorder``).

A plain PyTorch loop (forward, backward, Adam step) on CPU, for the
workload's model (``--workload``, its params' batch size; the loss its
``training_step`` returns) and a ~10M-parameter MLP (batch 64).
Each repeat times one plain step and one recorded step, interleaved, after
warm-up steps; a recorded step is ``record_step`` with a one-step window, so
it includes everything a user pays to record a step: the mode, a
fingerprint of every op output and outside input, the fetch, and writing
the recording's file. Reported per model: the median plain and recorded step
time and their ratio, and the number of ops in a step. Goal (issue 16):
ratio <= 3. Off (no window), ``record_step`` is a null context and costs
nothing measurable; that is not timed here. ``--parts`` also times, each
beside its own plain step, a dispatch mode that only runs the ops (the
floor), and the recorder with no tensor hashed or no file written: what
each part costs.

Figures, and where the time goes: docs/any-script.md ("What recording costs").

    .venv/bin/python benchmarks/overhead/op_record_overhead.py [--repeats 15] [--threads N]
        [--parts] [--json PATH] [--workload lm|digits]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # python benchmarks/<group>/<script>.py: import from the root

from benchmarks._common.workspace import add_workload_argument, train_workspace, workload_params
from benchmarks.overhead.trace_overhead import MLP
from reprotrain.atomic import atomic_write_text
from reprotrain.determinism import configure_determinism, reexec_with_fixed_hash_seed
from reprotrain.hashing import canonical_json, load_safetensors
from reprotrain.ops import recording
from reprotrain.ops.recorder import record_step
from reprotrain.ops.recording import _crc
from reprotrain.pipeline.data import PipelineLoaders
from reprotrain.pipeline.recipe import build, resolve_recipe

#: A model, one batch, and the loss of that model on that batch.
Workload = tuple[nn.Module, Any, Callable[[nn.Module, Any], torch.Tensor]]


def pipeline_model(workload: str) -> Workload:
    """The workload's LightningModule, its first training batch, and its training_step."""
    with train_workspace(workload_params(workload)) as (_, params):
        recipe = resolve_recipe(params)
        source, module, _ = build(recipe)
        batch = next(iter(PipelineLoaders(source, seed=params.seed).train_dataloader()))
    return module, batch, lambda net, batch: net.training_step(batch, 0)


def mlp() -> Workload:
    """The ~10M-parameter MLP of benchmarks/overhead/trace_overhead.py, without Lightning."""
    batch = (torch.randn(64, 1024), torch.randint(0, 10, (64,)))
    return MLP().net, batch, lambda net, batch: F.cross_entropy(net(batch[0]), batch[1])


class _EmptyMode(TorchDispatchMode):
    """A dispatch mode that only runs each op: the floor any op recorder pays."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # as the recorder's mode

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    saved = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, saved)


def _texts_only(value: Any) -> int:
    return 0 if isinstance(value, torch.Tensor) else _crc(value)


def measure(name: str, workload: Callable[[], Workload], repeats: int, parts: bool) -> dict:
    configure_determinism(0, True)
    net, batch, loss_of = workload()
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)

    def step() -> None:
        loss = loss_of(net, batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    def recorded(index: int) -> None:
        with record_step(net, index, optimizer, steps=(index, index), out=out, batch=batch):
            step()

    def variant(index: int, *patches: tuple[Any, str, Any]) -> None:
        with contextlib.ExitStack() as stack:
            for patch in patches:
                stack.enter_context(_patched(*patch))
            recorded(index)

    def empty_mode(_index: int) -> None:
        with _EmptyMode():
            step()

    variants: dict[str, Callable[[int], None]] = {"recorded": recorded}
    if parts:  # what each part adds, by leaving it out
        variants["empty dispatch mode"] = empty_mode
        variants["recorded, no tensor hashed"] = lambda i: variant(
            i, (recording, "_crc", _texts_only)
        )
        variants["recorded, no file written"] = lambda i: variant(
            i, (recording.Recording, "write", lambda *_: None)
        )
    times: dict[str, list[float]] = {"plain": [], **{k: [] for k in variants}}
    with tempfile.TemporaryDirectory() as out:
        for index in range(3 + repeats):  # the first 3 rounds warm up
            for label, run in variants.items():  # each beside its own plain step
                start = time.perf_counter()
                step()
                middle = time.perf_counter()
                run(index)
                end = time.perf_counter()
                if index >= 3:
                    times["plain"].append(middle - start)
                    times[label].append(end - middle)
        ops = len(load_safetensors(Path(out) / "ops-rank0.safetensors")[0]["ops"])
    size = sum(p.numel() for p in net.parameters())
    medians = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    result = {
        "model": f"{name} ({size:,} parameters, batch {len(batch[0])})",
        "ops_per_step": ops,
        "plain_ms": medians["plain"],
        "recorded_ms": medians["recorded"],
        "ratio": medians["recorded"] / medians["plain"],
    }
    print(
        f"  {result['model']:45s} {ops:5d} ops  plain {result['plain_ms']:8.2f} ms  "
        f"recorded {result['recorded_ms']:8.2f} ms  ratio {result['ratio']:.2f}"
    )
    if parts:
        result["parts_ms"] = {k: medians[k] for k in variants if k != "recorded"}
        for label, value in result["parts_ms"].items():
            print(f"    {label:40s} {value:8.2f} ms  ratio {value / medians['plain']:.2f}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--json", type=Path, help="also write the figures here as JSON")
    parser.add_argument(
        "--parts", action="store_true", help="also time variants that leave one part out"
    )
    add_workload_argument(parser)
    cli = parser.parse_args()
    reexec_with_fixed_hash_seed()
    if cli.threads:
        torch.set_num_threads(cli.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {cli.repeats} repeats")
    results = [
        measure(cli.workload, lambda: pipeline_model(cli.workload), cli.repeats, cli.parts),
        measure("MLP", mlp, cli.repeats, cli.parts),
    ]
    if cli.json:
        atomic_write_text(cli.json, canonical_json({"torch": torch.__version__, "models": results}))


if __name__ == "__main__":
    main()
