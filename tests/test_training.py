"""The train stage's fit and outputs with modules written as Lightning's docs write them.

Each module is :class:`Net` with one thing changed, trained in this process by
:func:`~reprotrain.pipeline.training.fit` and written by ``write_outputs`` as
the stage does: tied weights (nanoGPT's embedding and head), manual
optimization, a ``training_step`` that skips batches by returning ``None``,
``configure_optimizers`` returning ``None``, no ``validation_step`` and only
per-step metrics, and an ``on_save_checkpoint`` that stores an object. Each
trains, is written, and resumes after SIGTERM to the uninterrupted run's
bytes (the object in a checkpoint: none is kept, and the rerun starts over to
them). World-size invariance refuses manual optimization and a skipped batch
by name, and a skipped batch on two DDP ranks is one line (slow). Each test
has its negative control.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any
from unittest import mock

import lightning as L
import pytest
import torch
import torch.nn.functional as F
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import save
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from reprotrain.cpu.profile import CpuProfile
from reprotrain.determinism import configure_determinism
from reprotrain.hashing import load_safetensors
from reprotrain.pipeline.config import ConfigError
from reprotrain.pipeline.curves import MemoryLogger
from reprotrain.pipeline.errors import DataError, Interrupted
from reprotrain.pipeline.params_file import parse_params
from reprotrain.pipeline.recipe import hooks_skipped, resolve_recipe
from reprotrain.pipeline.resume_point import Checkpointing, find_resume_point
from reprotrain.pipeline.train_files import write_outputs
from reprotrain.pipeline.training import fit
from reprotrain.trace.callback import TraceCallback
from tests.helpers import ROOT, params_with, run_cli

pytestmark = pytest.mark.usefixtures("restore_torch_flags")

#: 24 samples in batches of 4: 6 steps an epoch; step 8 is epoch 1's third batch.
EPOCHS, SIGTERM_STEP = 2, 8
OUTPUTS = ("model.safetensors", "trace.safetensors", "metrics.json", "plots/train_loss.csv")
#: Where a fresh process imports this module from (its classes are named by ``__name__``).
THIS = str(Path(__file__).parent)


class TinyData(L.LightningDataModule):
    """Its own loaders over one seeded table, as Lightning's docs write a data module."""

    def __init__(self, batch_size: int = 4) -> None:
        super().__init__()
        self.batch_size = batch_size

    def setup(self, stage: str) -> None:
        x = torch.randn(24, 4, generator=torch.Generator().manual_seed(0))
        self.data = TensorDataset(x, (x[:, 0] > 0).long())

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=8)

    test_dataloader = val_dataloader


