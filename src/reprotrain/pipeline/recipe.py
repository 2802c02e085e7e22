"""The model and data named as LightningCLI names them: ``{class_path, init_args}``.

A section of ``params.yaml`` such as ``model: {class_path: mypkg.Net,
init_args: {hidden: 128}}`` (shape-checked by :mod:`reprotrain.pipeline.config`)
is resolved and type-checked here by jsonargparse, the library LightningCLI
parses its configs with, so the ``model`` and ``data`` sections of a
LightningCLI config paste in unchanged. The answer, :class:`ResolvedComponent`,
holds every init argument with its default filled in, as plain JSON (what the
run record and the run ID carry), and builds the object from exactly those
values. The class is imported with the working directory (the repository
root, where DVC runs the stages) first on ``sys.path``, so a project's own
package needs no install.

Arguments whose values come from the data (the class count, a vocabulary
size) are the data module's ``model_links``: left out of the parse, refused
in ``init_args``, and passed at :meth:`ResolvedComponent.instantiate` from the
set-up data module's attributes of the same names (LightningCLI's
``link_arguments(..., apply_on="instantiate")``). :func:`build` does this and
returns the model's record with them filled in, so evaluate can rebuild the
model from the weights file alone.

With no ``data`` section (``data: null``, or none, as a LightningCLI config for
such a module has none) the model's own ``*_dataloader()`` methods give the
data, as ``trainer.fit(model)`` uses them: the model is its own data source.
Its ``setup(stage)`` then runs once, in :func:`build`, before the pipeline asks
for its loaders (it needs the training loader to build the Trainer), and
Lightning's own call is skipped (:func:`hooks_skipped`), as is, for any model,
Lightning's call of its ``prepare_data`` (the pipeline runs no download).

Every error is a :class:`~reprotrain.pipeline.config.ConfigError` of one line
naming the key path (``model.init_args.hidden``) and what to do. jsonargparse's
coercions stay: a string such as ``'1e-3'`` for a float parameter is accepted
(PyYAML reads ``1e-3`` as a string), ``'abc'`` is not. ``null`` is a value like
any other: it reaches the class, and is recorded, where the argument's type
allows None (``Optional[float]``, ``Any``, untyped, a ``None`` default), and is
refused where it does not (``int``), never replaced by the default.

:func:`~reprotrain.pipeline.recipe_code.code_files` lists the code that decides
the bits (the source of the package the class lives in).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
import sys
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jsonargparse import ArgumentError, ArgumentParser, set_parsing_settings

from reprotrain.pipeline.config import Component, ConfigError, Params


@dataclass(frozen=True)
class ResolvedComponent:
    """A class named in ``params.yaml`` and every argument it is built with."""

    key: str  #: the params section: "model" or "data"
    class_path: str  #: the dotted path the class was named by
    cls: type
    init_args: dict[str, Any]  #: every argument, defaults included, as JSON values
    provided: tuple[str, ...] = ()  #: arguments the pipeline passes at instantiation
    code: tuple[str, ...] = ()  #: extra files or folders that decide the bits

    def record(self) -> dict[str, Any]:
        """What the run record carries: the section, fully resolved."""
        return {"class_path": self.class_path, "init_args": self.init_args}

    def instantiate(self, **provided: Any) -> Any:
        """Build the object from ``init_args`` (parsed again) and the ``provided`` arguments.

        Numbers and strings reach the class as plain ``int``, ``float`` and ``str``, not as
        jsonargparse's restricted subclasses (``PositiveFloat``...): a value kept in an
        optimizer's state must load back from a checkpoint with ``weights_only=True``.
        """
        if set(provided) != set(self.provided):
            raise TypeError(
                f"{self.key}: {self.class_path} needs exactly {sorted(self.provided)} from the "
                f"pipeline, got {sorted(provided)}"
            )
        with _null_is_a_value():
            parser = _parser(self.cls, self.key, self.provided)
            built = parser.instantiate(parser.parse_object(self.init_args))
        try:
            return self.cls(**{name: _plain(built[name]) for name in self.init_args}, **provided)
        except ValueError as err:  # how a class refuses its arguments (n_head not dividing...)
            raise self.refused(err, "its arguments") from None

    def refused(self, err: ValueError, what: str) -> ConfigError:
        """The one line for a ValueError the class raised refusing ``what``."""
        shown = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return ConfigError(
            f"{self.key}.init_args: {self.class_path} refused {what} ({shown}); fix them under "
            f"{self.key}.init_args in params.yaml"
        )


def _plain(value: Any) -> Any:
    """``value`` as its builtin type when it is a subclass of int, float or str."""
    for kind in (bool, int, float, str):
        if isinstance(value, kind):
            return kind(value)
    return value


def resolve_component(
    section: Component, key: str, base: type, provided: Collection[str] = ()
) -> ResolvedComponent:
    """Resolve and type-check ``section`` (params key ``key``); one-line errors."""
    cls = _import_class(section.class_path, key, base)
    for name in provided:
        if name in section.init_args:
            raise ConfigError(
                f"{key}.init_args.{name}: set from the data module when the pipeline builds "
                f"{section.class_path} (its model_links); remove it"
            )
    with _null_is_a_value():
        parser = _parser(cls, key, tuple(provided))
        _check_groups(parser, section.init_args, key, section.class_path)
        try:
            namespace = parser.parse_object(dict(section.init_args))
        except ArgumentError as err:
            message = _one_line(str(err), parser, section.init_args, key, section.class_path)
            raise ConfigError(message) from None
        resolved = json.loads(parser.dump(namespace, format="json"))
    return ResolvedComponent(key, section.class_path, cls, resolved, tuple(provided), section.code)


@contextmanager
def _null_is_a_value() -> Iterator[None]:
    """jsonargparse telling an argument left out from one set to ``null``, while it runs here.

    By default jsonargparse marks an argument not given with None, so a ``null`` passes any
    type and its dump leaves it out: the class was built with its default, silently. Its
    ``unset_sentinel`` setting (jsonargparse 4.50) marks a left-out argument ``Unset``
    instead, so ``null`` is type-checked as a value and kept. The setting is global to the
    process; it is on only inside this block (not nested), around parsers built inside it.
    """
    set_parsing_settings(unset_sentinel=True)
    try:
        yield
    finally:
        set_parsing_settings(unset_sentinel=False)


@dataclass(frozen=True)
class Recipe:
    """The model and data module params.yaml names, resolved."""

    model: ResolvedComponent
    #: None: the model's own ``*_dataloader()`` methods give the data (no data module).
    data: ResolvedComponent | None

    @property
    def components(self) -> tuple[ResolvedComponent, ...]:
        """The classes params.yaml names: the data module (if any) and the model."""
        return (self.data, self.model) if self.data is not None else (self.model,)

    def record(self, linked: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Both sections fully resolved (``data`` None without a data module), with the
        linked model arguments when known."""
        model = self.model.record()
        model["init_args"] = {**model["init_args"], **(linked or {})}
        return {"model": model, "data": self.data.record() if self.data is not None else None}


