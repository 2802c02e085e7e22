"""What a user's LightningModule and LightningDataModule must provide, checked before training.

The contract is written out in docs/your-model.md; this module checks what
can be checked, each failure one :class:`~reprotrain.pipeline.config.ConfigError`
line naming the class, what is missing and why the pipeline needs it.

:func:`check_recipe` looks at the classes and the resolved arguments only
(nothing is built, no data is read), so the ``env`` stage runs it before DVC
deletes any later stage's outputs: a module that cannot keep a promise is
refused there. :func:`check_datasets` looks at the datasets a set-up data
module gives; the train stage runs it before the first step (an iterable
dataset cannot be resumed mid-epoch, sharded or cut into micro-batches).

Why the data module gives datasets and never its own loaders: the training
order is where bitwise reruns, mid-epoch resume, DDP sharding and
world-size invariance live, so the pipeline builds every loader
(:class:`~reprotrain.pipeline.data.PipelineLoaders`). A data module with its
own ``train_dataloader`` (its own sampler or shuffle) could keep none of
them after a SIGTERM, which any run may meet, so it is refused in every mode.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from reprotrain.pipeline.config import ConfigError, Params, check_invariant_layout
from reprotrain.pipeline.data import map_style
from reprotrain.pipeline.errors import DataError
from reprotrain.pipeline.recipe import Recipe, linked_arguments

#: Data module methods the pipeline calls after ``setup``; each returns a map-style dataset.
DATASETS = ("train_dataset", "val_dataset", "test_dataset")
#: Data module arguments the pipeline reads to build the loaders.
LOADER_ARGUMENTS = ("batch_size", "num_workers")
#: Lightning hooks a data module must leave to the pipeline.
LOADER_HOOKS = ("train_dataloader", "val_dataloader", "test_dataloader")
DOCS = "docs/your-model.md"


def check_recipe(params: Params, recipe: Recipe) -> None:
    """Refuse classes or arguments that cannot meet what ``params`` asks; one line."""
    import lightning as L

    model, data = recipe.model, recipe.data
    for hook, why in (
        ("training_step", "the pipeline trains on the loss it returns"),
        ("configure_optimizers", "the module chooses its own optimizer"),
        ("test_step", "the evaluate stage scores the test split with the metrics it logs"),
    ):
        if not _overrides(model.cls, L.LightningModule, hook):
            raise ConfigError(
                f"model.class_path: {model.class_path} defines no {hook}; {why} ({DOCS})"
            )
    for hook in LOADER_HOOKS:
        if _overrides(data.cls, L.LightningDataModule, hook):
            raise ConfigError(
                f"data.class_path: {data.class_path} defines its own {hook}; its sampler and "
                "shuffle would decide the order, which then survives no mid-epoch resume, DDP "
                f"sharding or world-size invariance: return the dataset from "
                f"{hook.replace('dataloader', 'dataset')}() and reprotrain builds the loader "
                f"({DOCS})"
            )
    for method in DATASETS:
        if not callable(getattr(data.cls, method, None)):
            raise ConfigError(
                f"data.class_path: {data.class_path} has no {method}(); the pipeline builds "
                f"its loaders from the datasets {', '.join(m + '()' for m in DATASETS)} give "
                f"after setup(stage) ({DOCS})"
            )
    for name in LOADER_ARGUMENTS:
        if type(data.init_args.get(name)) is not int:
            raise ConfigError(
                f"data.class_path: {data.class_path} takes no integer argument {name!r}; the "
                f"pipeline builds the loaders with the data module's {', '.join(LOADER_ARGUMENTS)}"
                f" ({DOCS})"
            )
    parameters = inspect.signature(model.cls.__init__).parameters
    for name in model.provided:
        if name not in parameters:
            raise ConfigError(
                f"data.class_path: {data.class_path} links {name!r} to the model (model_links), "
                f"but {model.class_path} takes no argument {name!r}; add it or drop the link"
            )
    if params.train.world_size_invariant:
        check_invariant_layout(params.train, data.init_args["batch_size"], "params")


def check_data_files(recipe: Recipe, data: list[Path]) -> None:
    """Refuse a file the data module names that the run ID would not cover.

    Any top-level ``data.init_args`` string that names an existing file or folder
    (a shard folder, docs/data.md) is data the module reads; it must be one of the
    train stage's ``--data`` paths, which are checked against ``dvc.lock`` and
    hashed into the run ID. Otherwise a changed file would train other bits under
    the same run ID.
    """
    listed = [path.resolve() for path in data]
    for name, value in recipe.data.init_args.items():
        if not isinstance(value, str) or not value or not Path(value).exists():
            continue
        if Path(value).resolve() not in listed:
            kind = "folder" if Path(value).is_dir() else "file"
            raise ConfigError(
                f"data.init_args.{name}: {value} is read by {recipe.data.class_path} but is not "
                f"a --data {kind} of the train stage, so the run ID would not cover it; add "
                f"`--data {value}` to the train stage's cmd in dvc.yaml (and {value} to its deps)"
            )


def check_datasets(datamodule: Any) -> None:
    """Refuse a set-up data module whose datasets are not map-style (see module doc)."""
    for method in DATASETS:
        map_style(getattr(datamodule, method)(), method.removesuffix("_dataset"))


def _overrides(cls: type, base: type, name: str) -> bool:
    """Whether ``cls`` (or a class between it and ``base``) defines ``name`` itself."""
    return getattr(cls, name, None) is not getattr(base, name, None)


def check_world_size_invariance(params: Params, recipe: Recipe) -> None:
    """Under ``train.world_size_invariant``, refuse a model with batch norm that tracks running
    statistics, in one line, before DVC deletes any output (the env stage calls it).

    The model is built on the meta device (no memory, whatever its size), with its linked
    arguments from the data module set up for ``fit``; where that setup cannot run yet
    (the prepared data it reads is made later), the train stage refuses instead.
    """
    if not params.train.world_size_invariant:
        return
    import torch

    from reprotrain.distributed.worldsize import refuse_tracked_batch_norm

    try:
        linked = linked_arguments(recipe)[1] if recipe.model.provided else {}
    except (OSError, DataError):  # the data is not there yet: train checks the model
        return
    with torch.device("meta"):
        model = recipe.model.instantiate(**linked)
    if problem := refuse_tracked_batch_norm(model):
        raise ConfigError(
            f"train.world_size_invariant: true, but model.class_path: {recipe.model.class_path} "
            f"has {problem}"
        )
