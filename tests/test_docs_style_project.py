"""A package written as Lightning's docs write one, trained through `dvc repro` as it is.

``tests/projects/cancer``: own ``*_dataloader()``s, ``save_hyperparameters``
only, a nested ``net`` given by ``class_path``, an optimizer with a scheduler,
torchmetrics, ``train/loss``-style names, and data that no file holds
(scikit-learn's bundled table, so no ``--data``). One ``dvc repro`` of it is
committed once per pytest run (:func:`cancer_repo`); each test works in a copy
and has its negative control:

- the module's own metric names reach ``train_metrics.json``, the curves and
  ``metrics.json`` (its ``test_dataloader``), beside the pipeline's ``train_loss``;
- ``verify`` finds it IDENTICAL; a clock-seeded generator in the loader is
  replaced by the run's order (still IDENTICAL), one in ``forward`` is not
  (NOT REPRODUCIBLE); a changed line moves the run ID;
- SIGTERM mid-epoch, then the same command, gives the uninterrupted bits,
  the module's step and epoch metrics included (the control: without the
  epoch's metric sums in the checkpoint, the same weights but other curves).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from reprotrain.hashing import load_safetensors, sha256_file
from reprotrain.resume import sidecar
from tests.helpers import (
    PROJECT_TRAIN_OUTPUTS,
    ROOT,
    RUN_OUTPUTS,
    built_once,
    cli_env,
    commit_all,
    edit_once,
    injected,
    project_train_argv,
    ranks,
    run_checked,
    run_cli,
    stage_argv,
)

pytestmark = pytest.mark.slow

PACKAGE = ROOT / "tests" / "projects" / "cancer"
LOCK = {"REPROTRAIN_LOCK": str(ROOT / "requirements-cpu.lock")}
TRAIN_OUTPUTS = PROJECT_TRAIN_OUTPUTS
#: 398 training samples in batches of 32: 13 steps an epoch; step 17 is epoch 1's batch 5.
SIGTERM_STEP = 17
SECTIONS = """\
model:
  class_path: cancer.model.CancerClassifier
  init_args:
    net:
      class_path: cancer.model.MLP
      init_args:
        hidden: 16
    optimizer:
      class_path: torch.optim.Adam
      init_args:
        lr: 0.01
    scheduler:
      class_path: torch.optim.lr_scheduler.StepLR
      init_args:
        step_size: 5
        gamma: 0.5
data:
  class_path: cancer.data.CancerData
  init_args:
    batch_size: 32
"""


def _params() -> str:
    """The wine example's params.yaml with this package's sections and 4 epochs."""
    text = (ROOT / "examples" / "tabular" / "params.yaml").read_text()
    head, tail = text[: text.index("model:")], text[text.index("train:") :]
    tail = tail.replace("max_epochs: 20", "max_epochs: 4")
    return (
        head
        + SECTIONS
        + tail.replace("checkpoint_every_n_epochs: 5", "checkpoint_every_n_epochs: 2")
    )


def _dvc_yaml() -> str:
    """The wine example's dvc.yaml with no data file: the package is the only dep."""
    text = (ROOT / "examples" / "tabular" / "dvc.yaml").read_text()
    text = text.replace("reprotrain train --data data/wine.csv", "reprotrain train")
    text = text.replace("reprotrain evaluate --data data/wine.csv", "reprotrain evaluate")
    text = text.replace("      - data/wine.csv\n", "").replace("      - wine\n", "      - cancer\n")
    return text[: text.index("# Curves for")] + PLOTS


#: Curves under the module's own names, as a user's dvc.yaml would name them.
PLOTS = """\
plots:
  - validation:
      x: epoch
      y:
        reports/plots/train/val.csv: [val/loss, val/acc]
"""


