"""Stage ``train``: prepared data -> ``model.safetensors``, metrics and curves.

Reads top to bottom: configure determinism (before anything touches CUDA),
load the prepared data, fit with Lightning, then write every output
atomically. Nothing written contains a time, a path, a host name or a logger
version folder, so identical training gives identical bytes: the weights as
safetensors (the resolved params and the determinism settings ride along in
its metadata), metrics as canonical JSON, curves as CSV for ``dvc plots``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import warnings
from pathlib import Path

import lightning as L
from safetensors.torch import save_file

from reprotrain.atomic import atomic_path, atomic_write_text
from reprotrain.determinism import DeterminismSettings, configure_determinism
from reprotrain.hashing import canonical_json, safetensors_metadata
from reprotrain.pipeline.config import Params
from reprotrain.pipeline.curves import MemoryLogger
from reprotrain.pipeline.data import PreparedData, PreparedDataModule, load_prepared
from reprotrain.pipeline.model import Classifier

#: The params.yaml keys this stage reads; dvc.yaml lists exactly these.
PARAMS = (
    "seed",
    "deterministic",
    "data.batch_size",
    "data.num_workers",
    "data.augment",
    "model",
    "train",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", type=Path, required=True, help="prepared dataset file")
    parser.add_argument("--model", type=Path, required=True, help="weights to write")
    parser.add_argument("--metrics", type=Path, required=True, help="training metrics JSON")
    parser.add_argument("--plots", type=Path, required=True, help="folder for curve CSVs")


def run(params: Params, args: argparse.Namespace) -> str:
    settings = configure_determinism(params.seed, params.deterministic)
    data = load_prepared(args.data)
    module, logger = fit(params, data, settings)

    weights = {name: t.detach().cpu().contiguous() for name, t in module.net.state_dict().items()}
    metadata = safetensors_metadata(
        {
            "params": dataclasses.asdict(params),
            "input_shape": list(data.input_shape),
            "num_classes": data.num_classes,
            "determinism": settings.as_dict(),
        }
    )
    val_loss, val_acc = logger.rows("val_loss"), logger.rows("val_acc")
    train_loss = logger.rows("train_loss")
    metrics = {
        "epochs": len(val_loss),
        "steps": len(train_loss),
        "train_loss": train_loss[-1][1],
        "val_loss": val_loss[-1][1],
        "val_acc": val_acc[-1][1],
    }
    with atomic_path(args.model) as tmp:
        save_file(weights, tmp, metadata=metadata)
    atomic_write_text(args.metrics, canonical_json(metrics))
    atomic_write_text(args.plots / "train_loss.csv", _csv(("step", "train_loss"), train_loss))
    val_rows = [
        (epoch, loss, acc)
        for epoch, ((_, loss), (_, acc)) in enumerate(zip(val_loss, val_acc, strict=True))
    ]
    atomic_write_text(args.plots / "val.csv", _csv(("epoch", "val_loss", "val_acc"), val_rows))
    return f"trained {metrics['epochs']} epochs, val_acc {val_acc[-1][1]:.4f} -> {args.model}"


def fit(
    params: Params, data: PreparedData, settings: DeterminismSettings
) -> tuple[Classifier, MemoryLogger]:
    """Build the model and data module from ``params`` and fit them with Lightning."""
    module = Classifier(params.model, params.train, data.input_shape, data.num_classes)
    datamodule = PreparedDataModule(
        data,
        batch_size=params.data.batch_size,
        num_workers=params.data.num_workers,
        augment=params.data.augment,
        seed=params.seed,
    )
    logger = MemoryLogger()
    # Lightning 2.6 trips over its own use of a deprecated torch pytree API on every fit.
    warnings.filterwarnings("ignore", message=r".*LeafSpec.*is deprecated")
    interactive = sys.stderr.isatty() and not os.environ.get("CI")
    if not interactive:
        logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    trainer = L.Trainer(
        accelerator=params.train.accelerator,
        devices=params.train.devices,
        precision=params.train.precision,
        max_epochs=params.train.max_epochs,
        logger=logger,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=interactive,
        num_sanity_val_steps=0,
        **settings.trainer_flags(),
    )
    trainer.fit(module, datamodule=datamodule)
    return module, logger


def _csv(header: tuple[str, ...], rows: list[tuple[float, ...]]) -> str:
    lines = [",".join(header)] + [",".join(repr(v) for v in row) for row in rows]
    return "\n".join(lines) + "\n"