def resolve_recipe(params: Params) -> Recipe:
    """Import and type-check params' ``model`` and ``data`` (no object is built)."""
    import lightning as L

    data = None
    if params.data is not None:
        data = resolve_component(params.data, "data", L.LightningDataModule)
    links = tuple(getattr(data.cls, "model_links", ())) if data is not None else ()
    model = resolve_component(params.model, "model", L.LightningModule, provided=links)
    return Recipe(model, data)


def build(recipe: Recipe, stage: str = "fit") -> tuple[Any, Any, dict[str, Any]]:
    """The data source set up for ``stage`` (the data module, else the model itself, whose
    Lightning ``setup`` call is then to be skipped: :func:`hooks_skipped`), the model, and the
    linked arguments' values."""
    if recipe.data is None:
        model = recipe.model.instantiate()
        set_up_model(model, stage, recipe.model.class_path)
        return model, model, {}
    datamodule, linked = linked_arguments(recipe, stage)
    return datamodule, recipe.model.instantiate(**linked), linked


#: Why a model's ``setup`` runs outside a Trainer where it gives the data, and what to do.
GIVES_DATA = (
    "with no data module (data: null) the model gives the data and its setup runs before the "
    "Trainer is built (the pipeline needs the loaders to build it); move that code to "
    "configure_model or on_fit_start, or move setup and the *_dataloader() methods into a "
    "LightningDataModule named under data"
)