class Net(L.LightningModule):
    """Automatic optimization; no validation_step; logs ``mine`` per step only."""

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.a = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.a(x)))

    def loss(self, batch: list[torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(self(batch[0]), batch[1])

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor | None:
        loss = self.loss(batch)
        self.log("mine", loss)
        return loss

    def test_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.log("test_loss", self.loss(batch))

    def configure_optimizers(self) -> torch.optim.Optimizer | None:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


#: Each ``setup`` a :class:`Standalone` ran, in order (cleared by the tests that read it).
SETUPS: list[str] = []


class Standalone(Net):
    """TinyData's setup and loaders in the module itself, and no data module: what
    LightningCLI runs as ``trainer.fit(model)`` for a config with no ``data`` section."""

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__(lr)
        self.batch_size = 4

    def setup(self, stage: str) -> None:
        SETUPS.append(stage)
        TinyData.setup(self, stage)  # type: ignore[arg-type]

    train_dataloader = TinyData.train_dataloader
    val_dataloader = TinyData.val_dataloader
    test_dataloader = TinyData.val_dataloader


class NoTest(Net):
    """No test_step: trains, but there is nothing to score."""

    test_step = L.LightningModule.test_step


class TrainerInSetup(Standalone):
    """Reads ``self.trainer`` in ``setup``, which the pipeline runs before the Trainer exists."""

    def setup(self, stage: str) -> None:
        self.epochs = self.trainer.max_epochs
        super().setup(stage)


class Downloading(Standalone):
    """A download in prepare_data, as Lightning's docs write one (its files: --data)."""

    def prepare_data(self) -> None:
        raise AssertionError("downloaded")


#: The test split each :class:`GlobalSplit` drew, by stage, in order.
SPLITS: list[tuple[str, list[int]]] = []


class GlobalSplit(Standalone):
    """Splits off its test part with torch's global generator (no generator of its own),
    which the contract allows: the run's seed decides it."""

    def setup(self, stage: str) -> None:
        super().setup(stage)
        part = torch.utils.data.random_split(self.data, [12, 12])[1]
        SPLITS.append((stage, list(part.indices)))
        self.test_part = part

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.test_part, batch_size=8)


class TrainOnly(Standalone):
    """Only ``train_dataloader()``, as Lightning's docs' first LitModel: no val, no test."""

    val_dataloader = L.LightningModule.val_dataloader
    test_dataloader = L.LightningModule.test_dataloader


class TrainerInTestSetup(Standalone):
    """Reads ``self.trainer`` in its ``setup("test")`` only: trains, then evaluate runs it."""

    def setup(self, stage: str) -> None:
        if stage == "test":
            self.devices = self.trainer.num_devices
        super().setup(stage)


class LayersInSetup(Standalone):
    """Builds a layer in ``setup`` and one in ``configure_model``, as Lightning allows."""

    def setup(self, stage: str) -> None:
        super().setup(stage)
        self.extra = nn.Linear(4, 4)

    def configure_model(self) -> None:
        self.late = nn.Linear(4, 4)


#: The modules that give their own data: params.yaml names no data module for them.
OWN_DATA = ("Standalone", "TrainerInSetup", "Downloading", "GlobalSplit", "TrainOnly",
            "TrainerInTestSetup", "LayersInSetup")  # fmt: skip


class Checked(Net):
    """Refuses an argument in ``__init__`` with a ValueError, as nanoGPT's ``n_head`` check."""

    def __init__(self, lr: float = 0.1) -> None:
        if lr > 1:
            raise ValueError(f"lr {lr} above 1")
        super().__init__(lr)


class Validated(Net):
    """Logs ``val_loss`` per epoch too."""

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch))


class Tied(Net):
    """Weight tying, as nanoGPT ties its embedding and head: one Parameter, two names."""

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__(lr)
        self.b = nn.Linear(4, 4)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.b(torch.relu(self.a(x)))))


class Manual(Net):
    """Manual optimization as Lightning's docs write it: training_step returns nothing."""

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__(lr)
        self.automatic_optimization = False

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        opt = self.optimizers()
        loss = self.loss(batch)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        self.log("mine", loss)


class Skipping(Net):
    """Returns None for odd batches: Lightning's documented "skip this batch"."""

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor | None:
        loss = super().training_step(batch, batch_idx)
        return None if batch_idx % 2 else loss


class NoOptimizer(Net):
    """``configure_optimizers`` returns None, which Lightning allows: no optimizer."""

    def configure_optimizers(self) -> None:
        return None


class Cool:
    """An object a module keeps in its checkpoints (Lightning's docs' my_cool_pickable_object)."""

    def __init__(self) -> None:
        self.note = "cool"


class Hooked(Net):
    """Stores a value of its own in each checkpoint, as Lightning's docs show: an object, or
    (``plain``) a tensor."""

    def __init__(self, lr: float = 0.1, plain: bool = False) -> None:
        super().__init__(lr)
        self.plain = plain

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["something_cool_i_want_to_save"] = torch.ones(2) if self.plain else Cool()


class OwnCheckpoints(Net):
    """Its own ModelCheckpoint with no dirpath, from configure_callbacks (Lightning's docs)."""

    def configure_callbacks(self) -> list[L.Callback]:
        return [ModelCheckpoint(save_top_k=1)]


