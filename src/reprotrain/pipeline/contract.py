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

A data module either builds its own loaders (``train_dataloader()``...,
as Lightning's docs write them) or gives datasets (``train_dataset()``...).
Own loaders are taken apart and rebuilt with the pipeline's seeded order
(:mod:`reprotrain.pipeline.own_loaders`); one whose order cannot be replaced
(an iterable dataset, a custom sampler) keeps bitwise reruns, and the
guarantees that need the pipeline's order are refused by name:
:func:`check_loaders` does it in the ``env`` stage where the data module can
be set up there, the train stage otherwise.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from reprotrain.pipeline.config import ConfigError, Params
from reprotrain.pipeline.data import map_style
from reprotrain.pipeline.errors import DataError
from reprotrain.pipeline.own_loaders import (
    OwnLoader,
    defines_own_loader,
    gives_dataset,
    gives_split,
    order_problem,
    own_loader,
)
from reprotrain.pipeline.params_file import check_invariant_layout
from reprotrain.pipeline.recipe import Recipe, ResolvedComponent, linked_arguments

#: The splits; for each, a data module defines ``<split>_dataloader`` or ``<split>_dataset``.
SPLITS = ("train", "val", "test")
#: What each split is for; a split left out entirely (val) is not validated, as in Lightning.
NEEDED = {
    "train": "the train stage trains on it",
    "test": "the evaluate stage scores it with the metrics test_step logs",
}
#: Arguments of a data module that gives datasets, with which the pipeline builds its loaders,
#: and their defaults (None: required; no guarantee needs workers, so none means none).
LOADER_ARGUMENTS: dict[str, int | None] = {"batch_size": None, "num_workers": 0}
DOCS = "docs/your-model.md"


#: The model's hooks the pipeline calls, and why; ``test_step`` only where a stage scores it.
HOOKS = {
    "training_step": "the pipeline trains on the loss it returns",
    "configure_optimizers": "the module chooses its own optimizer",
    "test_step": "the evaluate stage scores the test split with the metrics it logs",
}


def check_recipe(params: Params, recipe: Recipe, scores: bool = True) -> None:
    """Refuse classes or arguments that cannot meet what ``params`` asks; one line.

    ``scores``: whether the pipeline has an evaluate stage, which needs ``test_step`` and a
    test split (:func:`check_scoring`); a pipeline without one trains a model without them.
    """
    import lightning as L

    model = recipe.model
    # The data source: the data module, else (data: null) the model's own loaders
    data = recipe.data if recipe.data is not None else model
    for hook, why in HOOKS.items():
        if hook == "test_step" and not scores:
            continue
        if not _overrides(model.cls, L.LightningModule, hook):
            raise ConfigError(
                f"model.class_path: {model.class_path} defines no {hook}; {why} ({DOCS})"
            )
    gives_datasets = []
    for split in SPLITS:
        if gives_dataset(data.cls, split):
            gives_datasets.append(split)
        elif not gives_split(data.cls, split):
            if split not in NEEDED or (split == "test" and not scores):
                continue  # no validation (or no scoring), as Lightning runs none without one
            fix = "define one of them"
            if recipe.data is None:  # the model gives the data
                fix += " in the model, or name a LightningDataModule under data"
            raise ConfigError(
                f"{data.key}.class_path: {data.class_path} defines neither {split}_dataloader() "
                f"nor {split}_dataset(); {NEEDED[split]}: {fix} ({DOCS})"
            )
    if gives_datasets and not defines_own_loader(data.cls, "train"):
        for name, default in LOADER_ARGUMENTS.items():
            if type(data.init_args.get(name, default)) is not int:
                raise ConfigError(
                    f"{data.key}.class_path: {data.class_path} gives datasets but takes no integer "
                    f"argument {name!r}; the pipeline builds those loaders with batch_size "
                    f"(and num_workers, 0 if not given) (or define your own *_dataloader()) "
                    f"({DOCS})"
                )
    parameters = inspect.signature(model.cls.__init__).parameters
    for name in model.provided:
        if name not in parameters:
            raise ConfigError(
                f"data.class_path: {data.class_path} links {name!r} to the model (model_links), "
                f"but {model.class_path} takes no argument {name!r}; add it or drop the link"
            )
    if params.train.world_size_invariant and type(data.init_args.get("batch_size")) is int:
        check_invariant_layout(params.train, data.init_args["batch_size"], "params")


def check_scoring(
    model: type, model_path: str, source: type, source_key: str, source_path: str
) -> None:
    """Refuse, in the evaluate stage, a model it cannot score: no ``test_step``, or no test
    split in its data source (``source``: the data module's class, or the model's; named by
    ``source_key``'s ``class_path``, ``source_path``)."""
    import lightning as L

    if not _overrides(model, L.LightningModule, "test_step"):
        raise ConfigError(
            f"model.class_path: {model_path} defines no test_step; {HOOKS['test_step']}: define "
            f"it, or drop the evaluate stage from dvc.yaml ({DOCS})"
        )
    if not gives_split(source, "test"):
        raise ConfigError(
            f"{source_key}.class_path: {source_path} defines neither "
            f"test_dataloader() nor test_dataset(); {NEEDED['test']}: define one of them, or drop "
            f"the evaluate stage from dvc.yaml ({DOCS})"
        )


def check_prepare_data(recipe: Recipe, data: list[Path]) -> None:
    """Refuse a class whose ``prepare_data()`` would fetch files no ``--data`` path holds.

    The pipeline never runs ``prepare_data`` (Lightning's call on the model is
    skipped too: :func:`~reprotrain.pipeline.recipe.hooks_skipped`): a download
    has no checksum in the run ID. A class that defines it, as Lightning's MNIST
    data module does, trains as it is where an ``init_args`` string of its own
    names a ``--data`` path of the train stage (its ``data_dir``), which a DVC
    stage or ``dvc import-url`` fills and DVC checksums: ``setup`` reads the
    files there. Otherwise the files it would fetch are nowhere the run ID sees.
    """
    import lightning as L

    listed = {path.resolve() for path in data}
    for component in recipe.components:
        if not _overrides(component.cls, L.LightningDataModule, "prepare_data"):
            continue
        if _named_paths(component) & listed:
            continue
        raise ConfigError(
            f"{component.key}.class_path: {component.class_path} defines prepare_data(), which "
            "the pipeline does not run (what it downloads would have no checksum in the run "
            "ID), and none of its init_args names a --data path of the train stage for the "
            "files; fetch them in a DVC stage of your own (or `dvc import-url`) into a folder, "
            f"pass that folder as --data to the train stage and name it in {component.key}."
            f"init_args (its data_dir) ({DOCS})"
        )


def check_data_files(recipe: Recipe, data: list[Path]) -> None:
    """Refuse a file the model or the data module names that the run ID would not cover.

    Any top-level ``data.init_args`` or ``model.init_args`` string that names an
    existing file or folder (a shard folder, docs/data.md; a pretrained weights
    file the model's ``__init__`` loads) is data the class reads; it must be one of
    the train stage's ``--data`` paths, which are checked against ``dvc.lock`` and
    hashed into the run ID. Otherwise a changed file would train other bits under
    the same run ID. A folder that holds the repository root (``.``, ``./``, as
    Lightning's MNIST ``data_dir`` defaults) cannot be a ``--data`` folder at all:
    it holds the stages' own outputs, so it is refused even when listed.
    """
    root = Path.cwd().resolve()  # the repository root: DVC runs the stages there
    listed = [path.resolve() for path in data]
    for component in recipe.components:
        key = component.key
        for name, value in component.init_args.items():
            if not isinstance(value, str) or not value or not Path(value).exists():
                continue
            where = f"{key}.init_args.{name}"
            if root.is_relative_to(Path(value).resolve()):
                raise ConfigError(
                    f"{where}: {value!r} is read by {component.class_path} but holds the "
                    "repository root, stage outputs and all, so it cannot be a --data folder; "
                    f"point {where} at a folder that holds only the data (e.g. data/mnist) and "
                    "pass that folder as --data to the train stage (`--data data/mnist` in its "
                    "cmd in dvc.yaml, and data/mnist in its deps)"
                )
            if Path(value).resolve() not in listed:
                kind = "folder" if Path(value).is_dir() else "file"
                raise ConfigError(
                    f"{where}: {value} is read by {component.class_path} but is not a --data "
                    f"{kind} of the train stage, so the run ID would not cover it; add "
                    f"`--data {value}` to the train stage's cmd in dvc.yaml (and {value} to its "
                    "deps)"
                )


def unread_data_files(recipe: Recipe, data: list[Path]) -> list[Path]:
    """The train stage's ``--data`` paths that no ``data.init_args`` or ``model.init_args``
    string names.

    Such a file stays in the run ID (and DVC reruns train when it changes)
    though no class may ever read it: a module that reads no file (or names its
    files in its code) needs no ``--data``. Not a refusal: a module may read a
    file its code names; the env stage says it once.
    """
    named = set().union(*(_named_paths(component) for component in recipe.components))
    return [path for path in data if path.resolve() not in named]


def _named_paths(component: ResolvedComponent) -> set[Path]:
    """The paths the top-level string ``init_args`` of ``component`` name, resolved."""
    return {
        Path(value).resolve()
        for value in component.init_args.values()
        if isinstance(value, str) and value
    }


def check_code_tracked(
    recipe: Recipe, deps: list[Path], dvc_yaml: Path, stage: str = "train"
) -> None:
    """Refuse a recipe whose code (:func:`~reprotrain.pipeline.recipe_code.code_files`: the
    classes' package, their ``code:`` entries) is not under a dep of ``stage``: the run ID
    hashes it, but DVC would not rerun the stage when it changes, and its outputs would
    stay the old code's, silently. reprotrain's own classes are the stages' code."""
    import dataclasses

    from reprotrain.pipeline.recipe_code import code_files

    root = Path.cwd().resolve()
    for component in recipe.components:
        if component.cls.__module__.split(".")[0] == "reprotrain":
            continue
        package = dataclasses.replace(component, code=())
        named = [(f"{component.key}.class_path: {component.class_path}", package)]
        named += [
            (
                f"{component.key}.code[{index}]: {entry!r}",
                dataclasses.replace(package, code=(entry,)),
            )
            for index, entry in enumerate(component.code)
        ]
        for what, part in named:
            for file in code_files(part, root):
                if any(file == dep or file.is_relative_to(dep) for dep in deps):
                    continue
                where = file.relative_to(root) if file.is_relative_to(root) else file
                add = where.parts[0] if len(where.parts) > 1 else where
                raise ConfigError(
                    f"{what}: its code {where} is not among the {stage} stage's deps in "
                    f"{dvc_yaml}, so DVC would not rerun {stage} when it changes (its outputs "
                    f"would stay the old code's); add `- {add}` to its deps"
                )


def check_datasets(datamodule: Any) -> None:
    """Refuse a set-up data source whose ``<split>_dataset()`` is not map-style (where it
    gives one: a split with neither a loader nor a dataset is not used, or was refused)."""
    for split in SPLITS:
        if gives_dataset(type(datamodule), split):
            map_style(getattr(datamodule, f"{split}_dataset")(), split)


def order_refusal(params: Params, train_loader: OwnLoader | None) -> str | None:
    """Why ``params`` asks for a guarantee the module's own training order cannot give
    (:func:`~reprotrain.pipeline.own_loaders.order_problem`), or a batch layout that
    world-size invariance cannot split; None when neither."""
    invariant = params.train.world_size_invariant
    shard = params.train.strategy == "ddp" and not invariant
    if problem := order_problem(train_loader, shard, invariant):
        return problem
    if invariant and train_loader is not None and train_loader.kept_order is None:
        size = int(train_loader.batch_size or 0)
        check_invariant_layout(params.train, size, train_loader.where, "its batch_size")
    return None


def check_loaders(params: Params, recipe: Recipe) -> None:
    """Refuse, in the env stage, a guarantee the data module's own training loader cannot give.

    The data module is set up for ``fit`` and its ``train_dataloader()`` taken apart; where
    that cannot run yet (the prepared data it reads is made later), the train stage refuses.
    """
    if recipe.data is None or not defines_own_loader(recipe.data.cls, "train"):
        return  # the model's own loaders: train checks them, after the model's setup
    if params.train.strategy != "ddp" and not params.train.world_size_invariant:
        return
    try:
        datamodule = linked_arguments(recipe)[0]
        loader = own_loader(datamodule, "train")
    except (OSError, DataError):  # the data is not there yet: train checks it
        return
    if problem := order_refusal(params, loader):
        raise ConfigError(f"data.class_path: {recipe.data.class_path}: {problem}")


def _overrides(cls: type, base: type, name: str) -> bool:
    """Whether ``cls`` (or a class between it and ``base``) defines ``name`` itself."""
    return getattr(cls, name, None) is not getattr(base, name, None)


def check_world_size_invariance(params: Params, recipe: Recipe) -> None:
    """Under ``train.world_size_invariant``, refuse a model with batch norm that tracks running
    statistics, in one line, before DVC deletes any output (the env stage calls it).

    The model is built on the meta device (no memory, whatever its size), with its linked
    arguments from the data module set up for ``fit``; where that setup cannot run yet
    (the prepared data it reads is made later), it returns, and the train stage, which
    calls it again before any rank starts, refuses instead.
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
