"""Stage evaluate: identical weights give identical metric bytes; bad model files are refused.

Also, each with its control: layers a module builds in ``setup`` or
``configure_model`` (Lightning's documented ways) are there when the weights
load, and a real mismatch is one line naming the keys; ``test_samples``
counts what the test loop saw, an ``IterableDataset`` too, the committed
value for the shipped recipes, and is left out, with the reason, where a
batch cannot tell; under ``dvc repro`` a failed evaluate puts the earlier
``metrics.json`` back (slow).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

from reprotrain.atomic import atomic_write_safetensors
from reprotrain.hashing import safetensors_metadata
from reprotrain.provenance.dvcchecksum import md5_file
from tests.helpers import ROOT, cli_env, run_checked, run_cli, stage_argv


def _run(stage: str, work: Path, prepared: Path, model: Path, *extra: str):
    plots = ("--plots", work / f"{stage}-plots") if stage == "train" else ()
    return run_cli(
        stage,
        *extra,
        *("--data", prepared, "--model", model, "--metrics", work / f"{stage}.json"),
        *plots,
        cwd=work,
    )


@pytest.fixture(scope="module")
def model(prepared: Path, env_record: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("model")
    out = work / "model.safetensors"
    extra = (
        *("--params", str(ROOT / "params.yaml"), "-S", "train.max_epochs=1"),
        *("-S", f"data.init_args.path={prepared}"),
        *("--env", str(env_record), "--run-record", str(work / "run.json")),
        *("--checkpoints", str(work / "ckpt")),
    )
    assert _run("train", work, prepared, out, *extra).returncode == 0
    return out


def test_evaluate_twice_gives_identical_bytes(tmp_path: Path, prepared: Path, model: Path) -> None:
    first, second = tmp_path / "1", tmp_path / "2"
    for work in (first, second):
        work.mkdir()
        result = _run("evaluate", work, prepared, model)
        assert result.returncode == 0, result.stderr
    assert (first / "evaluate.json").read_bytes() == (second / "evaluate.json").read_bytes()
    metrics = json.loads((first / "evaluate.json").read_text())
    # Exactly what the module's test_step logs, and the sample count.
    assert set(metrics) == {"test_samples", "test_loss", "test_acc"}
    assert metrics["test_samples"] == 270 and 0 <= metrics["test_acc"] <= 1


def test_corrupt_model_file_is_refused(tmp_path: Path, prepared: Path, model: Path) -> None:
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(model.read_bytes()[:100])
    result = _run("evaluate", tmp_path, prepared, bad)
    assert result.returncode == 2
    assert "not a reprotrain model file" in result.stderr
    assert not (tmp_path / "evaluate.json").exists()


def test_tampered_weights_are_refused_by_hash_before_loading(repo_copy: Path) -> None:
    model = repo_copy / "models/model.safetensors"
    recorded = md5_file(model)
    blob = bytearray(model.read_bytes())
    blob[-1] ^= 1  # a weight bit: the file still parses, only the hash can tell
    model.write_bytes(bytes(blob))
    before = (repo_copy / "reports/metrics.json").read_bytes()
    result = run_cli(*stage_argv(repo_copy, "evaluate"), cwd=repo_copy)
    assert result.returncode == 2
    assert "models/model.safetensors: md5" in result.stderr and recorded in result.stderr
    assert (repo_copy / "reports/metrics.json").read_bytes() == before


#: A package as Lightning's docs write one: layers built in ``__init__``, ``setup`` or
#: ``configure_model`` (or, the control, in ``setup("fit")`` alone); test loaders over a
#: map-style dataset and over an IterableDataset.
PROBE = """\
import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset


def rows(n=50):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    return x, (x[:, 0] > 0).long()


class Net(L.LightningModule):
    def __init__(self, hidden: int = 8):
        super().__init__()
        self.save_hyperparameters()

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class BuiltInInit(Net):
    def __init__(self, hidden: int = 8):
        super().__init__(hidden)
        self.body = nn.Linear(4, hidden)
        self.head = nn.Linear(hidden, 2)


class BuiltInSetup(Net):
    def __init__(self, hidden: int = 8):
        super().__init__(hidden)
        self.body = nn.Linear(4, hidden)

    def setup(self, stage):
        if not hasattr(self, "head"):
            self.head = nn.Linear(self.hparams.hidden, 2)


class BuiltInConfigureModel(Net):
    def configure_model(self):
        if not hasattr(self, "body"):
            self.body = nn.Linear(4, self.hparams.hidden)
            self.head = nn.Linear(self.hparams.hidden, 2)