class SigtermAt(L.Callback):
    """SIGTERM to this process at the start of one global step, as a preemption does."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def _params(model: str, **changes: Any) -> dict:
    return params_with(
        {
            "model": {"class_path": f"{__name__}.{model}", "init_args": {}},
            "data": None if model in OWN_DATA else {"class_path": f"{__name__}.TinyData"},
            "train.max_epochs": EPOCHS,
            "train.checkpoint_every_n_epochs": 1,
            **changes,
        }
    )


def _train(
    out: Path, model: str, sigterm_at: int | None = None, seed: int = 42, **init_args: Any
) -> Path:
    """Train ``model`` as the train stage does, resuming from ``out/ckpt``; write ``out``."""
    raw = _params(model, seed=seed)
    raw["model"]["init_args"] = init_args
    params = parse_params(raw)
    recipe = resolve_recipe(params)
    settings = configure_determinism(params.seed, params.deterministic)
    checkpoints = out / "ckpt"
    checkpointing = Checkpointing(checkpoints, "run", find_resume_point(checkpoints, "run"))
    tracer = TraceCallback(None, detail=params.train.trace)
    stop = [SigtermAt(sigterm_at)] if sigterm_at is not None else []
    fitted = fit(params, recipe, settings, checkpointing, [tracer, *stop])
    written = argparse.Namespace(
        model=out / "model.safetensors", metrics=out / "metrics.json", plots=out / "plots"
    )
    write_outputs(written, params, recipe, settings, fitted)
    tracer.write(out / "trace.safetensors")
    return out


@pytest.fixture
def repository(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty working folder, as the repository root a stage runs in."""
    folder = tmp_path / "repo"
    folder.mkdir()
    monkeypatch.chdir(folder)
    return folder


def test_a_modules_own_checkpoints_go_beside_the_pipelines_not_into_the_repository(
    tmp_path: Path, repository: Path
) -> None:
    run = _train(tmp_path / "out", "OwnCheckpoints")
    written = sorted((run / "lightning").rglob("*.ckpt"))
    assert [p.relative_to(run).parts[:4] for p in written] == [
        ("lightning", "memory", "0", "checkpoints")
    ]
    assert list(repository.iterdir()) == []


