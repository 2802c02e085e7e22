"""The train stage's files from a fit: weights with the params that made them, metrics, curves.

Written atomically, with nothing in them that is not decided by the training
(no time, path, host name or logger version folder), so two runs of one run ID
write the same bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reprotrain.atomic import atomic_write_safetensors, atomic_write_text
from reprotrain.determinism import DeterminismSettings
from reprotrain.hashing import canonical_json, safetensors_metadata
from reprotrain.pipeline.config import Params
from reprotrain.pipeline.curves import EPOCH, STEP, TRAIN_LOSS
from reprotrain.pipeline.errors import DataError
from reprotrain.pipeline.recipe import Recipe

if TYPE_CHECKING:
    from reprotrain.pipeline.training import Fitted


def write_outputs(
    args: argparse.Namespace,
    params: Params,
    recipe: Recipe,
    settings: DeterminismSettings,
    fitted: Fitted,
) -> dict[str, Path]:
    """Weights (with the params and determinism in force), metrics and curve CSVs, atomically.

    The weights file holds the module's whole ``state_dict``, each name as its
    own tensor (tied weights, as nanoGPT ties its embedding and head, are
    written once per name and tie again when evaluate loads them strictly into
    a fresh instance), and, as metadata, the params with ``model`` and ``data``
    fully resolved (the linked arguments included): what evaluate needs to
    rebuild the module, and nothing of one recipe's own. The metrics hold the
    epochs and steps trained (as the trainer counts them, whatever was
    logged), the last ``train_loss`` (absent if no step had a loss) and the
    last value of each metric the module logged (``null`` where it is not finite: JSON
    has no NaN). Every file's content is made before the first is written.

    Raises DataError, writing nothing, where training diverged: the last ``train_loss``
    or a floating-point weight is not finite (a step with a non-finite loss that the run
    recovered from, as a loss scaler skips one, is not refused).
    """
    state = fitted.module.state_dict()
    weights = {name: t.detach().cpu().contiguous() for name, t in state.items()}
    refuse_diverged(fitted.logger.rows(TRAIN_LOSS), weights)
    recorded = resolved_params(params, recipe, fitted.linked)
    if params.train.world_size_invariant:
        # The layout and the worker count did not decide these weights: record one process
        # without workers, so the file is the same at any world size and worker count
        # (run.json's inputs name the mode).
        one = {"devices": 1, "num_nodes": 1, "strategy": "single_device"}
        recorded["train"] = {**recorded["train"], **one}
        data = recorded["data"]
        if data is not None and "num_workers" in data["init_args"]:
            recorded["data"] = {**data, "init_args": {**data["init_args"], "num_workers": 0}}
    if params.cpu.to_profile().portable:
        # cpu.threads decided the speed alone: out of the file, so any count writes these
        # bytes (evaluate, which reads its params from here, then runs on one thread).
        recorded["cpu"] = {k: v for k, v in recorded["cpu"].items() if k != "threads"}
    metadata = safetensors_metadata({"params": recorded, "determinism": settings.as_dict()})
    logger = fitted.logger
    train_loss = logger.rows(TRAIN_LOSS)
    step_names, step_rows = logger.table(STEP, first=(TRAIN_LOSS,))
    epoch_names, epoch_rows = logger.table(EPOCH)
    last = {name: rows[-1][1] for name in epoch_names if (rows := logger.rows(name, EPOCH))}
    metrics = {
        "epochs": fitted.epochs,
        "steps": fitted.steps,
        **({TRAIN_LOSS: train_loss[-1][1]} if train_loss else {}),
        **{name: logger.rows(name)[-1][1] for name in step_names if name != TRAIN_LOSS},
        **last,
    }
    texts = {
        args.metrics: canonical_json(
            {k: v if math.isfinite(v) else None for k, v in metrics.items()}
        ),
        args.plots / "train_loss.csv": _csv(("step", *step_names), step_rows),
        args.plots / "val.csv": _csv(("epoch", *epoch_names), epoch_rows),
    }
    atomic_write_safetensors(args.model, weights, metadata)
    for path, text in texts.items():
        atomic_write_text(path, text)
    return {"model": args.model, "metrics": args.metrics}


def refuse_diverged(losses: list[tuple[int, float]], weights: dict[str, Any]) -> None:
    """Raise DataError where the last loss or a floating-point weight is not finite."""
    bad = [n for n, t in weights.items() if t.is_floating_point() and not t.isfinite().all()]
    last_bad = bool(losses) and not math.isfinite(losses[-1][1])
    if not last_bad and not bad:
        return
    first = next((step for step, value in losses if not math.isfinite(value)), None)
    found = [f"train_loss is {losses[-1][1]} at the last step, first at step {first}"] * last_bad
    if bad:
        found.append(f"{len(bad)} weight tensors are not finite ({bad[0]} first)")
    raise DataError(
        f"training diverged: {' and '.join(found)}; no output written: lower the learning rate "
        "(under model.init_args) or check the data for extreme values"
    )


def resolved_params(params: Params, recipe: Recipe, linked: dict[str, Any]) -> dict[str, Any]:
    """``params`` as a mapping, ``model`` and ``data`` fully resolved; no empty section."""
    tree = {name: value for name, value in dataclasses.asdict(params).items() if value is not None}
    tree.update(recipe.record(linked))
    return tree


def _csv(header: tuple[str, ...], rows: list[list[Any]]) -> str:
    """A CSV of ``rows`` (an empty cell where a metric was not logged); a name with a comma
    or a quote is quoted."""
    quoted = [f'"{h.replace(chr(34), chr(34) * 2)}"' if "," in h or '"' in h else h for h in header]
    lines = [",".join(quoted)] + [",".join(repr(v) if v != "" else "" for v in row) for row in rows]
    return "\n".join(lines) + "\n"