class BuiltForFitOnly(BuiltInSetup):
    def setup(self, stage):
        if stage == "fit":
            self.head = nn.Linear(self.hparams.hidden, 2)


class Rows(L.LightningDataModule):
    def __init__(self, batch_size: int = 16):
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage):
        self.rows = TensorDataset(*rows())

    def train_dataloader(self):
        return DataLoader(self.rows, batch_size=self.hparams.batch_size)

    def val_dataloader(self):
        return DataLoader(self.rows, batch_size=self.hparams.batch_size)

    def test_dataloader(self):
        return DataLoader(self.rows, batch_size=self.hparams.batch_size)


class Stream(IterableDataset):
    def __iter__(self):
        return zip(*rows())


class Streamed(Rows):
    def test_dataloader(self):
        return DataLoader(Stream(), batch_size=self.hparams.batch_size)


class StreamedUnbatched(Rows):
    def test_dataloader(self):
        return DataLoader(Stream(), batch_size=None)
"""


def _params(model: str, data: str = "Rows") -> dict:
    """The repository's params with the probe's model and data module."""
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["model"] = {"class_path": f"evalprobe.{model}", "init_args": {"hidden": 8}}
    params["data"] = {"class_path": f"evalprobe.{data}", "init_args": {"batch_size": 16}}
    params["train"]["max_epochs"] = 1
    return params


def _probe(work: Path, model: str, data: str = "Rows") -> Path:
    """``work/evalprobe`` and a weights file of ``model`` as the train stage writes one: the
    whole ``state_dict`` after ``setup("fit")`` and ``configure_model()``, params as metadata."""
    (work / "evalprobe").mkdir(exist_ok=True)
    (work / "evalprobe" / "__init__.py").write_text(PROBE)
    spec = importlib.util.spec_from_file_location(
        f"evalprobe_{model}", work / "evalprobe" / "__init__.py"
    )
    package = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(package)  # type: ignore[union-attr]
    torch.manual_seed(0)
    module = getattr(package, model)()
    module.setup("fit")
    module.configure_model()
    weights = {name: t.detach().contiguous() for name, t in module.state_dict().items()}
    out = work / "model.safetensors"
    atomic_write_safetensors(out, weights, safetensors_metadata({"params": _params(model, data)}))
    return out


def _evaluate(work: Path, model: Path) -> subprocess.CompletedProcess[str]:
    return run_cli("evaluate", "--model", model, "--metrics", work / "metrics.json", cwd=work)


@pytest.mark.parametrize("model", ["BuiltInSetup", "BuiltInConfigureModel"])
def test_layers_built_in_setup_or_configure_model_take_their_weights(
    model: str, tmp_path: Path
) -> None:
    result = _evaluate(tmp_path, _probe(tmp_path, model))
    assert result.returncode == 0, result.stderr
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert set(metrics) == {"test_loss", "test_samples"} and metrics["test_samples"] == 50


def test_weights_that_do_not_fit_are_one_line_naming_the_keys(tmp_path: Path) -> None:
    # Control: setup("test") builds no head, so the weights' head has nowhere to go.
    result = _evaluate(tmp_path, _probe(tmp_path, "BuiltForFitOnly"))
    assert result.returncode == 2
    [line] = result.stderr.splitlines()
    assert line.startswith("reprotrain: error: ") and "do not fit evalprobe.BuiltForFitOnly" in line
    assert 'Unexpected key(s) in state_dict: "head.bias", "head.weight"' in line, line
    assert "Error(s) in loading" not in line and "retrain it (`dvc repro train`)" in line
    assert not (tmp_path / "metrics.json").exists()


def test_an_iterable_test_loader_counts_the_samples_it_gave(tmp_path: Path) -> None:
    result = _evaluate(tmp_path, _probe(tmp_path, "BuiltInSetup", "Streamed"))
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "metrics.json").read_text())["test_samples"] == 50
    assert "on 50 samples" in result.stdout
    # Control: items a loader does not batch need not be one sample each: left out, and why.
    result = _evaluate(tmp_path, _probe(tmp_path, "BuiltInSetup", "StreamedUnbatched"))
    assert result.returncode == 0, result.stderr
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert "test_samples" not in metrics and "test_loss" in metrics
    assert "test_samples left out: the test loader does not batch" in result.stdout


def test_a_batch_counts_the_first_dimension_its_tensors_share() -> None:
    from reprotrain.pipeline.stages.evaluate import samples_in

    x, y = torch.zeros(5, 3), torch.zeros(5, dtype=torch.long)
    assert samples_in((x, y)) == samples_in({"x": x, "y": y, "scale": torch.tensor(2.0)}) == 5
    # Controls: no tensor, or tensors that disagree, give no count but the reason.
    assert "holds no tensor" in str(samples_in((["a", "b"], [0, 1])))
    assert "(3, 5)" in str(samples_in((x, torch.zeros(3))))


@pytest.mark.parametrize("pipeline", [".", "pipelines/lm"])
def test_the_shipped_recipes_count_the_committed_test_samples(
    pipeline: str, prepared: Path
) -> None:
    import lightning as L

    from reprotrain.pipeline.data import PipelineLoaders
    from reprotrain.pipeline.params_file import load_params
    from reprotrain.pipeline.recipe import resolve_component
    from reprotrain.pipeline.stages.evaluate import samples_in

    folder = ROOT / pipeline
    digits = ["data.init_args.path=" + str(prepared)] if pipeline == "." else []
    params = load_params(folder / "params.yaml", digits)
    source = resolve_component(params.data, "data", L.LightningDataModule).instantiate()
    source.setup("test")
    loader = PipelineLoaders(source, seed=params.seed).test_dataloader()
    counted = sum(samples_in(batch) for batch in loader)  # type: ignore[misc]
    committed = json.loads((folder / "reports" / "metrics.json").read_text())["test_samples"]
    assert counted == committed == len(loader.dataset)  # type: ignore[arg-type]


#: A pipeline of the probe: env, train and evaluate, as a user's dvc.yaml writes them.
PROBE_DVC_YAML = """\
stages:
  env:
    cmd: reprotrain env --out reports/environment.json
    always_changed: true
    params:
      - params.yaml:
    outs:
      - reports/environment.json:
          cache: false
          persist: true
  train:
    cmd: >-
      reprotrain train --model models/model.safetensors --metrics reports/train_metrics.json
      --plots reports/plots/train --env reports/environment.json --run-record reports/run.json
      --checkpoints checkpoints
    deps:
      - evalprobe
      - reports/environment.json
    params:
      - seed
      - model
      - data
      - train.max_epochs
    outs:
      - models/model.safetensors
      - reports/run.json:
          cache: false
      - reports/plots/train:
          cache: false
    metrics:
      - reports/train_metrics.json:
          cache: false
  evaluate:
    cmd: reprotrain evaluate --model models/model.safetensors --metrics reports/metrics.json
    deps:
      - evalprobe
      - models/model.safetensors
    metrics:
      - reports/metrics.json:
          cache: false
