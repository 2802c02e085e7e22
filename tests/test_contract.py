"""The contract a user's module and data module must meet, checked before training.

Each refusal is one line naming the class and why, and has its control: the
same module without the fault passes.
"""

from __future__ import annotations

import dataclasses
import random
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, TensorDataset

from reprotrain.pipeline.config import ConfigError, Params
from reprotrain.pipeline.contract import (
    check_data_files,
    check_datasets,
    check_prepare_data,
    check_recipe,
    unread_data_files,
)
from reprotrain.pipeline.data import PipelineLoaders, SampleSeeded
from reprotrain.pipeline.errors import DataError
from reprotrain.pipeline.params_file import parse_params
from reprotrain.pipeline.recipe import resolve_recipe
from tests.helpers import params_with


class Model(L.LightningModule):
    def __init__(self, num_classes: int, hidden: int = 4) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3, num_classes)

    def training_step(self, batch: object, index: int) -> torch.Tensor:
        return self.layer(batch[0]).sum()

    def test_step(self, batch: object, index: int) -> None:
        self.log("test_loss", self.layer(batch[0]).sum())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Validating(Model):
    def validation_step(self, batch: object, index: int) -> None:
        raise AssertionError("validated with no validation split")


class NoTestStep(Model):
    test_step = L.LightningModule.test_step


class Data(L.LightningDataModule):
    model_links = ("num_classes",)

    def __init__(self, batch_size: int = 4, num_workers: int = 0) -> None:
        super().__init__()
        self.batch_size, self.num_workers = batch_size, num_workers

    def setup(self, stage: str) -> None:
        self.num_classes = 2

    def train_dataset(self) -> Dataset:
        return TensorDataset(torch.zeros(8, 3), torch.zeros(8))

    val_dataset = test_dataset = train_dataset


class OwnLoader(Data):
    def train_dataloader(self) -> object:
        return torch.utils.data.DataLoader(self.train_dataset(), shuffle=True)


class OnlyTrainLoader(L.LightningDataModule):
    def train_dataloader(self) -> object:
        return torch.utils.data.DataLoader(TensorDataset(torch.zeros(8, 3)), batch_size=4)


class Downloads(Data):
    """Lightning's MNIST data module's shape: prepare_data downloads into data_dir."""

    def __init__(self, data_dir: str = "data/mnist", batch_size: int = 4) -> None:
        super().__init__(batch_size)
        self.data_dir = data_dir

    def prepare_data(self) -> None:
        raise AssertionError("the contract check must not call it")


class NoTestDataset(L.LightningDataModule):
    def __init__(self, batch_size: int = 4, num_workers: int = 0) -> None:
        super().__init__()

    def train_dataset(self) -> Dataset:
        return TensorDataset(torch.zeros(8, 3))

    val_dataset = train_dataset


class NoValidation(L.LightningDataModule):
    """Train and test splits only, as many Lightning examples have."""

    def __init__(self, batch_size: int = 4, num_workers: int = 0) -> None:
        super().__init__()
        self.batch_size, self.num_classes = batch_size, 2

    def train_dataset(self) -> Dataset:
        return TensorDataset(torch.zeros(8, 3), torch.zeros(8))

    test_dataset = train_dataset


class WithLoaders(Model):
    """Its data in the module itself (train and test loaders), for ``data: null``."""

    def __init__(self, num_classes: int = 2) -> None:
        super().__init__(num_classes)

    def train_dataloader(self) -> object:
        return [torch.zeros(1, 3)]

    test_dataloader = train_dataloader


class TrainLoaderOnly(WithLoaders):
    test_dataloader = L.LightningModule.test_dataloader


class ModelDownloads(WithLoaders):
    def __init__(self, data_dir: str = "data/mnist") -> None:
        super().__init__()
        self.data_dir = data_dir

    def prepare_data(self) -> None:
        raise AssertionError("downloaded")


class Pretrained(Model):
    """Loads pretrained weights from a file its __init__ names (a file outside --data would
    decide the bits unseen by the run ID)."""

    def __init__(self, num_classes: int, init_from: str = "") -> None:
        super().__init__(num_classes)


class MnistLike(Data):
    """Lightning's MNISTDataModule signature: data_dir defaults to the working directory."""

    def __init__(self, data_dir: str = "./", batch_size: int = 4) -> None:
        super().__init__(batch_size)


