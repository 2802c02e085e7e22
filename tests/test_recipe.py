"""``{class_path, init_args}`` sections: resolved by jsonargparse, one-line errors, code hashed.

A user's package is written under ``tmp_path`` (outside ``src/reprotrain``)
and put on ``sys.path``, as a user's project would be.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path

import lightning as L
import pytest
import yaml

from reprotrain.hashing import canonical_json
from reprotrain.pipeline.config import DEFAULT_MODEL, ConfigError
from reprotrain.pipeline.params_file import parse_component
from reprotrain.pipeline.recipe import ResolvedComponent, resolve_component
from reprotrain.pipeline.recipe_code import code_files
from reprotrain.provenance.identity import code_hash

CLASSIFIER = "reprotrain.recipes.digits.Classifier"
FROM_DATA = ("input_shape", "num_classes")  # the pipeline's, from the prepared data

USER_MODEL = '''\
"""A user's flat LightningModule, shaped as the digits CNN is meant to become."""

from typing import Any, Optional

import lightning as L
from torch import nn

from usernet.layers import head


class Net(L.LightningModule):
    def __init__(
        self, num_classes: int, channels: int = 16, hidden: int = 64, dropout: float = 0.25
    ) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), head(64 * channels, hidden, num_classes, dropout))


class NeedsWidth(L.LightningModule):
    def __init__(self, width: int) -> None:
        super().__init__()


class NotAModule:
    pass


class Nullable(L.LightningModule):
    """Keeps what reached it: a null must arrive as None, not as the default."""

    def __init__(
        self,
        dropout: Optional[float] = 0.5,
        lr: float = 0.01,
        hidden: int = 3,
        scale=2,
        extra: Any = 1,
        tag: Optional[str] = None,
    ) -> None:
        super().__init__()
        self.got = {"dropout": dropout, "lr": lr, "hidden": hidden, "scale": scale}
        self.got.update(extra=extra, tag=tag)
