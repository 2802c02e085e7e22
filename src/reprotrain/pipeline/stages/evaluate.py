"""Stage ``evaluate``: trained weights + the data module's test split -> ``metrics.json``.

The module is rebuilt from what the weights file itself records (its params,
``model`` and ``data`` fully resolved, the arguments linked from the data
included), so this stage reads nothing from ``params.yaml`` and works for
any module that follows the contract (docs/your-model.md): it sets the data
module up for ``test`` and runs Lightning's test loop over the pipeline's test
loader, on the CPU in eval mode with deterministic algorithms on. The weights
load strictly where Lightning's own ``trainer.test(ckpt_path=...)`` restores
them: after the module's ``setup("test")`` and ``configure_model()`` ran, so
layers built there (as Lightning's docs show) are there to load into.
``metrics.json`` holds every metric the module's ``test_step`` logs (epoch
means) and ``test_samples``, the samples the test loop saw: per batch, the
first dimension its tensors share (one per item where the loader does not
batch). Where that cannot tell (a batch with no tensor or tensors that differ
in it, an ``IterableDataset`` the loader does not batch), ``test_samples`` is
left out and the stage's line says why. Identical weights give identical
metric bytes. Under ``dvc repro`` a failed evaluate puts the earlier
``metrics.json`` back (:mod:`reprotrain.pipeline.kept`). It runs under the CPU
profile the weights were trained with (:mod:`reprotrain.cpu.profile`), whose
variables the CLI exported at start from the weights file. With ``--dvc-lock`` each
``--data`` file and the weights are first checked against the md5 DVC
recorded: a corrupted or tampered file is refused before it is read.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reprotrain.atomic import atomic_write_text
from reprotrain.determinism import DeterminismError
from reprotrain.hashing import canonical_json, load_safetensors
from reprotrain.pipeline.command import Command, add_data_files, add_paths
from reprotrain.pipeline.config import Params
from reprotrain.pipeline.errors import DataError
from reprotrain.pipeline.params_file import parse_recorded_params
from reprotrain.provenance.dvcchecksum import verify_dvc_checksum

if TYPE_CHECKING:  # torch loads when the stage runs, not when the CLI reads its options
    import lightning as L
    import torch

#: The params.yaml keys this stage reads: none, the model file carries them.
PARAMS: tuple[str, ...] = ()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_data_files(parser, "checked against --dvc-lock")
    add_paths(parser, {"model": "trained weights", "metrics": "test metrics JSON"}, required=True)
    add_paths(parser, {"dvc-lock": "verify --data and --model against it"}, required=False)


#: Restarts under the CPU profile the weights were trained with (the CLI reads it from them).
COMMAND = Command("score the test split", add_arguments, restarts=True)


def run(_: Params | None, args: argparse.Namespace) -> str:
    """Score; on any failure under ``dvc repro``, the earlier metrics DVC deleted are put back
    (:mod:`reprotrain.pipeline.kept`) and the error says so."""
    from reprotrain.pipeline.kept import drop, evaluate_outputs, note_put_back, put_back

    try:
        done = _evaluate(args)
    except BaseException as err:
        if restored := put_back(evaluate_outputs(args)):
            note_put_back(err, restored)
        raise
    drop(evaluate_outputs(args))
    return done


def _evaluate(args: argparse.Namespace) -> str:
    import lightning as L
    import torch

    from reprotrain.pipeline.contract import check_scoring
    from reprotrain.pipeline.data import PipelineLoaders
    from reprotrain.pipeline.recipe import (
        hooks_skipped,
        rebuild_model,
        resolve_component,
        set_up_model,
    )
    from reprotrain.pipeline.training import quiet_lightning
    from reprotrain.seeding import seed_at_start

    if args.dvc_lock:
        for path in (*args.data, args.model):
            if not path.exists():
                raise DataError(f"{path}: not found; run `dvc repro`")
            verify_dvc_checksum(path, args.dvc_lock)
    weights, recorded, trained = read_model_file(args.model)
    if problems := trained.cpu.to_profile().apply():
        raise DeterminismError(
            f"{args.model} was trained under cpu.profile {trained.cpu.profile}: {problems[0]}"
        )
    torch.use_deterministic_algorithms(True)
    quiet_lightning()
    # As the train stage built them, from the run's seed, so a setup that splits the data
    # with the global generators draws the same split: the data module built and set up
    # first, else (data: null) the model, then its setup (Lightning's call is skipped).
    seed_at_start(trained.seed)
    if trained.data is None:
        module = source = rebuild_model(recorded, source=f"{args.model} metadata")
        check_scoring(type(module), trained.model.class_path, type(module), "model",
                      trained.model.class_path)  # fmt: skip
        set_up_model(module, "test", trained.model.class_path)
    else:
        source = resolve_component(trained.data, "data", L.LightningDataModule).instantiate()
        source.setup("test")
        module = rebuild_model(recorded, source=f"{args.model} metadata")
        check_scoring(type(module), trained.model.class_path, type(source), "data",
                      trained.data.class_path)  # fmt: skip
    loader = PipelineLoaders(source, seed=trained.seed).test_dataloader()
    hooks = scoring_hooks(weights, args.model, trained.model.class_path, loader)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        callbacks=[hooks],
    )
    with hooks_skipped(module, source):
        scores = _floats(trainer.test(module, dataloaders=loader, verbose=False)[0])
    counted = {} if hooks.samples is None else {"test_samples": hooks.samples}
    metrics = {**counted, **scores}
    atomic_write_text(args.metrics, canonical_json(metrics))
    shown = ", ".join(f"{k} {v:.4f}" for k, v in sorted(scores.items()))
    if hooks.samples is None:
        return f"{shown} -> {args.metrics} (test_samples left out: {hooks.uncounted})"
    return f"{shown} on {metrics['test_samples']} samples -> {args.metrics}"


def _floats(scores: dict[str, Any]) -> dict[str, float]:
    return {name: float(value) for name, value in scores.items()}


def read_model_file(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any], Params]:
    """A weights file's weights (no pickle), its model's record (to rebuild it, linked
    arguments included) and the params it was trained with."""
    from safetensors import SafetensorError

    try:
        weights, meta = load_safetensors(path)
        params = parse_recorded_params(meta["params"], source=f"{path} metadata")
    except FileNotFoundError:
        raise DataError(f"{path}: model not found; run `dvc repro train`") from None
    except (SafetensorError, OSError, KeyError, ValueError) as err:
        raise DataError(f"{path}: not a reprotrain model file ({err}); retrain it") from None
    return weights, meta["params"]["model"], params


def scoring_hooks(
    weights: dict[str, torch.Tensor], path: Path, class_path: str, loader: object
) -> L.Callback:
    """The callback that loads ``weights`` into the module at the test loop's start (the
    first callback hook after ``setup`` and ``configure_model``) and counts the samples the
    loop sees: ``.samples``, or None with the reason in ``.uncounted``."""
    import lightning as L
    from torch.utils.data import DataLoader, IterableDataset

    unbatched = isinstance(loader, DataLoader) and loader.batch_sampler is None
    stream = unbatched and isinstance(loader.dataset, IterableDataset)  # type: ignore[union-attr]

    class Scoring(L.Callback):
        samples: int | None = None if stream else 0
        uncounted = UNBATCHED_STREAM if stream else ""

        def on_test_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
            load_weights(module, weights, path, class_path)

        def on_test_batch_end(
            self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any,
            batch_idx: int, dataloader_idx: int = 0,
        ) -> None:  # fmt: skip
            if self.samples is None:
                return
            count = 1 if unbatched else samples_in(batch)  # a map-style item is one sample
            if isinstance(count, str):
                self.samples, self.uncounted = None, f"test batch {batch_idx} {count}"
            else:
                self.samples += count

    return Scoring()


#: Why ``test_samples`` is left out for a loader that does not batch an ``IterableDataset``.
UNBATCHED_STREAM = (
    "the test loader does not batch (batch_size=None) its IterableDataset, whose items "
    "need not be one sample each"
)


def samples_in(batch: object) -> int | str:
    """The samples in one batch: the first dimension all its tensors (of one or more
    dimensions) share; else why that is unknowable."""
    import torch

    sizes: set[int] = set()

    def visit(part: object) -> None:
        if isinstance(part, torch.Tensor):
            if part.ndim:
                sizes.add(part.shape[0])
        elif isinstance(part, Mapping):
            for value in part.values():
                visit(value)
        elif isinstance(part, (list, tuple)):
            for value in part:
                visit(value)
        elif dataclasses.is_dataclass(part) and not isinstance(part, type):
            for field in dataclasses.fields(part):
                visit(getattr(part, field.name))

    visit(batch)
    if len(sizes) == 1:
        return sizes.pop()
    if not sizes:
        return "holds no tensor with a batch dimension to count its samples by"
    shown = ", ".join(str(size) for size in sorted(sizes))
    return f"holds tensors that differ in their first dimension ({shown}): an ambiguous count"


def load_weights(
    module: L.LightningModule, weights: dict[str, torch.Tensor], path: Path, class_path: str
) -> None:
    """Load ``weights`` strictly; a mismatch is one line naming the keys (torch's own lines,
    less its heading) and what to do."""
    try:
        module.load_state_dict(weights, strict=True)
    except RuntimeError as err:
        lines = [line.strip().rstrip(".") for line in str(err).splitlines()[1:] if line.strip()]
        detail = "; ".join(lines) or str(err).strip()
        if len(detail) > DETAIL_CHARS:
            detail = detail[:DETAIL_CHARS] + "..."
        raise DataError(
            f"{path}: its weights do not fit {class_path} after its setup('test') and "
            f"configure_model() ran ({detail}); build every layer it trained with in __init__, "
            "in setup for every stage, or in configure_model, or, if its code changed since, "
            "retrain it (`dvc repro train`)"
        ) from None


#: The most of torch's mismatch detail one error line shows (a large model lists many keys).
DETAIL_CHARS = 400
