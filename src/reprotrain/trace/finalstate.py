"""The state a fit ends with: parameters, buffers and optimizer state, as tensors.

:func:`final_state` collects it from a module and its optimizers in three
parts, each a flat name -> tensor map: ``parameters`` (all of them, frozen
ones too), ``buffers`` (BatchNorm's running statistics and counters) and
``optimizer`` (``<optimizer>/<param index>/<key>``, e.g. ``0/3/exp_avg``;
Adam's ``step`` included; empty where ``configure_optimizers`` returned
``None``, which Lightning allows: its stand-in optimizer keeps no state).
:func:`final_fingerprints` reduces each part to
one int64 (:mod:`reprotrain.fingerprint`, keyed by name, dtype and shape; a
sparse, quantized or nested tensor by its parts), what
:class:`~reprotrain.trace.callback.TraceCallback` writes at the end of fit so a
divergence after its last sampled step, or in a buffer or optimizer state,
still shows.

:class:`FinalStateCallback` writes the same tensors as one safetensors file
at the end of fit (``parameters/…``, ``buffers/…``, ``optimizer/…``; the
optimizers' hyperparameters in its metadata, one key): the same state gives
the same bytes in any folder and process, unlike a Lightning ``.ckpt``,
which records its own paths. For ``Trainer(callbacks=[...])`` or a
Hydra / LightningCLI callbacks entry (``class_path:
reprotrain.trace.finalstate.FinalStateCallback``). Under DDP rank 0 writes; a
sharded model (FSDP) is written as rank 0's shard, so it is not supported.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.optim import Optimizer

from reprotrain.atomic import atomic_write_safetensors
from reprotrain.fingerprint import fingerprints, host_fingerprints
from reprotrain.hashing import safetensors_metadata
from reprotrain.tensorparts import shape_of
from reprotrain.trace.rows import Mixer, leaves, tensor_key
from reprotrain.trace.tracefile import FINAL_PARTS

__all__ = ["FINAL_PARTS", "FinalStateCallback", "final_fingerprints", "final_state"]

FORMAT, VERSION = "reprotrain.final_state", 1


def final_state(
    module: torch.nn.Module, optimizers: Iterable[Optimizer]
) -> dict[str, dict[str, torch.Tensor]]:
    """Parameters, buffers and optimizer state tensors, each part a flat name -> tensor map."""
    optimizer: dict[str, torch.Tensor] = {}
    for index, opt in enumerate(optimizers):
        # Lightning's stand-in for no optimizer (_MockOptimizer) has an empty state_dict
        for path, tensor in leaves(opt.state_dict().get("state", {}), str(index)):
            optimizer[path.replace(".", "/")] = tensor
    return {
        "parameters": {name: p.detach() for name, p in module.named_parameters()},
        "buffers": {name: b.detach() for name, b in module.named_buffers()},
        "optimizer": optimizer,
    }


def final_fingerprints(state: dict[str, dict[str, torch.Tensor]]) -> list[int]:
    """One int64 per part of :func:`final_state`, in :data:`FINAL_PARTS` order (0: empty)."""
    out = []
    for part in FINAL_PARTS:
        named = sorted(state[part].items())
        tensors = [t for _, t in named]
        if all(t.is_cpu for t in tensors):
            values = host_fingerprints(tensors)
        else:  # one device, one copy of the fingerprints back
            device = next(t.device for t in tensors if not t.is_cpu)
            values = fingerprints([t.to(device) for t in tensors], device).tolist()
        keys = [tensor_key(n, t.dtype, shape_of(t)) for n, t in named]
        out.append(Mixer(keys, torch.device("cpu")).host(values) if named else 0)
    return out


class FinalStateCallback(Callback):
    """Write the final parameters, buffers and optimizer state as safetensors at the end of fit.

    ``path``: where (relative to the working directory, as any path); default
    ``final_state.safetensors`` in the Trainer's ``default_root_dir``.
    """

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = None if path is None else Path(path)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        path = self.path or Path(trainer.default_root_dir) / "final_state.safetensors"
        write_final_state(path, pl_module, trainer.optimizers)


def write_final_state(
    path: str | Path, module: torch.nn.Module, optimizers: Iterable[Optimizer]
) -> None:
    """The state of ``module`` and ``optimizers`` as one safetensors file, atomically."""
    optimizers = list(optimizers)
    state = final_state(module, optimizers)
    # copies: safetensors refuses tensors that share memory (tied weights)
    tensors = {
        f"{part}/{name}": tensor.cpu().clone()
        for part in FINAL_PARTS
        for name, tensor in state[part].items()
    }
    groups = [
        [{key: repr(value) for key, value in group.items() if key != "params"} for group in groups]
        for groups in (opt.state_dict().get("param_groups", []) for opt in optimizers)
    ]
    metadata: dict[str, Any] = {"format": FORMAT, "version": VERSION, "param_groups": groups}
    atomic_write_safetensors(path, tensors, safetensors_metadata(metadata))