def set_up_model(model: Any, stage: str, class_path: str, why: str = GIVES_DATA) -> None:
    """``model.setup(stage)`` outside a Trainer: one line saying ``why`` where it reads
    ``self.trainer``, which is not there."""
    try:
        model.setup(stage)
    except RuntimeError as err:
        if "not attached to a `Trainer`" not in str(err):
            raise
        raise ConfigError(
            f"model.class_path: {class_path}: its setup({stage!r}) reads self.trainer, but {why}"
        ) from None


def fresh_model(recipe: Recipe, linked: Mapping[str, Any]) -> Any:
    """A new model as a fit has it before its first step: built, its ``setup("fit")`` and
    ``configure_model()`` run (where a module may build layers), for measurements on a step
    outside a Trainer (``reprotrain bench``, ``reprotrain locate``)."""
    model = recipe.model.instantiate(**linked)
    why = "this command runs a training step outside a Trainer; train with dvc repro instead"
    set_up_model(model, "fit", recipe.model.class_path, why)
    model.configure_model()
    return model


@contextmanager
def hooks_skipped(module: Any, source: Any) -> Iterator[None]:
    """Lightning's calls of ``module``'s hooks the pipeline does not leave to it, skipped
    inside the block: ``prepare_data`` (a download the run ID would not see; the files are
    ``--data``: :func:`~reprotrain.pipeline.contract.check_prepare_data`) and, where the
    model is its own data ``source``, ``setup``, which :func:`build` ran for this stage
    already, so it runs once, as Lightning would run it."""
    hooks = {"prepare_data": lambda: None}
    if source is module:
        hooks["setup"] = lambda stage: None
    for name, nothing in hooks.items():
        setattr(module, name, nothing)  # the instance's attribute hides the method
    try:
        yield
    finally:
        for name in hooks:
            delattr(module, name)


def linked_arguments(recipe: Recipe, stage: str = "fit") -> tuple[Any, dict[str, Any]]:
    """The data module (set up for ``stage``) and the values of the model's linked arguments
    (none without a data module)."""
    if recipe.data is None:
        return None, {}
    datamodule = recipe.data.instantiate()
    try:
        datamodule.setup(stage)
    except ValueError as err:  # its arguments do not fit its data (a window over the corpus)
        raise recipe.data.refused(err, f"its arguments in setup({stage!r})") from None
    linked = {}
    for name in recipe.model.provided:
        if not hasattr(datamodule, name):
            raise ConfigError(
                f"data.class_path: {recipe.data.class_path} lists {name!r} in model_links but "
                f"has no attribute {name!r} after setup({stage!r}); set it in setup"
            )
        linked[name] = json.loads(json.dumps(getattr(datamodule, name)))
    return datamodule, linked


def rebuild_model(record: Mapping[str, Any], source: str) -> Any:
    """The model a run record's ``model`` section describes (linked arguments included)."""
    import lightning as L

    section = Component(record["class_path"], dict(record["init_args"]))
    try:
        return resolve_component(section, "model", L.LightningModule).instantiate()
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None


def _import_class(class_path: str, key: str, base: type) -> type:
    where = f"{key}.class_path"
    module_name, _, name = class_path.rpartition(".")
    if (root := str(Path.cwd())) not in sys.path:
        sys.path.insert(0, root)  # the project's own package, as `python -m` would find it
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(
            f"{where}: cannot import {class_path!r} ({err}); fix the spelling, or put its "
            "package in the repository (or install it)"
        ) from None
    cls = getattr(module, name, None)
    if cls is None:
        raise ConfigError(
            f"{where}: module {module_name!r} has no {name!r}; fix the spelling of the class"
        )
    if not isinstance(cls, type) or not issubclass(cls, base):
        raise ConfigError(
            f"{where}: {class_path} is not a {base.__name__}; set {where} to a subclass of "
            f"{base.__module__.split('.')[0]}'s {base.__name__}"
        )
    return cls