def test_without_a_root_the_pipelines_logger_sends_them_into_the_working_folder(
    repository: Path,
) -> None:
    # negative control of the test above: what fit's default_root_dir prevents
    trainer = L.Trainer(
        max_epochs=1, logger=MemoryLogger(), callbacks=[ModelCheckpoint()],
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    data = TinyData()
    trainer.fit(Net(), datamodule=data)
    assert list((repository / "memory" / "0" / "checkpoints").glob("*.ckpt"))


def _metrics(run: Path) -> dict[str, Any]:
    return json.loads((run / "metrics.json").read_text())


def _step_rows(run: Path) -> list[list[str]]:
    return [line.split(",") for line in (run / "plots/train_loss.csv").read_text().splitlines()]


def test_tied_weights_are_written_per_name_and_load_strictly_into_a_fresh_instance(
    tmp_path: Path,
) -> None:
    run = _train(tmp_path, "Tied")
    weights, _ = load_safetensors(run / "model.safetensors")
    assert torch.equal(weights["a.weight"], weights["b.weight"])
    fresh = Tied()
    fresh.load_state_dict(weights, strict=True)
    assert fresh.b.weight is fresh.a.weight  # tied again, as the module built them
    # evaluate rebuilds the module from the file's metadata and loads it strictly
    scored = run_cli("evaluate", "--model", run / "model.safetensors", "--metrics",
                     run / "test.json", cwd=ROOT, PYTHONPATH=THIS)  # fmt: skip
    assert scored.returncode == 0, scored.stderr
    assert json.loads((run / "test.json").read_text())["test_samples"] == 24
    # Control: safetensors alone refuses the module's state_dict (the crash this fixes).
    with pytest.raises(RuntimeError, match="share memory"):
        save(fresh.state_dict())


@pytest.mark.parametrize(
    ("model", "step"),
    [("Tied", SIGTERM_STEP), ("Manual", SIGTERM_STEP), ("Skipping", SIGTERM_STEP + 1),
     ("NoOptimizer", SIGTERM_STEP), ("Standalone", SIGTERM_STEP)],
    ids=["tied weights", "manual optimization", "at a skipped batch", "no optimizer",
         "no data module"],
)  # fmt: skip
def test_sigterm_then_the_rerun_resumes_to_the_uninterrupted_files(
    model: str, step: int, tmp_path: Path
) -> None:
    straight = _train(tmp_path / "straight", model)
    with pytest.raises(Interrupted, match=rf"its last checkpoint, epoch=1-step={step + 1}\.ckpt"):
        _train(tmp_path / "resumed", model, sigterm_at=step)
    # Control: the rerun does resume (from the checkpoint at the signal), not start over.
    assert (
        find_resume_point(tmp_path / "resumed/ckpt", "run").name == f"epoch=1-step={step + 1}.ckpt"
    )
    resumed = _train(tmp_path / "resumed", model)
    for name in OUTPUTS:
        assert (resumed / name).read_bytes() == (straight / name).read_bytes(), name
    assert _metrics(straight)["steps"] == EPOCHS * 6 and _metrics(straight)["epochs"] == EPOCHS


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return load_safetensors(run / "model.safetensors")[0]


def test_a_module_with_its_own_data_and_no_data_module_trains_as_the_data_module_would(
    tmp_path: Path,
) -> None:
    SETUPS.clear()
    alone = _train(tmp_path / "alone", "Standalone")
    assert SETUPS == ["fit"]  # once, as Lightning runs it: the pipeline's call, not a second
    in_a_data_module = _train(tmp_path / "data module", "Net")
    # The same loaders, set up once either way: the same order, so the same bits
    weights, reference = _weights(alone), _weights(in_a_data_module)
    assert weights.keys() == reference.keys()
    for name, tensor in weights.items():
        assert torch.equal(tensor, reference[name]), name
    for name in ("metrics.json", "plots/train_loss.csv"):
        assert (alone / name).read_bytes() == (in_a_data_module / name).read_bytes(), name
    recorded = load_safetensors(alone / "model.safetensors")[1]["params"]
    assert recorded["data"] is None and recorded["model"]["class_path"].endswith(".Standalone")
    # evaluate rebuilds it from the weights file and scores its own test_dataloader()
    scores = _evaluate(alone)
    assert SETUPS == ["fit", "test"] and scores["test_samples"] == 24
    assert scores == _evaluate(in_a_data_module)


def test_a_module_with_its_own_data_trains_and_scores_other_bits_under_another_seed(
    tmp_path: Path,
) -> None:
    """The control of the test above: its comparisons can fail."""
    alone = _train(tmp_path / "alone", "Standalone")
    other = _train(tmp_path / "other seed", "Standalone", seed=7)
    assert not torch.equal(_weights(other)["head.weight"], _weights(alone)["head.weight"])
    assert _evaluate(other)["test_loss"] != _evaluate(alone)["test_loss"]


def test_with_no_data_module_a_setup_that_reads_the_trainer_is_one_line_saying_where_to_move_it(
    tmp_path: Path,
) -> None:
    with pytest.raises(ConfigError) as refused:
        _train(tmp_path, "TrainerInSetup")
    line = str(refused.value)
    assert line.startswith(f"model.class_path: {__name__}.TrainerInSetup: its setup('fit') reads")
    assert "move that code to configure_model or on_fit_start" in line and "\n" not in line
    # Control: the same module without the read trains (Standalone, above).


def test_evaluate_refuses_a_model_without_test_step_in_one_line(
    tmp_path: Path,
) -> None:
    with pytest.raises(ConfigError) as refused:
        _evaluate(_train(tmp_path / "untested", "NoTest"))
    line = str(refused.value)
    assert line.startswith(f"model.class_path: {__name__}.NoTest defines no test_step; ")
    assert "or drop the evaluate stage from dvc.yaml" in line
    assert not (tmp_path / "untested" / "scores.json").exists()
    # Control: the same module with its test_step is scored.
    assert "test_loss" in _evaluate(_train(tmp_path / "tested", "Net"))


def test_the_models_prepare_data_is_never_run_in_train_or_evaluate(
    tmp_path: Path,
) -> None:
    run = _train(tmp_path, "Downloading")
    assert _evaluate(run)["test_samples"] == 24
    # Control: Lightning itself runs it at the start of fit.
    trainer = L.Trainer(max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    with pytest.raises(AssertionError, match="downloaded"):
        trainer.fit(Downloading())


def test_evaluate_draws_the_test_split_the_train_stage_drew_from_the_runs_seed(
    tmp_path: Path,
) -> None:
    SPLITS.clear()
    run = _train(tmp_path / "run", "GlobalSplit")
    torch.rand(5)  # the process's generators are anywhere by now, as in a fresh process
    assert _evaluate(run)["test_samples"] == 12
    (fit, trained), (test, scored) = SPLITS
    assert (fit, test) == ("fit", "test") and scored == trained
    # Control: another seed draws another split.
    _train(tmp_path / "other", "GlobalSplit", seed=7)
    assert SPLITS[-1][1] != trained


def test_a_model_with_only_its_train_loader_trains_the_bits_its_loader_trains_elsewhere(
    tmp_path: Path,
) -> None:
    alone = _train(tmp_path / "train only", "TrainOnly")
    with_all = _train(tmp_path / "all loaders", "Standalone")  # Net validates nothing either
    for name in ("metrics.json", "plots/train_loss.csv"):
        assert (alone / name).read_bytes() == (with_all / name).read_bytes(), name


def test_evaluate_says_in_one_line_that_a_setup_reading_the_trainer_runs_without_one(
    tmp_path: Path,
) -> None:
    run = _train(tmp_path, "TrainerInTestSetup")  # its setup("fit") reads no trainer
    with pytest.raises(ConfigError) as refused:
        _evaluate(run)
    line = str(refused.value)
    assert line.startswith(f"model.class_path: {__name__}.TrainerInTestSetup: its setup('test')")
    assert "\n" not in line
    # Control: the module without that read is scored (Standalone, above).


def test_bench_and_locate_build_the_layers_setup_and_configure_model_add() -> None:
    from reprotrain.pipeline.recipe import fresh_model

    recipe = resolve_recipe(parse_params(_params("LayersInSetup")))
    model = fresh_model(recipe, {})
    assert {"extra", "late"} <= {name for name, _ in model.named_children()}
    # Control: the class alone, as they built it before, has neither.
    assert not {"extra", "late"} & {name for name, _ in recipe.model.instantiate().named_children()}


def test_the_skipped_hooks_are_the_modules_own_again_after_the_block() -> None:
    module, SETUPS[:] = Downloading(), []
    with hooks_skipped(module, module):
        module.prepare_data()
        module.setup("fit")
    assert SETUPS == []
    with pytest.raises(AssertionError, match="downloaded"):  # control: its own again
        module.prepare_data()
    module.setup("fit")
    assert SETUPS == ["fit"]


def test_a_value_error_from_the_modules_init_is_one_line_naming_its_section(
    tmp_path: Path,
) -> None:
    with pytest.raises(ConfigError) as refused:
        _train(tmp_path / "refused", "Checked", lr=2.0)
    assert str(refused.value) == (
        f"model.init_args: {__name__}.Checked refused its arguments (lr 2.0 above 1); fix them "
        "under model.init_args in params.yaml"
    )
    assert (_train(tmp_path / "control", "Checked", lr=0.5) / "model.safetensors").exists()


def _evaluate(run: Path) -> dict[str, Any]:
    """The evaluate stage on ``run``'s weights, in this process, under this process's CPU
    profile (the CLI restarts under the one the weights were trained with)."""
    from reprotrain.pipeline.stages import evaluate

    scores = run / "scores.json"
    args = argparse.Namespace(model=run / "model.safetensors", metrics=scores, data=[],
                              dvc_lock=None)  # fmt: skip
    with mock.patch.object(CpuProfile, "apply", lambda self: []):
        evaluate.run(None, args)
    return json.loads(scores.read_text())


def test_manual_optimization_logs_the_loss_it_passed_to_manual_backward(tmp_path: Path) -> None:
    rows = _step_rows(_train(tmp_path, "Manual"))
    assert rows[0] == ["step", "train_loss", "mine"] and len(rows) == 1 + EPOCHS * 6
    assert all(loss == mine != "" for _, loss, mine in rows[1:])  # the step's one loss, to the bit
    assert _metrics(tmp_path)["train_loss"] == float(rows[-1][1])


def test_a_skipped_batch_has_no_train_loss_and_the_others_keep_theirs(tmp_path: Path) -> None:
    rows = _step_rows(_train(tmp_path, "Skipping"))
    losses = [loss for _, loss, _ in rows[1:]]
    assert len(rows) == 1 + EPOCHS * 6  # every step has its row: the module logged in each
    assert all((loss == "") == bool(step % 6 % 2) for step, loss in enumerate(losses))
    assert all(loss == mine for _, loss, mine in rows[1:] if loss)
    metrics = _metrics(tmp_path)
    assert metrics["steps"] == EPOCHS * 6 and metrics["train_loss"] == float(losses[-2])
    # Control: the same module without the skip has a loss at every step.
    assert all(loss for _, loss, _ in _step_rows(_train(tmp_path / "control", "Net"))[1:])


def test_epochs_counts_the_epochs_trained_when_no_epoch_logged_anything(tmp_path: Path) -> None:
    run = _train(tmp_path / "steps only", "Net")
    assert (run / "plots/val.csv").read_text() == "epoch\n"  # no epoch row: nothing to count
    assert _metrics(run)["epochs"] == EPOCHS
    # Control: with a metric per epoch, one row per epoch, and the same count.
    validated = _train(tmp_path / "validated", "Validated")
    assert len((validated / "plots/val.csv").read_text().splitlines()) == 1 + EPOCHS
    assert _metrics(validated)["epochs"] == EPOCHS


def test_a_checkpoint_that_weights_only_refuses_is_not_kept_and_the_rerun_starts_over(
    tmp_path: Path,
) -> None:
    straight = _train(tmp_path / "straight", "Hooked")
    with pytest.raises(Interrupted) as stopped:
        _train(tmp_path / "stopped", "Hooked", sigterm_at=SIGTERM_STEP)
    line = str(stopped.value)
    assert "\n" not in line and "no checkpoint kept" in line
    assert f"checkpoint['something_cool_i_want_to_save'] holds a {__name__}.Cool" in line
    assert "weights_only" in line and "store plain values or tensors there" in line
    assert not list((tmp_path / "stopped/ckpt").glob("*.ckpt"))
    rerun = _train(tmp_path / "stopped", "Hooked")  # from the first step
    for name in OUTPUTS:
        assert (rerun / name).read_bytes() == (straight / name).read_bytes(), name
    # Control: the same hook storing a tensor keeps its checkpoint, and the rerun resumes.
    with pytest.raises(Interrupted, match=r"its last checkpoint, epoch=1-step=\d+\.ckpt, is kept"):
        _train(tmp_path / "plain", "Hooked", sigterm_at=SIGTERM_STEP, plain=True)
    assert list((tmp_path / "plain/ckpt").glob("epoch=1-step=*.ckpt"))


def _train_cli(out: Path, model: str, env: Path, **changes: Any) -> subprocess.CompletedProcess:
    """`reprotrain train` of ``model`` in a fresh process, params ``changes`` applied."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "params.yaml").write_text(yaml.safe_dump(_params(model, **changes)))
    outputs = {"--model": "model.safetensors", "--metrics": "metrics.json", "--plots": "plots",
               "--run-record": "run.json", "--checkpoints": "ckpt"}  # fmt: skip
    named = [arg for option, name in outputs.items() for arg in (option, out / name)]
    argv = ["train", "--params", out / "params.yaml", "--env", env, *named]
    return run_cli(*argv, cwd=ROOT, PYTHONPATH=THIS)


def _error_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stderr
    return result.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("model", "says"),
    [
        ("Manual", "sets automatic_optimization = False"),
        ("Skipping", "Skipping.training_step returned no loss for micro-batch 1 of epoch 0"),
    ],
)
def test_world_size_invariance_refuses_manual_optimization_and_skipped_batches_by_name(
    model: str, says: str, env_record: Path, tmp_path: Path
) -> None:
    invariant = {"train.world_size_invariant": True, "train.micro_batch_size": 2}
    line = _error_line(_train_cli(tmp_path / model, model, env_record, **invariant))
    assert line.startswith("reprotrain: error: train.world_size_invariant: true") and says in line
    assert not (tmp_path / model / "model.safetensors").exists()
    # Control: the same data and layout, a loss from every batch.
    control = _train_cli(tmp_path / "control", "Net", env_record, **invariant)
    assert control.returncode == 0, control.stderr


@pytest.mark.slow
def test_a_skipped_batch_on_two_ranks_is_one_line_naming_it(
    env_record: Path, tmp_path: Path
) -> None:
    """Lightning refuses a skipped batch in distributed training; the stage says so in one line."""
    ddp = {"train.strategy": "ddp", "train.devices": 2}
    line = _error_line(_train_cli(tmp_path / "skips", "Skipping", env_record, **ddp))
    assert f"model.class_path: {__name__}.Skipping: training_step returned None" in line
    assert "return a loss for every batch, or train on one process" in line
    # Control: manual optimization trains on two ranks (its train_loss: the ranks' mean).
    manual = _train_cli(tmp_path / "manual", "Manual", env_record, **ddp)
    assert manual.returncode == 0, manual.stderr
    rows = (tmp_path / "manual/plots/train_loss.csv").read_text().splitlines()
    assert rows[0] == "step,train_loss,mine" and len(rows) == 1 + EPOCHS * 3


@pytest.mark.slow
def test_a_module_with_its_own_data_trains_the_same_bits_on_one_and_two_ranks_under_invariance(
    env_record: Path, tmp_path: Path
) -> None:
    invariant = {"train.world_size_invariant": True, "train.micro_batch_size": 2}
    runs = {}
    for world in (1, 2):
        layout = {"train.strategy": "ddp", "train.devices": world} if world > 1 else {}
        trained = _train_cli(
            tmp_path / f"w{world}", "Standalone", env_record, **invariant, **layout
        )
        assert trained.returncode == 0, trained.stderr
        runs[world] = _weights(tmp_path / f"w{world}")
    assert all(torch.equal(runs[1][name], runs[2][name]) for name in runs[1])
    # Control: plain DDP shares the data out by rank, and two ranks train other bits.
    two_ranks = {"train.strategy": "ddp", "train.devices": 2}
    ddp = _train_cli(tmp_path / "ddp", "Standalone", env_record, **two_ranks)
    assert ddp.returncode == 0, ddp.stderr
    assert not torch.equal(_weights(tmp_path / "ddp")["head.weight"], runs[1]["head.weight"])


def test_a_run_that_diverged_is_one_line_and_writes_nothing(tmp_path: Path) -> None:
    with pytest.raises(DataError) as refused:
        _train(tmp_path / "diverged", "Net", lr=1e30)
    line = str(refused.value)
    assert line.startswith("training diverged: ") and "no output written" in line, line
    assert "\n" not in line
    assert not [p for p in (tmp_path / "diverged").glob("*") if p.name != "ckpt"]
    # Control: the same module at a learning rate that converges writes its outputs.
    assert (_train(tmp_path / "control", "Net", lr=0.1) / "metrics.json").exists()


def test_a_non_finite_loss_the_run_recovered_from_is_not_divergence() -> None:
    from reprotrain.pipeline.train_files import refuse_diverged

    finite = {"w": torch.ones(2), "steps": torch.tensor(3)}
    refuse_diverged([(0, 1.0), (1, float("nan")), (2, 0.5)], finite)  # a skipped overflow
    with pytest.raises(DataError, match="at the last step, first at step 1"):
        refuse_diverged([(0, 1.0), (1, float("nan")), (2, float("inf"))], finite)
    with pytest.raises(DataError, match=r"1 weight tensors are not finite \(w first\)"):
        refuse_diverged([(0, 1.0)], {"w": torch.tensor([1.0, float("nan")])})