@pytest.fixture(scope="module")
def cancer_repo(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Path:
    def build(built: Path) -> None:
        shutil.copytree(PACKAGE, built / "cancer", ignore=shutil.ignore_patterns("__pycache__"))
        (built / "params.yaml").write_text(_params())
        (built / "dvc.yaml").write_text(_dvc_yaml())
        (built / ".dvcignore").write_text("__pycache__/\n")
        (built / ".gitignore").write_text("/checkpoints\n__pycache__/\n")
        run_checked("git", "init", "-q", cwd=built)
        run_checked("dvc", "init", "-q", cwd=built)
        out = run_checked("dvc", "repro", cwd=built, **LOCK)
        assert "checked cancer.model.CancerClassifier and cancer.data.CancerData" in out, out
        assert "note:" not in out, out  # no --data, nothing unread
        commit_all(built, "the package as written and its run")

    return built_once(tmp_path_factory.getbasetemp(), worker_id, "cancer_repo", build)


@pytest.fixture
def project(cancer_repo: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(cancer_repo, tmp_path / "cancer", symlinks=True))


def _cli(repo: Path, *args: str | Path, **env: str):
    return run_cli(*args, cwd=repo, **LOCK, **env)


def _digests(repo: Path) -> dict[str, str]:
    return {name: sha256_file(repo / name) for name in TRAIN_OUTPUTS}


def test_the_modules_own_metric_names_reach_every_metrics_file(cancer_repo: Path) -> None:
    """Each name as logged, ``/`` and all: DVC reads such names as they are (no escaping)."""
    metrics = json.loads((cancer_repo / "reports" / "train_metrics.json").read_text())
    assert metrics["epochs"] == 4 and metrics["steps"] == 4 * 13
    assert {"train_loss", "train/loss", "train/acc", "val/loss", "val/acc"} <= set(metrics)
    curves = cancer_repo / "reports" / "plots" / "train"
    assert (curves / "val.csv").read_text().splitlines()[0] == (
        "epoch,val/loss,val/acc,train/loss,train/acc"
    )
    assert (curves / "train_loss.csv").read_text().splitlines()[0] == "step,train_loss"
    scores = json.loads((cancer_repo / "reports" / "metrics.json").read_text())
    assert {"test/loss", "test/acc"} <= set(scores) and scores["test/acc"] > 0.8


def _dvc_json(project: Path, *args: str) -> dict:
    shown = subprocess.run(
        ["dvc", *args, "--json"], cwd=project, env=cli_env(), capture_output=True, text=True
    )
    assert shown.returncode == 0, shown.stderr
    return json.loads(shown.stdout)


def test_dvc_shows_the_modules_metrics_and_curves_by_their_names(project: Path) -> None:
    shown = _dvc_json(project, "metrics", "show")
    files = shown[""]["data"]
    assert {"train/loss", "val/acc"} <= set(files["reports/train_metrics.json"]["data"])
    assert files["reports/metrics.json"]["data"]["test/acc"] > 0.8
    plots = _dvc_json(project, "plots", "show")
    rows = plots["data"]["validation"][0]["content"]["data"]["values"]
    assert {row["field"] for row in rows} == {"val/loss", "val/acc"} and len(rows) == 2 * 4
    # Control: with a name the module never logged, DVC draws nothing.
    (project / "dvc.yaml").write_text(
        (project / "dvc.yaml").read_text().replace("val/acc]", "val/accuracy]")
    )
    assert not _dvc_json(project, "plots", "show")["data"].get("validation")


#: A data module of our contract's other kind: datasets, its batch size only in hparams.
DATASETS_MODULE = """\
import lightning as L

from cancer.data import CancerData


class CancerDatasets(L.LightningDataModule):
    def __init__(self, batch_size: int = 32) -> None:
        super().__init__()
        self.save_hyperparameters(logger=False)

    setup = CancerData.setup

    def train_dataset(self):
        return self.data_train

    def val_dataset(self):
        return self.data_val

    def test_dataset(self):
        return self.data_test
"""


def test_a_data_module_giving_datasets_with_its_batch_size_only_in_hparams_trains(
    project: Path,
) -> None:
    (project / "cancer" / "datasets.py").write_text(DATASETS_MODULE)
    params = project / "params.yaml"
    params.write_text(
        params.read_text().replace("cancer.data.CancerData", "cancer.datasets.CancerDatasets")
    )
    out = run_checked("dvc", "repro", cwd=project, **LOCK)
    assert "checked cancer.model.CancerClassifier and cancer.datasets.CancerDatasets" in out
    metrics = json.loads((project / "reports" / "train_metrics.json").read_text())
    assert metrics["steps"] == 4 * 13  # 398 samples in batches of 32, as the loaders' module
    # Control: without a batch size anywhere, env refuses in one line, the outputs stay.
    before = _digests(project)
    edit_once(project / "cancer" / "datasets.py", "batch_size: int = 32", "size: int = 32")
    params.write_text(params.read_text().replace("    batch_size: 32\n", "    size: 32\n"))
    refused = subprocess.run(
        ["dvc", "repro"], cwd=project, env=cli_env(**LOCK), capture_output=True, text=True
    )
    errors = [line for line in refused.stderr.splitlines() if line.startswith("reprotrain:")]
    assert refused.returncode != 0 and len(errors) == 1, refused.stdout + refused.stderr
    assert "takes no integer argument 'batch_size'" in errors[0]
    assert _digests(project) == before


def test_the_module_with_its_data_in_itself_and_data_null_trains_the_same_bits(
    cancer_repo: Path, project: Path
) -> None:
    """``cancer.standalone``: the data module's setup and loaders in the LightningModule,
    and ``data: null`` (a LightningCLI config for it has no data section)."""
    params = project / "params.yaml"
    text = params.read_text().replace(SECTIONS, "")
    standalone = SECTIONS.replace("cancer.model.CancerClassifier", "cancer.standalone."
                                  "StandaloneClassifier")  # fmt: skip
    standalone = standalone[: standalone.index("data:")] + "    batch_size: 32\ndata: null\n"
    params.write_text(text.replace("train:", standalone + "train:", 1))
    out = run_checked("dvc", "repro", cwd=project, **LOCK)
    assert "checked cancer.standalone.StandaloneClassifier\n" in out, out
    record = json.loads((project / "reports" / "run.json").read_text())
    assert record["inputs"]["recipe"]["data"] is None
    # The same split, loaders and order as the data module's: the same bits and scores
    for name in ("reports/train_metrics.json", "reports/metrics.json", "reports/plots/train"):
        assert _tree(project / name) == _tree(cancer_repo / name), name
    weights = load_safetensors(project / "models" / "model.safetensors")[0]
    reference = load_safetensors(cancer_repo / "models" / "model.safetensors")[0]
    assert weights.keys() == reference.keys()
    assert all(torch.equal(weights[name], reference[name]) for name in weights)
    # Control: a loader in the model that shuffles no more trains other bits.
    edit_once(project / "cancer" / "standalone.py", "shuffle=True", "shuffle=False")
    run_checked("dvc", "repro", cwd=project, **LOCK)
    unshuffled = load_safetensors(project / "models" / "model.safetensors")[0]
    assert not all(torch.equal(unshuffled[name], reference[name]) for name in weights)


def _tree(path: Path) -> dict[str, bytes]:
    """A file's bytes, or a folder's files' bytes by name."""
    if path.is_file():
        return {"": path.read_bytes()}
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*"))}


def test_verify_finds_it_identical_a_clock_seeded_loader_too_and_a_clock_seeded_forward_not(
    project: Path, tmp_path: Path
) -> None:
    short = ("-S", "train.max_epochs=1")
    data = project / "cancer" / "data.py"
    edit_once(data, "import lightning as L\n", "import time\n\nimport lightning as L\n")
    edit_once(
        data,
        "            shuffle=True,\n",
        "            shuffle=True,\n"
        "            generator=torch.Generator().manual_seed(time.time_ns()),\n",
    )
    result = _cli(project, "verify", *short, "--workdir", tmp_path / "loader")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "reprotrain verify: IDENTICAL (2 runs)" in result.stdout

    # Negative control: a draw no seed reaches, in the module's forward.
    model = project / "cancer" / "model.py"
    edit_once(model, "import lightning as L\n", "import time\n\nimport lightning as L\n")
    edit_once(
        model,
        "        return self.net(x)\n",
        "        clock = torch.Generator().manual_seed(time.time_ns())\n"
        "        return self.net(x + 1e-3 * torch.randn(x.shape, generator=clock))\n",
    )
    result = _cli(project, "verify", *short, "--workdir", tmp_path / "forward")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "reprotrain verify: NOT REPRODUCIBLE (2 runs; differ: run-1 vs run-2)" in result.stdout
    # named: the draw, by its op and line, and what differs (the generator's state)
    assert "first differing op: aten.randn.generator" in result.stdout, result.stdout
    assert "source: cancer/model.py:" in result.stdout and "random generator" in result.stdout


def test_a_changed_line_of_the_package_moves_the_run_id_and_restoring_it_restores_it(
    project: Path,
) -> None:
    def run_id() -> str:
        result = _cli(project, "run-id")
        assert result.returncode == 0, result.stderr
        return result.stdout.strip()

    first = run_id()
    model = project / "cancer" / "model.py"
    original = model.read_text()
    edit_once(model, "nn.ReLU()", "nn.GELU()")
    assert run_id() != first
    model.write_text(original)
    assert run_id() == first


def _interrupted(project: Path, argv: list[str], step: int) -> None:
    """The train stage stopped by SIGTERM at the start of ``step``, its outputs gone first."""
    for name in (*TRAIN_OUTPUTS, "reports/run.json"):
        (project / name).unlink(missing_ok=True)
    result = _cli(project, *argv, **injected(REPROTRAIN_TEST_SIGTERM_AT_STEP=str(step)))
    assert result.returncode == 130, result.stdout + result.stderr
    assert f"epoch=1-step={step + 1}.ckpt, is kept" in result.stderr, result.stderr


def test_sigterm_mid_epoch_then_the_same_command_gives_the_uninterrupted_bits(
    project: Path, cancer_repo: Path
) -> None:
    argv = stage_argv(project, "train")
    _interrupted(project, argv, SIGTERM_STEP)
    (interrupt,) = (project / "checkpoints").glob(f"*/epoch=1-step={SIGTERM_STEP + 1}.ckpt")
    kept = interrupt.read_bytes()
    result = _cli(project, *argv)
    assert result.returncode == 0, result.stderr
    assert f"resumed from {interrupt.name}" in result.stdout, result.stdout
    assert _digests(project) == _digests(cancer_repo)

    # Negative control: the same checkpoint without the epoch's metric sums so far resumes
    # to the same weights, but epoch 1's train/loss and train/acc cover only its last batches.
    interrupt.parent.mkdir(parents=True, exist_ok=True)
    interrupt.write_bytes(kept)
    saved = torch.load(interrupt, map_location="cpu", weights_only=True)
    saved["callbacks"]["EpochAccumulators"] = {"ranks": [{"sums": {}, "metrics": {}}]}
    torch.save(saved, interrupt)
    sidecar(interrupt).write_text(f"{sha256_file(interrupt)}  {interrupt.name}\n")
    for name in (*TRAIN_OUTPUTS, "reports/run.json"):
        (project / name).unlink()
    result = _cli(project, *argv)
    assert result.returncode == 0, result.stderr
    assert f"resumed from {interrupt.name}" in result.stdout, result.stdout
    other, straight = _digests(project), _digests(cancer_repo)
    assert other["models/model.safetensors"] == straight["models/model.safetensors"]
    assert other["reports/plots/train/val.csv"] != straight["reports/plots/train/val.csv"]


def _train(repo: Path, out: Path, world: int, *overrides: str) -> Path:
    """The train stage's command, writing a flat run folder, on ``world`` processes."""
    argv = project_train_argv(repo, out, "-S", "train.max_epochs=1", *overrides, *ranks(world))
    result = _cli(repo, *argv)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def _files(out: Path) -> dict[str, str]:
    return {name: sha256_file(out / name) for name in RUN_OUTPUTS}


def test_world_sizes_1_2_and_4_train_the_same_files_under_invariance_and_ddp_repeats_its_own(
    project: Path, tmp_path: Path
) -> None:
    # Batches of 32 in micro-batches of 8 (params.yaml): at world size 4 one micro-batch a rank.
    invariant = ("-S", "train.world_size_invariant=true")
    runs = {
        n: _files(_train(project, tmp_path / f"invariant-{n}", n, *invariant)) for n in (1, 2, 4)
    }
    assert runs[1] == runs[2] == runs[4]
    # What the module logs in training is each rank's share there: left out, validation kept.
    metrics = json.loads((tmp_path / "invariant-4" / "metrics.json").read_text())
    assert "val/acc" in metrics and "train/acc" not in metrics and "train_loss" in metrics

    # DDP at a fixed world size: the loaders rebuilt with the pipeline's shard sampler give
    # the same files twice; the control, world size 1, gives other weights.
    twice = [_files(_train(project, tmp_path / f"ddp-{i}", 2)) for i in range(2)]
    assert twice[0] == twice[1]
    alone = _files(_train(project, tmp_path / "single", 1))
    assert alone["model.safetensors"] != twice[0]["model.safetensors"]


def test_check_reference_reproduces_the_committed_run(project: Path) -> None:
    result = _cli(project, "verify", "--reference", "HEAD")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "REPRODUCED" in result.stdout, result.stdout


def _own_sampler(project: Path) -> None:
    """The module's training loader samples with WeightedRandomSampler: its order is its own."""
    data = project / "cancer" / "data.py"
    edit_once(
        data,
        "            shuffle=True,\n",
        "            sampler=torch.utils.data.WeightedRandomSampler(\n"
        "                [1.0] * len(self.data_train), len(self.data_train)\n"
        "            ),\n",
    )


def test_a_loader_with_its_own_order_trains_bitwise_and_refuses_ddp_at_env_and_resume_by_name(
    project: Path, tmp_path: Path
) -> None:
    _own_sampler(project)
    commit_all(project, "the module samples with its own sampler")
    # DDP shards the pipeline's order: refused by the env stage, before DVC deletes anything.
    before = _digests(project)
    params = project / "params.yaml"
    edit_once(params, "strategy: single_device", "strategy: ddp")
    edit_once(params, "devices: 1", "devices: 2")
    result = subprocess.run(
        ["dvc", "repro"], cwd=project, env=cli_env(**LOCK), capture_output=True, text=True
    )
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("reprotrain: error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "DDP sharding (train.strategy: ddp) needs the pipeline to draw" in errors[0]
    assert "samples with its own sampler (WeightedRandomSampler)" in errors[0]
    assert "Running stage 'train'" not in result.stdout and _digests(project) == before
    run_checked("git", "checkout", "--", "params.yaml", cwd=project)

    # Single process: reruns are bitwise (seeded global generator); a SIGTERM keeps no
    # checkpoint and says why, and the rerun trains from the first step to the same bits.
    argv = stage_argv(project, "train")
    straight = _cli(project, *argv, "-S", "train.max_epochs=2")
    assert straight.returncode == 0, straight.stderr
    first = _digests(project)
    stopped = _cli(
        project, *argv, "-S", "train.max_epochs=2",
        **injected(REPROTRAIN_TEST_SIGTERM_AT_STEP=str(SIGTERM_STEP)),
    )  # fmt: skip
    assert stopped.returncode == 130, stopped.stdout + stopped.stderr
    assert "no checkpoint kept: resume needs the pipeline to draw the training order" in (
        stopped.stderr
    )
    assert not list((project / "checkpoints").rglob("*.ckpt"))
    again = _cli(project, *argv, "-S", "train.max_epochs=2")
    assert again.returncode == 0 and "resumed" not in again.stdout, again.stdout
    assert _digests(project) == first
