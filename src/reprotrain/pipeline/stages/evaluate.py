"""Stage ``evaluate``: trained weights + the data module's test split -> ``metrics.json``.

The module is rebuilt from what the weights file itself records (its params,
``model`` and ``data`` fully resolved, the arguments linked from the data
included), so this stage reads nothing from ``params.yaml`` and works for
any module that follows the contract (docs/your-model.md): it loads the
weights strictly, sets the data module up for ``test`` and runs Lightning's
test loop over the pipeline's test loader, on the CPU in eval mode with
deterministic algorithms on. ``metrics.json`` holds every metric the
module's ``test_step`` logs (epoch means) and ``test_samples``: identical
weights give identical metric bytes. It runs under the CPU profile the
weights were trained with (:mod:`reprotrain.cpuprofile`), whose variables the
CLI exported at start from the weights file. With ``--dvc-lock`` each
``--data`` file and the weights are first checked against the md5 DVC
recorded: a corrupted or tampered file is refused before it is read.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reprotrain.atomic import atomic_write_text
from reprotrain.determinism import DeterminismError
from reprotrain.hashing import canonical_json, load_safetensors
from reprotrain.pipeline.command import Command, add_data_files, add_paths
from reprotrain.pipeline.config import Params, parse_params
from reprotrain.pipeline.errors import DataError
from reprotrain.provenance.dvcchecksum import verify_dvc_checksum

if TYPE_CHECKING:  # torch loads when the stage runs, not when the CLI reads its options
    import lightning as L

#: The params.yaml keys this stage reads: none, the model file carries them.
PARAMS: tuple[str, ...] = ()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_data_files(parser, "checked against --dvc-lock")
    add_paths(parser, {"model": "trained weights", "metrics": "test metrics JSON"}, required=True)
    add_paths(parser, {"dvc-lock": "verify --data and --model against it"}, required=False)


#: Restarts under the CPU profile the weights were trained with (the CLI reads it from them).
COMMAND = Command("score the test split", add_arguments, restarts=True)


def run(_: Params | None, args: argparse.Namespace) -> str:
    import lightning as L
    import torch

    from reprotrain.pipeline.data import PipelineLoaders
    from reprotrain.pipeline.recipe import resolve_component
    from reprotrain.pipeline.training import quiet_lightning

    if args.dvc_lock:
        for path in (*args.data, args.model):
            if not path.exists():
                raise DataError(f"{path}: not found; run `dvc repro`")
            verify_dvc_checksum(path, args.dvc_lock)
    module, trained = load_module(args.model)
    if problems := trained.cpu.to_profile().apply():
        raise DeterminismError(
            f"{args.model} was trained under cpu.profile {trained.cpu.profile}: {problems[0]}"
        )
    torch.use_deterministic_algorithms(True)
    quiet_lightning()
    source = resolve_component(trained.data, "data", L.LightningDataModule).instantiate()
    source.setup("test")
    loader = PipelineLoaders(source, seed=trained.seed).test_dataloader()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
    )
    scores = _floats(trainer.test(module, dataloaders=loader, verbose=False)[0])
    metrics = {"test_samples": len(loader.dataset), **scores}  # type: ignore[arg-type]
    atomic_write_text(args.metrics, canonical_json(metrics))
    shown = ", ".join(f"{k} {v:.4f}" for k, v in sorted(scores.items()))
    return f"{shown} on {metrics['test_samples']} samples -> {args.metrics}"


def _floats(scores: dict[str, Any]) -> dict[str, float]:
    return {name: float(value) for name, value in scores.items()}


def load_module(path: Path) -> tuple[L.LightningModule, Params]:
    """The module rebuilt from a weights file (no pickle), weights loaded, and its params."""
    from safetensors import SafetensorError

    from reprotrain.pipeline.recipe import rebuild_model

    try:
        weights, meta = load_safetensors(path)
        params = parse_params(meta["params"], source=f"{path} metadata")
    except FileNotFoundError:
        raise DataError(f"{path}: model not found; run `dvc repro train`") from None
    except (SafetensorError, OSError, KeyError, ValueError) as err:
        raise DataError(f"{path}: not a reprotrain model file ({err}); retrain it") from None
    module = rebuild_model(meta["params"]["model"], source=f"{path} metadata")
    try:
        module.load_state_dict(weights, strict=True)
    except RuntimeError as err:
        first = str(err).splitlines()[0]
        message = f"{path}: its weights do not fit {params.model.class_path} ({first})"
        raise DataError(message) from None
    return module.eval(), params