"""


@pytest.mark.slow
def test_a_failed_evaluate_under_dvc_repro_leaves_the_earlier_metrics(tmp_path: Path) -> None:
    lock = {"REPROTRAIN_LOCK": str(ROOT / "requirements-cpu.lock")}

    def repro(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["dvc", "repro", *args], cwd=tmp_path, env=cli_env(**lock), capture_output=True,
            text=True, timeout=600,
        )  # fmt: skip

    (tmp_path / "evalprobe").mkdir()
    (tmp_path / "evalprobe" / "__init__.py").write_text(PROBE)
    (tmp_path / "dvc.yaml").write_text(PROBE_DVC_YAML)
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump(_params("BuiltInInit")))
    run_checked("git", "init", "-q", cwd=tmp_path)
    run_checked("dvc", "init", "-q", cwd=tmp_path)
    first = repro()
    assert first.returncode == 0, first.stdout + first.stderr
    metrics = tmp_path / "reports" / "metrics.json"
    earlier = metrics.read_bytes()
    # The env stage passes and train trains, but setup("test") builds no head: evaluate fails
    # after DVC deleted metrics.json (cache: false, so `dvc checkout` would not restore it).
    params.write_text(yaml.safe_dump(_params("BuiltForFitOnly")))
    failed = repro()
    assert failed.returncode != 0
    assert "Running stage 'evaluate'" in failed.stdout + failed.stderr
    [line] = [x for x in failed.stderr.splitlines() if x.startswith("reprotrain: error:")]
    assert 'Unexpected key(s) in state_dict: "head.bias", "head.weight"' in line, line
    assert line.endswith("(the earlier outputs are back in place: reports/metrics.json)"), line
    assert metrics.read_bytes() == earlier
    # Control: evaluate alone (`-s`: no env stage, so nothing kept) loses the file, as DVC would.
    alone = repro("-s", "evaluate")
    assert alone.returncode != 0
    assert "`dvc checkout evaluate` restores them" in alone.stderr
    assert not metrics.exists()