def _parser(cls: type, key: str, provided: tuple[str, ...]) -> ArgumentParser:
    """jsonargparse's view of ``cls.__init__``, as LightningCLI builds it (untyped allowed)."""
    parser = ArgumentParser(exit_on_error=False, prog=key)
    try:
        parser.add_class_arguments(cls, skip=set(provided), fail_untyped=False)
    except ValueError as err:
        message = " ".join(str(err).split())
        raise ConfigError(f"{key}.class_path: {cls.__qualname__}: {message}") from None
    return parser


def _arguments(parser: ArgumentParser, group: str = "") -> list[str]:
    """The argument names one level under ``group`` (the top level when empty)."""
    prefix = f"{group}." if group else ""
    names = []
    for action in parser._actions:  # jsonargparse has no public list of its keys
        rest = action.dest.removeprefix(prefix)
        if action.dest.startswith(prefix) and rest and "." not in rest and rest != "help":
            names.append(rest)
    return names


def _check_groups(
    parser: ArgumentParser, init_args: Mapping[str, Any], key: str, class_path: str
) -> None:
    """A dataclass argument must be a mapping (jsonargparse lets a scalar through)."""
    groups = {a.dest.split(".")[0] for a in parser._actions if "." in a.dest}
    for name in groups & set(init_args):
        if not isinstance(init_args[name], Mapping):
            fields = ", ".join(_arguments(parser, name))
            raise ConfigError(
                f"{key}.init_args.{name}: expected a mapping of its fields ({fields}) for "
                f"{class_path}, got {init_args[name]!r}"
            )


_TYPE_NAMES = {"int": "an int", "float": "a float", "str": "a string", "bool": "true or false"}


def _one_line(
    message: str, parser: ArgumentParser, init_args: Mapping[str, Any], key: str, class_path: str
) -> str:
    """jsonargparse's (multi-line) parse error as one line naming the key path."""
    where = f"{key}.init_args"
    if match := re.match(r"Option '([^']+)' is not accepted", message):
        arguments = ", ".join(_arguments(parser))
        return (
            f"{where}.{match[1]}: no such argument of {class_path} (its arguments: "
            f"{arguments}); remove or rename it"
        )
    if match := re.match(r"Group '([^']+)' does not accept option '([^']+)'", message):
        fields = ", ".join(_arguments(parser, match[1]))
        return (
            f"{where}.{match[1]}.{match[2]}: no such field (its fields: {fields}); remove or "
            "rename it"
        )
    if match := re.match(r"the following arguments are required: (.+)", message):
        return (
            f"{where}: {class_path} needs {match[1].strip()}, which have no default; add them "
            f"under {where}"
        )
    if match := re.match(r'Parser key "([^"]+)":\s*(.*)', message, re.DOTALL):
        value = _lookup(init_args, match[1])
        expected = re.match(r"Expected a <class '(\w+)'>", match[2])
        fix = f"set a value the argument's type in {class_path} allows"
        kind = _TYPE_NAMES.get(expected[1], f"a {expected[1]}") if expected else None
        if value is None:  # null is a value, never the default: say how to get either
            wanted = f"expected {kind}, " if kind else ""
            return (
                f"{where}.{match[1]}: {wanted}got null, which its type in {class_path} does "
                "not allow (Optional[...] would); set a value, or leave it out for its default"
            )
        if kind and value is not _MISSING:
            return f"{where}.{match[1]}: expected {kind}, got {value!r}; {fix}"
        return f"{where}.{match[1]}: {' '.join(match[2].split())}; {fix}"
    return f"{where}: {' '.join(message.split())} ({class_path}); fix the value"


_MISSING = object()


def _lookup(tree: Mapping[str, Any], dotted: str) -> Any:
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return _MISSING
        node = node[part]
    return node
