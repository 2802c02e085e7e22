"""Stage ``evaluate``: trained weights + test split -> ``metrics.json`` and a confusion CSV.

The network is rebuilt from the params stored in the weights file itself, so
this stage reads nothing from ``params.yaml``; it also runs under the CPU
profile the weights were trained with (:mod:`reprotrain.cpuprofile`), whose
variables the CLI exported at start from ``params.yaml``. With ``--dvc-lock`` the data
and the weights are first checked against the md5 DVC recorded: a corrupted
or tampered file is refused before it is read. It runs on the CPU in eval mode
(no dropout, no randomness) with deterministic algorithms on, in fixed-size
chunks: identical weights give identical metric bytes.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from reprotrain.atomic import atomic_write_text
from reprotrain.determinism import DeterminismError
from reprotrain.hashing import canonical_json, load_safetensors
from reprotrain.pipeline.command import Command, add_paths
from reprotrain.pipeline.config import Params, parse_params
from reprotrain.pipeline.errors import DataError
from reprotrain.provenance.dvcchecksum import verify_dvc_checksum

if TYPE_CHECKING:  # torch loads when the stage runs, not when the CLI reads its options
    import torch

#: The params.yaml keys this stage reads: none, the model file carries them.
PARAMS: tuple[str, ...] = ()
_CHUNK = 1024


def add_arguments(parser: argparse.ArgumentParser) -> None:
    required = {
        "data": "prepared dataset file",
        "model": "trained weights",
        "metrics": "test metrics JSON",
        "plots": "folder for confusion CSV",
    }
    add_paths(parser, required, required=True)
    add_paths(parser, {"dvc-lock": "verify --data and --model against it"}, required=False)


#: Restarts under the CPU profile the weights were trained with (the CLI reads it from them).
COMMAND = Command("score the test split", add_arguments, restarts=True)


def run(_: Params | None, args: argparse.Namespace) -> str:
    import torch
    from torch.nn import functional as F

    from reprotrain.pipeline.data import load_prepared

    if args.dvc_lock:
        for path in (args.data, args.model):
            if not path.is_file():
                raise DataError(f"{path}: not found; run `dvc repro`")
            verify_dvc_checksum(path, args.dvc_lock)
    data = load_prepared(args.data)
    net, trained = load_network(args.model)
    if problems := trained.cpu.to_profile().apply():
        raise DeterminismError(
            f"{args.model} was trained under cpu.profile {trained.cpu.profile}: {problems[0]}"
        )
    torch.use_deterministic_algorithms(True)
    x, y = data.split("test")
    with torch.no_grad():
        logits = torch.cat([net(chunk) for chunk in x.split(_CHUNK)])
    predicted = logits.argmax(dim=1)
    metrics = {
        "test_samples": len(y),
        "test_loss": F.cross_entropy(logits, y).item(),
        "test_acc": (predicted == y).double().mean().item(),
    }
    atomic_write_text(args.metrics, canonical_json(metrics))
    confusion = ["actual,predicted"] + [
        f"{a},{p}" for a, p in zip(y.tolist(), predicted.tolist(), strict=True)
    ]
    atomic_write_text(args.plots / "confusion.csv", "\n".join(confusion) + "\n")
    return f"test_acc {metrics['test_acc']:.4f} on {len(y)} samples -> {args.metrics}"


def load_network(path: Path) -> tuple[torch.nn.Module, Params]:
    """The network rebuilt from a weights file (no pickle), in eval mode, and its params."""
    from safetensors import SafetensorError

    from reprotrain.pipeline.model import build_network

    try:
        weights, meta = load_safetensors(path)
        params = parse_params(meta["params"], source=f"{path} metadata")
        shape = tuple(meta["input_shape"])
        classes = int(meta["num_classes"])
    except FileNotFoundError:
        raise DataError(f"{path}: model not found; run `dvc repro train`") from None
    except (SafetensorError, OSError, KeyError, ValueError) as err:
        raise DataError(f"{path}: not a reprotrain model file ({err}); retrain it") from None
    net = build_network(params.model, shape, classes)
    net.load_state_dict(weights, strict=True)
    return net.eval(), params