class LinksAbsent(Data):
    model_links = ("vocab_size",)


class Stream(IterableDataset):
    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(torch.zeros(8, 3))


class Streaming(Data):
    def train_dataset(self) -> Dataset:
        return Stream()  # type: ignore[return-value]


@pytest.fixture(autouse=True)
def user_module() -> Iterator[None]:
    """These classes as a user's module, ``usercontract``, importable by class path."""
    module = types.ModuleType("usercontract")
    for cls in (
        Model,
        NoTestStep,
        Data,
        OwnLoader,
        OnlyTrainLoader,
        Downloads,
        NoTestDataset,
        NoValidation,
        LinksAbsent,
        Streaming,
        Pretrained,
        MnistLike,
        WithLoaders,
        TrainLoaderOnly,
        ModelDownloads,
    ):
        setattr(module, cls.__name__, cls)
    sys.modules["usercontract"] = module
    yield
    del sys.modules["usercontract"]


def _params(
    model: str = "Model",
    data: str | None = "Data",
    model_args: dict | None = None,
    data_args: dict | None = None,
    **changes: object,
) -> Params:
    return parse_params(
        params_with(
            {
                "model": {"class_path": f"usercontract.{model}", "init_args": model_args or {}},
                "data": data
                and {"class_path": f"usercontract.{data}", "init_args": data_args or {}},
                **changes,
            }
        )
    )


def _refusal(params: Params) -> str:
    with pytest.raises(ConfigError) as caught:
        check_recipe(params, resolve_recipe(params))
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_a_module_that_meets_the_contract_passes() -> None:
    params = _params()
    check_recipe(params, resolve_recipe(params))  # the control for every refusal below


def test_a_data_module_with_its_own_loaders_meets_the_contract() -> None:
    check_recipe(*(lambda p: (p, resolve_recipe(p)))(_params(data="OwnLoader")))


def test_a_data_module_with_neither_a_loader_nor_a_dataset_for_a_split_is_refused() -> None:
    message = _refusal(_params(data="OnlyTrainLoader", model_args={"num_classes": 2}))
    assert "defines neither test_dataloader() nor test_dataset(); the evaluate stage" in message
    assert "val_" not in message  # no validation split is no validation, not a refusal


def test_a_data_module_without_a_validation_split_trains_without_validating() -> None:
    params = _params(data="NoValidation", model_args={"num_classes": 2})
    recipe = resolve_recipe(params)
    check_recipe(params, recipe)  # passes: Lightning validates nothing without a loader
    source = recipe.data.instantiate()
    assert PipelineLoaders(source, seed=0).val_dataloader() == []
    trainer = L.Trainer(
        max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False
    )
    trainer.fit(Validating(num_classes=2), datamodule=PipelineLoaders(source, seed=0))
    assert trainer.global_step == 2
    # control: a data module with a validation split gets its loader
    data = resolve_recipe(_params()).data.instantiate()
    assert len(PipelineLoaders(data, seed=0).val_dataloader()) == 2


def test_a_model_without_test_step_is_refused() -> None:
    message = _refusal(_params(model="NoTestStep"))
    assert message.startswith("model.class_path: usercontract.NoTestStep defines no test_step")


def test_a_data_module_without_a_dataset_method_is_refused() -> None:
    message = _refusal(_params(data="NoTestDataset", model_args={"num_classes": 2}))
    assert "defines neither test_dataloader() nor test_dataset()" in message


def test_a_link_to_an_argument_the_model_lacks_is_refused() -> None:
    message = _refusal(_params(data="LinksAbsent", model_args={"num_classes": 2}))
    assert "links 'vocab_size' to the model" in message


def test_a_batch_that_world_size_invariance_cannot_split_is_refused() -> None:
    invariant = {"train.world_size_invariant": True, "train.micro_batch_size": 3}
    message = _refusal(_params(**invariant))
    assert "train.world_size_invariant: micro_batch_size 3 does not divide batch_size 4" in message
    check_recipe(
        *(lambda p: (p, resolve_recipe(p)))(_params(**{**invariant, "train.micro_batch_size": 2}))
    )