'''

USER_LAYERS = """\
from torch import nn


def head(inputs: int, hidden: int, classes: int, dropout: float) -> nn.Module:
    scale = 1  # a line the code-hash test edits
    layers = [nn.Linear(inputs, hidden * scale), nn.Dropout(dropout)]
    return nn.Sequential(*layers, nn.Linear(hidden * scale, classes))
"""

USER_DATA = """\
import lightning as L


class Digits(L.LightningDataModule):
    def __init__(self, batch_size: int = 64, augment: bool = True) -> None:
        super().__init__()


class Wrapper(L.LightningDataModule):
    def __init__(self, net: L.LightningModule) -> None:
        super().__init__()
"""


@pytest.fixture
def user_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """``usernet`` (model, layers, data) under ``tmp_path/project/src``, importable."""
    package = tmp_path / "project" / "src" / "usernet"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "model.py").write_text(USER_MODEL)
    (package / "layers.py").write_text(USER_LAYERS)
    (package / "data.py").write_text(USER_DATA)
    monkeypatch.syspath_prepend(str(package.parent))
    importlib.invalidate_caches()
    yield package
    for name in [n for n in sys.modules if n == "usernet" or n.startswith("usernet.")]:
        del sys.modules[name]


def _model(section: dict, provided: tuple[str, ...] = ("num_classes",)) -> ResolvedComponent:
    return resolve_component(
        parse_component(section, "model"), "model", L.LightningModule, provided
    )


def _error(section: object, base: type = L.LightningModule, provided: tuple = FROM_DATA) -> str:
    """The one-line error for ``section``: its shape (params) or its resolution."""
    key = "data" if base is L.LightningDataModule else "model"
    with pytest.raises(ConfigError) as caught:
        resolve_component(parse_component(section, key, source="p"), key, base, provided)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_builtin_classifier_resolves_with_every_default_filled_in() -> None:
    resolved = _model({"class_path": CLASSIFIER}, FROM_DATA)
    assert resolved.init_args == DEFAULT_MODEL.init_args  # params.yaml spells out the defaults
    canonical_json(resolved.record())  # plain JSON: the run record can carry it
    network = resolved.instantiate(input_shape=(1, 8, 8), num_classes=10).net
    assert network[7].out_features == 64


def test_an_override_reaches_the_resolved_args_and_the_built_object(user_package: Path) -> None:
    """As ``dvc exp run -S model.init_args.hidden=128`` writes it into params.yaml."""
    params = yaml.safe_load("model:\n  class_path: usernet.model.Net\n  init_args: {}\n")
    params["model"]["init_args"]["hidden"] = yaml.safe_load("128")
    resolved = _model(params["model"])
    assert resolved.init_args == {"channels": 16, "hidden": 128, "dropout": 0.25}
    assert resolved.instantiate(num_classes=10).net[1][0].out_features == 128
    default = _model({"class_path": "usernet.model.Net"})
    assert default.init_args["hidden"] == 64  # negative control: the override made the change


def test_a_pasted_lightningcli_data_section_resolves(user_package: Path) -> None:
    section = {"class_path": "usernet.data.Digits", "init_args": {"batch_size": 32}}
    resolved = resolve_component(parse_component(section, "data"), "data", L.LightningDataModule)
    assert resolved.record() == {
        "class_path": "usernet.data.Digits",
        "init_args": {"batch_size": 32, "augment": True},
    }


def test_a_misspelt_argument_is_one_line_naming_the_key_and_the_arguments() -> None:
    message = _error({"class_path": CLASSIFIER, "init_args": {"hiddn": 128}})
    assert message == (
        "model.init_args.hiddn: no such argument of reprotrain.recipes.digits.Classifier "
        "(its arguments: channels, hidden, dropout, optimizer, lr, weight_decay); remove or "
        "rename it"
    )


def test_a_class_that_cannot_be_imported_is_one_line() -> None:
    message = _error({"class_path": "mypkg.Net"})
    assert message.startswith("model.class_path: cannot import 'mypkg.Net' (No module named")
    missing = _error({"class_path": "reprotrain.recipes.digits.Nope"})
    assert missing.startswith("model.class_path: module 'reprotrain.recipes.digits' has no 'Nope'")
    assert _error({"class_path": "Net"}).startswith("p: model.class_path: expected a dotted path")


def test_a_wrong_type_is_one_line_naming_the_key(user_package: Path) -> None:
    section = {"class_path": "usernet.model.Net", "init_args": {"hidden": "abc"}}
    assert _error(section, provided=("num_classes",)) == (
        "model.init_args.hidden: expected an int, got 'abc'; set a value the argument's type "
        "in usernet.model.Net allows"
    )
    restricted = {"class_path": CLASSIFIER, "init_args": {"dropout": 1.5}}
    assert _error(restricted).startswith("model.init_args.dropout: Not of type Probability: 1.5")


NULLABLE = "usernet.model.Nullable"


@pytest.mark.parametrize("name", ["dropout", "scale", "extra"])  # Optional, untyped, Any
def test_null_reaches_the_class_and_the_record_where_its_type_allows_none(
    name: str, user_package: Path
) -> None:
    resolved = _model({"class_path": NULLABLE, "init_args": {name: None}}, ())
    assert name in resolved.init_args and resolved.init_args[name] is None  # run ID, weights
    assert resolved.instantiate().got[name] is None  # not the class's default
    default = _model({"class_path": NULLABLE}, ())  # control: left out, the default
    assert default.init_args[name] is not None
    assert default.instantiate().got[name] is not None


def test_a_none_default_is_recorded_with_every_other_argument(user_package: Path) -> None:
    resolved = _model({"class_path": NULLABLE}, ())
    assert resolved.init_args == {
        "dropout": 0.5, "lr": 0.01, "hidden": 3, "scale": 2, "extra": 1, "tag": None,
    }  # fmt: skip


@pytest.mark.parametrize(("name", "kind"), [("hidden", "an int"), ("lr", "a float")])
def test_null_where_the_type_allows_no_none_is_one_line_naming_the_key(
    name: str, kind: str, user_package: Path
) -> None:
    message = _error({"class_path": NULLABLE, "init_args": {name: None}}, provided=())
    assert message == (
        f"model.init_args.{name}: expected {kind}, got null, which its type in "
        "usernet.model.Nullable does not allow (Optional[...] would); set a value, or leave it "
        "out for its default"
    )
    _model({"class_path": NULLABLE, "init_args": {name: 4}}, ())  # control: a value passes


def test_null_in_a_restricted_type_or_a_nested_class_is_refused_by_key(user_package: Path) -> None:
    restricted = _error({"class_path": CLASSIFIER, "init_args": {"hidden": None}})
    assert restricted.startswith("model.init_args.hidden: got null, which its type in ")
    nested = _error(
        {"class_path": "usernet.data.Wrapper", "init_args": {"net": {
            "class_path": NULLABLE, "init_args": {"hidden": None}}}},
        L.LightningDataModule, (),
    )  # fmt: skip
    assert nested.startswith("data.init_args.net: ") and "Got value: None" in nested
    section = {"class_path": "usernet.data.Wrapper", "init_args": {"net": {
        "class_path": NULLABLE, "init_args": {"dropout": None}}}}  # fmt: skip
    kept = resolve_component(parse_component(section, "data"), "data", L.LightningDataModule)
    assert kept.init_args["net"]["init_args"]["dropout"] is None  # control: Optional keeps it


@pytest.mark.parametrize("params", ["params.yaml", "pipelines/lm/params.yaml"])
def test_shipped_recipes_resolve_to_what_their_params_spell_out(
    params: str, repo_root: Path
) -> None:
    """The run ID's recipe input for the shipped pipelines: every argument, as written, and
    no null added by the null handling (so their run IDs stay where they were)."""
    from reprotrain.pipeline.params_file import load_params
    from reprotrain.pipeline.recipe import resolve_recipe

    written = load_params(repo_root / params)
    record = resolve_recipe(written).record()
    for key in ("model", "data"):
        section = getattr(written, key)
        assert record[key] == {"class_path": section.class_path, "init_args": section.init_args}


def test_a_class_of_the_wrong_kind_is_refused(user_package: Path) -> None:
    assert _error({"class_path": "usernet.model.NotAModule"}) == (
        "model.class_path: usernet.model.NotAModule is not a LightningModule; set model.class_path "
        "to a subclass "
        "of lightning's LightningModule"
    )
    as_data = _error({"class_path": "usernet.model.Net"}, L.LightningDataModule, ())
    assert as_data.startswith("data.class_path: usernet.model.Net is not a LightningDataModule")


def test_a_missing_required_argument_or_a_pipeline_argument_is_one_line(
    user_package: Path,
) -> None:
    message = _error({"class_path": "usernet.model.NeedsWidth"}, provided=())
    assert message.startswith("model.init_args: usernet.model.NeedsWidth needs width")
    set_twice = {"class_path": CLASSIFIER, "init_args": {"num_classes": 3}}
    assert _error(set_twice).startswith("model.init_args.num_classes: set from the data module")


def test_a_malformed_section_is_one_line() -> None:
    assert _error({"init_args": {}}).startswith("p: model: expected a mapping with class_path")
    extra = _error({"class_path": CLASSIFIER, "dict_kwargs": {}})
    assert extra.startswith("p: unknown key 'model.dict_kwargs'")
    assert _error({"class_path": CLASSIFIER, "init_args": [1]}).startswith("p: model.init_args:")
    assert _error({"class_path": CLASSIFIER, "code": "src"}).startswith("p: model.code: expected")


def test_code_files_are_the_user_package(user_package: Path) -> None:
    files = code_files(_model({"class_path": "usernet.model.Net"}), root=user_package.parents[1])
    names = ["__init__.py", "data.py", "layers.py", "model.py"]
    assert files == [user_package.resolve() / name for name in names]


def test_a_one_line_edit_to_user_code_moves_the_code_hash_and_restoring_restores_it(
    user_package: Path,
) -> None:
    resolved = _model({"class_path": "usernet.model.Net"})
    root = user_package.parents[1].resolve()
    layers = user_package / "layers.py"
    before = code_hash(code_files(resolved, root), root)
    assert code_hash(code_files(resolved, root), root) == before
    layers.write_text(USER_LAYERS.replace("scale = 1", "scale = 2"))
    edited = code_hash(code_files(resolved, root), root)
    layers.write_text(USER_LAYERS)
    assert edited != before
    assert code_hash(code_files(resolved, root), root) == before


def test_a_user_package_outside_the_repository_is_refused(user_package: Path) -> None:
    """DVC could not track it, so the cache key would miss its edits."""
    resolved = _model({"class_path": "usernet.model.Net"})
    elsewhere = user_package.parents[2] / "repository"
    elsewhere.mkdir()
    with pytest.raises(ConfigError, match=r"^model\.class_path: usernet\.model\.Net comes from"):
        code_files(resolved, root=elsewhere)


def test_a_code_list_adds_files_and_a_missing_entry_is_one_line(user_package: Path) -> None:
    project = user_package.parents[1]
    (project / "configs").mkdir()
    (project / "configs" / "vocab.txt").write_text("a b c\n")
    section = {"class_path": "usernet.model.Net", "code": ["configs"]}
    files = code_files(_model(section), root=project)
    assert (project / "configs" / "vocab.txt").resolve() in files
    missing = _model({"class_path": "usernet.model.Net", "code": ["nowhere.py"]})
    with pytest.raises(ConfigError, match=r"^model\.code\[0\]: 'nowhere\.py' not found under "):
        code_files(missing, root=project)


def test_installed_third_party_classes_add_no_code_and_reprotrain_adds_its_imports() -> None:
    """The lock pins site-packages; reprotrain's own classes follow the stages' rule."""
    boring = _model({"class_path": "lightning.pytorch.demos.boring_classes.BoringModel"}, ())
    assert code_files(boring) == []
    classifier = code_files(_model({"class_path": CLASSIFIER}, FROM_DATA))
    relative = {path.as_posix().split("src/reprotrain/")[-1] for path in classifier}
    assert {"recipes/digits.py", "pipeline/prepared.py"} <= relative
    assert "pipeline/recipe.py" not in relative


def test_a_value_error_from_a_data_modules_setup_is_one_line_naming_its_section() -> None:
    from reprotrain.pipeline.params_file import load_params
    from reprotrain.pipeline.recipe import linked_arguments, resolve_recipe
    from tests.helpers import ROOT

    lm = ROOT / "pipelines" / "lm" / "params.yaml"
    recipe = resolve_recipe(load_params(lm, ["data.init_args.block_size=100000"]))
    with pytest.raises(ConfigError) as refused:
        linked_arguments(recipe)
    line = str(refused.value)
    assert line.startswith("data.init_args: reprotrain.recipes.language_model.CharCorpus "
                           "refused its arguments in setup('fit') (the corpus")  # fmt: skip
    assert "\n" not in line
    # Control: the shipped block size sets up.
    assert linked_arguments(resolve_recipe(load_params(lm)))[1]["vocab_size"] > 0


def test_a_namespace_package_without_init_is_hashed_too(user_package: Path) -> None:
    (user_package / "__init__.py").unlink()  # a folder of modules, no __init__.py
    for name in [n for n in sys.modules if n == "usernet" or n.startswith("usernet.")]:
        del sys.modules[name]
    importlib.invalidate_caches()
    root = user_package.parents[1]
    files = code_files(_model({"class_path": "usernet.model.Net"}), root=root)
    assert files == [user_package.resolve() / n for n in ("data.py", "layers.py", "model.py")]
    # Outside the repository it is refused, as a package with an __init__.py is.
    with pytest.raises(ConfigError, match="outside the repository"):
        code_files(_model({"class_path": "usernet.model.Net"}), root=root / "elsewhere")