def test_an_iterable_dataset_is_refused_before_training() -> None:
    streaming = Streaming()
    with pytest.raises(DataError, match=r"^train_dataset\(\) returned a Stream, not a map-style"):
        check_datasets(streaming)
    check_datasets(Data())  # control


@pytest.mark.parametrize("kind", ["file", "folder"])
def test_a_file_the_data_module_names_must_be_a_data_file_of_the_stage(
    kind: str, tmp_path: Path
) -> None:
    data = tmp_path / "rows.csv"
    if kind == "folder":  # a shard folder (docs/data.md): --data takes it as a whole
        data.mkdir()
        (data / "index.json").write_text("{}")
    else:
        data.write_text("1\n")
    params = parse_params(
        params_with(
            {
                "model": {"class_path": "usercontract.Model", "init_args": {}},
                "data": {"class_path": "reprotrain.recipes.digits.DigitsData",
                         "init_args": {"path": str(data)}},
            }
        )
    )  # fmt: skip
    recipe = resolve_recipe(params)
    message = rf"^data\.init_args\.path: .*rows\.csv is read by .* not a --data {kind} of"
    with pytest.raises(ConfigError, match=message):
        check_data_files(recipe, [])
    check_data_files(recipe, [data])  # listed: covered by the run ID


def test_a_file_the_model_names_must_be_a_data_file_of_the_stage(tmp_path: Path) -> None:
    """A pretrained weights file the model's __init__ loads decides the bits as data does."""
    weights = tmp_path / "l1.pt"
    weights.write_bytes(b"weights")
    recipe = resolve_recipe(_params(model="Pretrained", model_args={"init_from": str(weights)}))
    message = r"^model\.init_args\.init_from: .*l1\.pt is read by usercontract\.Pretrained but "
    with pytest.raises(ConfigError, match=message + r"is not a --data file of the train stage"):
        check_data_files(recipe, [])
    check_data_files(recipe, [weights])  # control: listed, so covered by the run ID
    assert unread_data_files(recipe, [weights]) == []  # and the model names it: no note


@pytest.mark.parametrize("data_dir", [".", "./", "root", "above"])
def test_a_data_folder_holding_the_repository_root_is_refused_with_a_folder_to_use(
    data_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lightning's MNIST ``data_dir: "./"``: ``--data ./`` would hash the outputs too."""
    root = tmp_path / "repo"
    (root / "data" / "mnist").mkdir(parents=True)
    monkeypatch.chdir(root)  # DVC runs the stages from the repository root
    value = {"root": str(root), "above": str(tmp_path)}.get(data_dir, data_dir)
    args = {} if data_dir == "./" else {"data_dir": value}  # "./" is the class's default
    recipe = resolve_recipe(_params(data="MnistLike", data_args=args))
    for listed in ([], [Path(value)]):  # listed or not: no --data folder can hold the root
        with pytest.raises(ConfigError) as caught:
            check_data_files(recipe, listed)
        message = str(caught.value)
        assert message.startswith(f"data.init_args.data_dir: {value!r} is read by ")
        assert "point data.init_args.data_dir at a folder that holds only the data" in message
        assert f"--data {value}`" not in message and "\n" not in message
    folder = _params(data="MnistLike", data_args={"data_dir": "data/mnist"})
    check_data_files(resolve_recipe(folder), [Path("data/mnist")])  # control: a data folder
    with pytest.raises(ConfigError, match=r"add `--data data/mnist` to the train stage's cmd"):
        check_data_files(resolve_recipe(folder), [])  # not listed: the usual advice


class Draws(Dataset):
    """Each item draws from torch's, numpy's and Python's global generators."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> tuple[float, float, float]:
        return float(torch.rand(())), float(np.random.rand()), random.random()


def test_sample_keys_decide_each_draw_and_leave_the_callers_streams_alone() -> None:
    seeded = SampleSeeded(Draws())
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    first = seeded[(1, (7, 3))]
    after = (float(torch.rand(())), float(np.random.rand()), random.random())
    torch.manual_seed(123)  # another caller state: the same key gives the same draw
    assert seeded[(1, (7, 3))] == first
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    seeded[(2, (7, 4))]
    assert (float(torch.rand(())), float(np.random.rand()), random.random()) == after
    assert seeded[(1, (7, 4))] != first  # control: another key, other draws


def test_a_data_file_no_data_argument_names_is_reported(tmp_path: Path) -> None:
    named, unnamed = tmp_path / "named.csv", tmp_path / "other.csv"
    params = _params()
    recipe = resolve_recipe(params)
    assert unread_data_files(recipe, [unnamed]) == [unnamed]
    with_path = dataclasses.replace(
        recipe,
        data=dataclasses.replace(recipe.data, init_args={**recipe.data.init_args, "p": str(named)}),
    )
    assert unread_data_files(with_path, [named]) == []  # control: the module names it


def _prepare_refusal(params: Params, data: list[Path]) -> str:
    with pytest.raises(ConfigError) as caught:
        check_prepare_data(resolve_recipe(params), data)
    assert "\n" not in str(caught.value)
    return str(caught.value)


def test_prepare_data_is_refused_unless_its_init_args_name_a_data_path(tmp_path: Path) -> None:
    params = _params(data="Downloads", data_args={"data_dir": str(tmp_path)})
    message = _prepare_refusal(params, [tmp_path / "other"])
    assert message.startswith(
        "data.class_path: usercontract.Downloads defines prepare_data(), which the pipeline "
        "does not run (what it downloads would have no checksum in the run ID), and none of "
        "its init_args names a --data path of the train stage for the files"
    )
    # Control: its data_dir a --data folder, as Lightning's MNIST data module's would be.
    check_prepare_data(resolve_recipe(params), [tmp_path])
    check_recipe(params, resolve_recipe(params))  # and the rest of the contract holds


def test_data_null_or_left_out_means_the_model_gives_its_own_data() -> None:
    for params in (_params("WithLoaders", data=None), _without_data("WithLoaders")):
        assert params.data is None
        recipe = resolve_recipe(params)
        assert recipe.data is None and recipe.components == (recipe.model,)
        check_recipe(params, recipe)
        assert recipe.record()["data"] is None
    # Control: with a data section, the data module gives the data.
    assert resolve_recipe(_params("WithLoaders")).data is not None


def _without_data(model: str) -> Params:
    raw = params_with({"model": {"class_path": f"usercontract.{model}"}})
    del raw["data"]
    return parse_params(raw)


def test_with_no_data_module_a_model_without_its_loaders_is_refused_by_name() -> None:
    message = _refusal(_params("Model", data=None, model_args={"num_classes": 2}))
    assert message.startswith(
        "model.class_path: usercontract.Model defines neither train_dataloader() nor "
        "train_dataset(); the train stage trains on it: define one of them in the model, or "
        "name a LightningDataModule under data"
    )
    message = _refusal(_params("TrainLoaderOnly", data=None))
    assert "defines neither test_dataloader() nor test_dataset()" in message
    # Control: the same model with a data module meets the contract.
    check_recipe(*(lambda p: (p, resolve_recipe(p)))(_params("Model")))


def test_a_model_that_downloads_in_prepare_data_is_refused_unless_it_names_a_data_path(
    tmp_path: Path,
) -> None:
    params = _params("ModelDownloads", data=None, model_args={"data_dir": str(tmp_path)})
    message = _prepare_refusal(params, [])
    assert message.startswith(
        "model.class_path: usercontract.ModelDownloads defines prepare_data()"
    )
    check_prepare_data(resolve_recipe(params), [tmp_path])  # control: a --data folder


def test_without_an_evaluate_stage_no_test_step_or_test_split_is_needed() -> None:
    untested = _params("NoTestStep")
    unsplit = _params(data="NoTestDataset", model_args={"num_classes": 2})
    for params in (untested, unsplit):
        check_recipe(params, resolve_recipe(params), scores=False)
        # Control: with an evaluate stage, each is refused by name.
        assert "test" in _refusal(params)


EVALUATED = """\
stages:
  train: {cmd: reprotrain train --model m.safetensors}
  score:
    cmd: ["echo scoring", "reprotrain evaluate --model m.safetensors --metrics s.json"]
"""


def test_a_pipeline_scores_when_any_stage_runs_reprotrain_evaluate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from reprotrain.pipeline.stages.env import scores_in_pipeline

    dvc_yaml = tmp_path / "dvc.yaml"
    dvc_yaml.write_text(EVALUATED)
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    monkeypatch.setenv("DVC_STAGE", "train")
    assert scores_in_pipeline()  # a stage of another name, in a list of commands
    # Controls: without that stage, and outside `dvc repro`, nothing scores.
    dvc_yaml.write_text(EVALUATED.replace("reprotrain evaluate", "python score.py"))
    assert not scores_in_pipeline()
    dvc_yaml.write_text(EVALUATED)
    monkeypatch.delenv("DVC_STAGE")
    assert not scores_in_pipeline()


PARAMS_LISTED = """\
stages:
  train:
    cmd: reprotrain train
    params: [seed, data, {params.yaml: [train.max_epochs]}, {other.json: [x]}]
"""


def test_a_param_a_stage_lists_and_params_yaml_lacks_is_named(tmp_path: Path) -> None:
    from reprotrain.pipeline.command import missing_params

    (tmp_path / "dvc.yaml").write_text(PARAMS_LISTED)
    (tmp_path / "params.yaml").write_text("seed: 1\ntrain: {}\n")
    assert missing_params(tmp_path / "dvc.yaml") == [
        ("train", "params.yaml", "data"),
        ("train", "params.yaml", "train.max_epochs"),
    ]
    # Control: data: null is a value, and every listed key there: nothing missing.
    (tmp_path / "params.yaml").write_text("seed: 1\ndata: null\ntrain: {max_epochs: 2}\n")
    assert missing_params(tmp_path / "dvc.yaml") == []


def test_the_env_stage_refuses_it_in_one_line_under_dvc_repro(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from reprotrain.pipeline.stages.env import check_stage_params

    (tmp_path / "dvc.yaml").write_text(PARAMS_LISTED)
    (tmp_path / "params.yaml").write_text("seed: 1\ntrain: {max_epochs: 2}\n")
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    monkeypatch.setenv("DVC_STAGE", "env")
    with pytest.raises(ConfigError) as refused:
        check_stage_params()
    assert str(refused.value).startswith(
        f"{tmp_path / 'dvc.yaml'}: stage 'train' lists the param 'data', which params.yaml does "
        "not have, so DVC would stop at that stage after deleting its outputs; add data to "
        "params.yaml (data: null for a section left out"
    )
    (tmp_path / "params.yaml").write_text("seed: 1\ndata: null\ntrain: {max_epochs: 2}\n")
    check_stage_params()  # control: nothing missing


PACKAGE = """
import lightning as L


class Net(L.LightningModule):
    pass


class Data(L.LightningDataModule):
    pass
"""


def test_code_the_train_stage_does_not_depend_on_is_refused_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from reprotrain.pipeline.contract import check_code_tracked

    (tmp_path / "untracked").mkdir()  # a name no other test imports: it stays imported
    (tmp_path / "untracked" / "__init__.py").write_text("")
    (tmp_path / "untracked" / "model.py").write_text(PACKAGE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    sections = {"model": {"class_path": "untracked.model.Net", "init_args": {}},
                "data": {"class_path": "untracked.model.Data", "init_args": {}}}  # fmt: skip
    recipe = resolve_recipe(parse_params(params_with(sections)))
    dvc_yaml = tmp_path / "dvc.yaml"
    with pytest.raises(ConfigError) as refused:
        check_code_tracked(recipe, [(tmp_path / "data").resolve()], dvc_yaml)
    line = str(refused.value)
    assert line.startswith("data.class_path: untracked.model.Data: its code untracked/")
    assert "not among the train stage's deps" in line and "add `- untracked` to" in line
    # Control: with the package among the deps, nothing is refused.
    package = (tmp_path / "untracked").resolve()
    check_code_tracked(recipe, [package], dvc_yaml)
    # A code: entry the deps miss is named by its key, for the stage checked.
    (tmp_path / "vocab.txt").write_text("abc")
    sections["model"]["code"] = ["vocab.txt"]
    recipe = resolve_recipe(parse_params(params_with(sections)))
    with pytest.raises(ConfigError) as refused:
        check_code_tracked(recipe, [package], dvc_yaml, "evaluate")
    assert str(refused.value).startswith(
        "model.code[0]: 'vocab.txt': its code vocab.txt is not among the evaluate stage's deps"
    )
    check_code_tracked(recipe, [package, (tmp_path / "vocab.txt").resolve()], dvc_yaml)
