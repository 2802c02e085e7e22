"""Resume: an interrupted run resumes to the same bits; bad or foreign checkpoints are refused."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning as L
import numpy as np
import psutil
import pytest
import torch
import yaml
from torch.utils.data import TensorDataset

from reprotrain.cpu.profile import CpuProfile
from reprotrain.determinism import configure_determinism
from reprotrain.hashing import sha256_file, sha256_state_dict
from reprotrain.pipeline.params_file import load_params
from reprotrain.pipeline.recipe import resolve_recipe
from reprotrain.pipeline.resumable_loader import ResumableLoader
from reprotrain.pipeline.resume_point import (
    Checkpointing,
    find_resume_point,
    refuse_another_worker_count,
)
from reprotrain.pipeline.training import fit
from reprotrain.recipes.digits import ShiftedImages
from reprotrain.resume import (
    CheckpointError,
    InterruptCheckpoint,
    VerifiedCheckpointIO,
    latest_checkpoint,
    sidecar,
)
from tests.helpers import (
    ROOT,
    cli_env,
    cmdline,
    kill_after_checkpoint,
    kill_tree,
    run_checked,
    run_cli,
    signal_after_checkpoint,
    train_argv,
)

EPOCHS = 4
#: params.yaml's train.max_epochs, and the outputs the resumed pipeline must reproduce.
DEFAULT_EPOCHS = 10
REFERENCE_OUTPUTS = (
    "models/model.safetensors",
    "models/trace.safetensors",
    "reports/metrics.json",
    "reports/train_metrics.json",
)
pytestmark = pytest.mark.usefixtures("restore_torch_flags")


def _fit(prepared: Path, epochs: int, run_dir: Path, resume=None, random_state=True) -> str:
    overrides = [
        f"train.max_epochs={epochs}",
        "data.init_args.num_workers=0",
        "train.checkpoint_every_n_epochs=1",
        f"data.init_args.path={prepared}",
    ]
    params = load_params(ROOT / "params.yaml", overrides)
    settings = configure_determinism(params.seed, params.deterministic)
    checkpointing = Checkpointing(run_dir, "run", resume, random_state)
    fitted = fit(params, resolve_recipe(params), settings, checkpointing)
    return sha256_state_dict(fitted.module.state_dict())


def test_resume_at_an_epoch_boundary_is_bitwise_equal(prepared: Path, tmp_path: Path) -> None:
    straight = _fit(prepared, EPOCHS, tmp_path / "straight")
    _fit(prepared, 2, tmp_path / "part")
    assert _fit(prepared, EPOCHS, tmp_path / "part", tmp_path / "part/epoch=1.ckpt") == straight


def test_resume_without_the_random_state_differs(prepared: Path, tmp_path: Path) -> None:
    straight = _fit(prepared, EPOCHS, tmp_path / "straight")
    _fit(prepared, 2, tmp_path / "part", random_state=False)
    resumed = _fit(prepared, EPOCHS, tmp_path / "part", tmp_path / "part/epoch=1.ckpt", False)
    assert resumed != straight


def _train_argv(prepared: Path, out: Path, env: Path) -> list[str]:
    epochs = ("-S", f"train.max_epochs={EPOCHS}", "-S", "train.checkpoint_every_n_epochs=1")
    return train_argv(prepared, env, out, *epochs)


@pytest.fixture(scope="module")
def straight_run(prepared: Path, env_record: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("straight")
    result = run_cli(*_train_argv(prepared, out, env_record), cwd=out)
    assert result.returncode == 0, result.stderr
    assert not any((out / "ckpt").rglob("*.ckpt")), "checkpoints are dropped after success"
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kill_after_epoch", [0, 1])
def test_kill_9_then_rerun_resumes_to_the_same_bits(
    kill_after_epoch: int, prepared: Path, env_record: Path, straight_run: Path, tmp_path: Path
) -> None:
    argv = _train_argv(prepared, tmp_path, env_record)
    kill_after_checkpoint(argv, tmp_path / "ckpt", kill_after_epoch, tmp_path)
    assert not (tmp_path / "model.safetensors").exists()
    result = run_cli(*argv, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "resumed from epoch=" in result.stdout
    names = ("model.safetensors", "trace.safetensors", "metrics.json", "plots/train_loss.csv")
    for name in (*names, "plots/val.csv"):
        assert sha256_file(tmp_path / name) == sha256_file(straight_run / name), name
    assert (
        json.loads((tmp_path / "run.json").read_text())["run_id"]
        == json.loads((straight_run / "run.json").read_text())["run_id"]
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("signum", "to_group"),
    [(signal.SIGTERM, False), (signal.SIGINT, False), (signal.SIGTERM, True)],
    ids=["SIGTERM", "SIGINT", "SIGTERM to the process group (workers too)"],
)
def test_sigterm_or_sigint_ends_in_one_line_and_the_rerun_has_the_same_bits(
    signum: int,
    to_group: bool,
    prepared: Path,
    env_record: Path,
    straight_run: Path,
    tmp_path: Path,
) -> None:
    argv = _train_argv(prepared, tmp_path, env_record)
    code, stderr = signal_after_checkpoint(argv, tmp_path, signum, to_group)
    assert code == 130, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("reprotrain: error: training interrupted"), stderr
    assert "rerun the same command" in last and ".ckpt, is kept" in last
    # The checkpoint is the one written at the signal, inside epoch 1, not epoch=0.ckpt
    # (with the group signalled too: the workers block it, see WorkersIgnoreStopSignals).
    written = re.search(r"(epoch=1-step=\d+\.ckpt)", last)
    assert written, last
    assert not (tmp_path / "model.safetensors").exists()
    result = run_cli(*argv, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"resumed from {written.group(1)}" in result.stdout, result.stdout
    names = ("model.safetensors", "trace.safetensors", "metrics.json", "plots/train_loss.csv")
    for name in (*names, "plots/val.csv"):
        assert sha256_file(tmp_path / name) == sha256_file(straight_run / name), name


@pytest.mark.slow
@pytest.mark.parametrize("kill_at", ["outputs", "trace", "run_record", "cleanup"])
def test_kill_after_the_final_checkpoint_then_dvc_repro_gives_the_reference_bits(
    kill_at: str, repo_copy: Path, dvc_repo: Path
) -> None:
    # Through DVC, as a user meets it: the killed `dvc repro` has lost train's outputs
    # (DVC removed them before the stage ran); the next `dvc repro` resumes from the
    # final checkpoint and must give the committed reference's bytes.
    inject = {"PYTHONPATH": str(ROOT / "tests" / "inject"), "REPROTRAIN_TEST_KILL_AT": kill_at}
    killed = subprocess.run(
        ["dvc", "repro", "--force", "--single-item", "train"],
        cwd=repo_copy,
        env=cli_env(**inject),
        capture_output=True,
        text=True,
    )
    assert killed.returncode != 0, killed.stdout + killed.stderr
    final = f"epoch={DEFAULT_EPOCHS - 1}.ckpt"
    assert list((repo_copy / "checkpoints").glob(f"*/{final}")), "killed before the final one"
    out = run_checked("dvc", "repro", cwd=repo_copy)
    if kill_at == "cleanup":  # every output was whole and equal to dvc.lock's: nothing to redo
        assert "Stage 'train' didn't change, skipping" in out, out
    else:
        assert f"resumed from {final}" in out, out
        assert not any((repo_copy / "checkpoints").rglob("*.ckpt")), "dropped after success"
    for name in (*REFERENCE_OUTPUTS, "reports/plots/train/train_loss.csv"):
        assert (repo_copy / name).read_bytes() == (dvc_repo / name).read_bytes(), name
    resumed, reference = (
        json.loads((r / "reports/run.json").read_text()) for r in (repo_copy, dvc_repo)
    )
    assert (resumed["run_id"], resumed["outputs"]) == (reference["run_id"], reference["outputs"])


@pytest.fixture(scope="module")
def interrupted(prepared: Path, env_record: Path, tmp_path_factory) -> Path:
    """A train run killed (SIGKILL) right after its first checkpoint; copy before changing it."""
    out = tmp_path_factory.mktemp("interrupted")
    kill_after_checkpoint(_train_argv(prepared, out, env_record), out / "ckpt", 0, out)
    return out


def _interrupted_checkpoint(
    interrupted: Path, prepared: Path, env_record: Path, tmp_path: Path
) -> tuple[list, Path]:
    shutil.copytree(interrupted, tmp_path, dirs_exist_ok=True)
    ckpt = latest_checkpoint(next((tmp_path / "ckpt").iterdir()))
    assert ckpt is not None
    return _train_argv(prepared, tmp_path, env_record), ckpt


class Cool:
    """An object a module's on_save_checkpoint stores (Lightning's docs' example)."""

    def __init__(self) -> None:
        self.note = "cool"


def _write_with_sidecar(path: Path, checkpoint: dict) -> Path:
    """``checkpoint`` as torch alone writes it, with a matching sidecar (an earlier version's)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(checkpoint, path)
    sidecar(path).write_text(f"{sha256_file(path)}  {path.name}\n")
    return path


def test_a_checkpoint_weights_only_loading_refuses_is_not_kept_and_says_which_key(
    tmp_path: Path,
) -> None:
    notes: list[str] = []
    io = VerifiedCheckpointIO(note=notes.append)
    state = {"epoch": 0, "state_dict": {"w": torch.ones(2)}, "reprotrain_run_id": "run"}
    refused = tmp_path / "epoch=0.ckpt"
    io.save_checkpoint({**state, "something_cool": Cool(), "weights": np.ones(3)}, refused)
    assert not refused.exists() and not sidecar(refused).exists()
    assert io.refused is not None and "\n" not in io.refused
    assert f"checkpoint['something_cool'] holds a {__name__}.Cool" in io.refused
    assert "checkpoint['weights'] holds a numpy.ndarray" in io.refused
    assert "weights_only" in io.refused and "store plain values or tensors" in io.refused
    io.save_checkpoint({**state, "something_cool": Cool()}, tmp_path / "epoch=1.ckpt")
    assert len(notes) == 1 and "this run keeps no checkpoint" in notes[0]  # once a run
    # Control: the same checkpoint with a tensor there is kept, and loads.
    kept = tmp_path / "epoch=2.ckpt"
    io.save_checkpoint({**state, "something_cool": torch.zeros(1)}, kept)
    assert io.refused is None and sidecar(kept).is_file()
    assert torch.equal(io.load_checkpoint(kept)["something_cool"], torch.zeros(1))


def test_an_unloadable_checkpoint_found_at_start_is_one_line_naming_it(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    bad = _write_with_sidecar(run_dir / "epoch=0.ckpt", {"reprotrain_run_id": "run", "x": Cool()})
    with pytest.raises(CheckpointError) as refused:
        find_resume_point(run_dir, "run")
    line = str(refused.value)
    assert "\n" not in line and line.startswith(f"{bad}: weights_only loading refuses it")
    assert f"a {__name__}.Cool" in line and "delete it to train from the first step" in line
    # Another run's unreadable file stops nothing: its worker count is simply unknown.
    refuse_another_worker_count(tmp_path, "another run", {"key": "k", "num_workers": 2})
    # Control: the same file with a tensor there is this run's resume point.
    _write_with_sidecar(bad, {"reprotrain_run_id": "run", "x": torch.ones(1)})
    assert find_resume_point(run_dir, "run") == bad


def test_an_unloadable_checkpoint_of_this_run_stops_train_in_one_line(
    interrupted: Path, prepared: Path, env_record: Path, tmp_path: Path
) -> None:
    argv, ckpt = _interrupted_checkpoint(interrupted, prepared, env_record, tmp_path)
    checkpoint = torch.load(ckpt, weights_only=True)
    _write_with_sidecar(ckpt, {**checkpoint, "something_cool": Cool()})
    result = run_cli(*argv, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert f"{ckpt.name}: weights_only loading refuses it (a {__name__}.Cool)" in lines[0]
    assert not (tmp_path / "model.safetensors").exists()


def test_tampered_checkpoint_is_refused_unloaded(
    interrupted: Path, prepared: Path, env_record: Path, tmp_path: Path
) -> None:
    argv, ckpt = _interrupted_checkpoint(interrupted, prepared, env_record, tmp_path)
    blob = bytearray(ckpt.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    ckpt.write_bytes(bytes(blob))
    result = run_cli(*argv, cwd=tmp_path)
    assert result.returncode == 2
    assert f"{ckpt.name}: sha256" in result.stderr and "tampered" in result.stderr
    assert not (tmp_path / "model.safetensors").exists()


@pytest.mark.slow
def test_checkpoint_of_another_run_is_refused(
    interrupted: Path, prepared: Path, env_record: Path, tmp_path: Path
) -> None:
    argv, ckpt = _interrupted_checkpoint(interrupted, prepared, env_record, tmp_path)
    other = [*argv, "--seed", "7", "--checkpoints", str(tmp_path / "b")]
    result = run_cli(*other, cwd=tmp_path)
    assert result.returncode == 0  # a complete run B (another seed), to learn its run ID
    run_b = json.loads((tmp_path / "run.json").read_text())["run_id"]
    target = tmp_path / "b" / run_b / ckpt.name
    target.parent.mkdir(parents=True)
    target.write_bytes(ckpt.read_bytes())
    sidecar(target).write_text(sidecar(ckpt).read_text())
    before = sha256_file(tmp_path / "model.safetensors")
    refused = run_cli(*other, cwd=tmp_path)
    assert refused.returncode == 2
    assert "written for run" in refused.stderr and run_b[:12] in refused.stderr
    assert sha256_file(tmp_path / "model.safetensors") == before


@pytest.mark.slow
def test_dvc_repro_after_an_interruption_resumes_to_the_reference_bits(
    repo_copy: Path, dvc_repo: Path
) -> None:
    proc = subprocess.Popen(
        ["dvc", "repro", "--force", "--single-item", "train"],
        cwd=repo_copy,
        env=cli_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 300
    killed = False
    while time.monotonic() < deadline and proc.poll() is None and not killed:
        ckpts = [
            p for p in (repo_copy / "checkpoints").glob("*/epoch=*.ckpt") if sidecar(p).exists()
        ]
        if ckpts:
            kill_tree(
                c
                for c in psutil.Process(proc.pid).children(recursive=True)
                if "reprotrain train" in cmdline(c)
            )
            killed = True
        time.sleep(0.02)
    proc.wait()
    assert killed and proc.returncode != 0
    out = run_checked("dvc", "repro", cwd=repo_copy)
    assert "resumed from epoch=" in out
    for name in ("models/model.safetensors", "reports/metrics.json", "reports/train_metrics.json"):
        assert (repo_copy / name).read_bytes() == (dvc_repo / name).read_bytes(), name
    resumed, reference = (
        json.loads((r / "reports/run.json").read_text()) for r in (repo_copy, dvc_repo)
    )
    # Only the git commit differs (the copy has one more commit); it is provenance, not input.
    assert resumed["run_id"] == reference["run_id"]
    assert resumed["outputs"] == reference["outputs"]


def test_lock_drift_is_refused_in_true_mode(
    prepared: Path, env_record: Path, tmp_path: Path
) -> None:
    record = json.loads(env_record.read_text())
    record["lock"]["exact"] = False
    record["lock"]["drift"] = [{"package": "numpy", "locked": "2.4.6", "installed": "2.4.7"}]
    drifted = tmp_path / "environment.json"
    drifted.write_text(json.dumps(record))
    result = run_cli(*_train_argv(prepared, tmp_path, drifted), cwd=tmp_path)
    assert result.returncode == 3
    assert "numpy 2.4.7 (lock 2.4.6)" in result.stderr and "make venv" in result.stderr
    assert not (tmp_path / "model.safetensors").exists()


def test_non_deterministic_op_is_named_with_the_fix(
    prepared: Path, env_record: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    from torch._prims_common import alert_not_deterministic

    from reprotrain import cli
    from reprotrain.recipes.digits import Classifier

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alert_not_deterministic("scatter_add_cuda_kernel")  # what a CUDA-only op raises
        return self.net(x)

    monkeypatch.setattr(Classifier, "forward", forward)
    # In this process, whose ATen level no profile chose: the native profile, which pins
    # only threads, so the test does not depend on this host's level (an AVX-512 host
    # refuses the portable one here, rightly). Its variables as the CLI's restart sets them.
    for name, value in CpuProfile("native").variables().items():
        monkeypatch.setenv(name, value)
    native = ("-S", "cpu.profile=native")
    code = cli.main([*_train_argv(prepared, tmp_path, env_record), *native])
    err = capsys.readouterr().err
    assert code == 3
    # the op, the user's line that called it (not torch's or Lightning's), the choices
    line = forward.__code__.co_firstlineno + 1
    assert "scatter_add_cuda_kernel (called at " in err and f"test_resume.py:{line})" in err
    assert "has no deterministic implementation" in err and "deterministic: warn" in err
    assert not (tmp_path / "model.safetensors").exists()


def test_dvc_yaml_trains_with_checkpoints_outside_dvc_outputs() -> None:
    spec = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]["train"]
    assert "--checkpoints checkpoints" in spec["cmd"]
    outs = [next(iter(o)) if isinstance(o, dict) else o for o in spec["outs"]]
    assert not any(o.startswith("checkpoints") for o in outs)


def _augmented_loader(generator: torch.Generator, consumed: list[int]) -> ResumableLoader:
    """Shuffled, shift-augmented digits-like images drawn in two seeded worker processes."""
    x = torch.arange(40 * 16, dtype=torch.float32).reshape(40, 1, 4, 4)
    return ResumableLoader(
        ShiftedImages(TensorDataset(x, torch.arange(40) % 3), augment=True),
        consumed=lambda: consumed[0],
        batch_size=4,
        shuffle=True,
        num_workers=2,
        generator=generator,
        worker_init_fn=lambda _: np.random.seed(torch.initial_seed() % 2**32),
    )


def test_resumable_loader_continues_mid_epoch_with_the_same_batches_and_augmentation() -> None:
    consumed = [3]
    straight = _augmented_loader(torch.Generator().manual_seed(7), consumed)
    epoch = [images for images, _ in straight]
    state = _augmented_loader(torch.Generator().manual_seed(7), consumed)
    interrupted = iter(state)
    seen = [next(interrupted)[0] for _ in range(3)]
    saved = state.state_dict()  # what a checkpoint holds after 3 batches
    after_draws = state.generator.get_state()  # what RandomStateCallback alone would restore
    del interrupted
    assert all(torch.equal(a, b) for a, b in zip(seen, epoch[:3], strict=True))

    resumed = _augmented_loader(torch.Generator().set_state(after_draws), consumed)
    resumed.load_state_dict(saved)
    rest = [images for images, _ in resumed]
    assert len(rest) == len(epoch) - 3
    assert all(torch.equal(a, b) for a, b in zip(rest, epoch[3:], strict=True))
    # The next epoch draws from the generator where the straight run's does.
    assert torch.equal(next(iter(resumed))[0], next(iter(straight))[0])

    # Negative control: without the loader's state, the epoch restarts from another draw.
    plain = _augmented_loader(torch.Generator().set_state(after_draws), consumed)
    restarted = [images for images, _ in plain][: len(rest)]
    assert not all(torch.equal(a, b) for a, b in zip(restarted, epoch[3:], strict=True))


def test_the_newest_checkpoint_orders_a_mid_epoch_one_between_its_epoch_boundaries(
    tmp_path: Path,
) -> None:
    def write(name: str) -> None:
        (tmp_path / name).write_bytes(name.encode())
        sidecar(tmp_path / name).write_text(f"{sha256_file(tmp_path / name)}  {name}\n")

    write("epoch=0.ckpt")
    write("epoch=1-step=30.ckpt")  # written at SIGTERM inside epoch 1
    assert latest_checkpoint(tmp_path).name == "epoch=1-step=30.ckpt"
    write("epoch=1.ckpt")  # the resumed run finished epoch 1
    assert latest_checkpoint(tmp_path).name == "epoch=1.ckpt"


def test_sigterm_on_an_epochs_last_batch_is_put_off_until_the_next_epochs_first(
    tmp_path: Path,
) -> None:
    saved: list[Path] = []

    class Trainer(SimpleNamespace):  # the attributes the callback reads, as Lightning 2.6 has them
        received_sigterm = property(lambda self: self._signal_connector.received_sigterm)

    trainer = Trainer(
        world_size=1, num_training_batches=5, current_epoch=2, global_step=15,
        save_checkpoint=saved.append,
        _signal_connector=SimpleNamespace(received_sigterm=False),
    )  # fmt: skip
    callback = InterruptCheckpoint(tmp_path)
    callback.on_train_batch_end(trainer, None, None, None, 3)
    assert not saved  # no signal, no file
    trainer._signal_connector.received_sigterm = True
    callback.on_train_batch_end(trainer, None, None, None, 4)  # the epoch's last batch
    assert not saved and trainer.received_sigterm is False  # the epoch may end normally
    trainer.current_epoch, trainer.global_step = 3, 16
    callback.on_train_batch_end(trainer, None, None, None, 0)
    assert saved == [tmp_path / "epoch=3-step=16.ckpt"] and trainer.received_sigterm is True
    callback.on_train_batch_end(trainer, None, None, None, 1)
    assert len(saved) == 1  # one file per interruption


def test_saved_hyperparameters_holding_objects_still_load_with_weights_only(
    tmp_path: Path,
) -> None:
    """``save_hyperparameters()`` as the Hydra template calls it keeps the ``net`` and an
    optimizer partial; the checkpoint keeps them by name, so a resume can load it."""
    import functools

    net = torch.nn.Linear(2, 2)
    hyper = {"net": net, "optimizer": functools.partial(torch.optim.Adam, lr=0.1), "lr": 0.1}
    path = tmp_path / "epoch=0.ckpt"
    VerifiedCheckpointIO().save_checkpoint({"hyper_parameters": hyper, "epoch": 0}, path)
    loaded = VerifiedCheckpointIO().load_checkpoint(path)
    assert loaded["hyper_parameters"] == {
        "net": "<torch.nn.modules.linear.Linear: not kept in checkpoints>",
        "optimizer": "<functools.partial: not kept in checkpoints>",
        "lr": 0.1,
    }
    assert hyper["net"] is net  # the module's own hparams are left as they were
    # Control: torch alone writes a file that weights_only loading refuses.
    torch.save({"hyper_parameters": hyper}, tmp_path / "raw.ckpt")
    with pytest.raises(Exception, match="Weights only load failed"):
        torch.load(tmp_path / "raw.ckpt", weights_only=True)


#: Leaves a DataLoader iterator's two workers to exit, as a stop signal that lands while an
#: epoch's workers start leaves them: nobody shuts them down. argv[1]: "stopped" (the train
#: stage's exit function registered) or "plain".
LEFT_WORKERS = """\
import sys
from reprotrain.pipeline.resumable_loader import (
    WorkersIgnoreStopSignals,
    stop_loader_workers_at_exit,
)

if sys.argv[1] == "stopped":
    stop_loader_workers_at_exit()
iterator = iter(WorkersIgnoreStopSignals(list(range(64)), batch_size=1, num_workers=2))
next(iterator)
iterator._shutdown = True  # its start cut short: its own shutdown never runs
print("exiting", flush=True)
"""


def _exits_within(seconds: float, how: str) -> bool:
    process = subprocess.Popen(
        [sys.executable, "-c", LEFT_WORKERS, how], start_new_session=True, env=cli_env(),
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        process.wait(seconds)
        return True
    except subprocess.TimeoutExpired:
        return False
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # the workers too
        process.wait()


def test_workers_left_running_by_a_cut_short_start_do_not_hang_the_exit() -> None:
    assert _exits_within(30, "stopped")


@pytest.mark.slow
def test_workers_left_running_hang_pythons_exit_for_good_without_the_stop() -> None:
    """The control: multiprocessing's exit sends them SIGTERM, which they block, and waits."""
    assert not _exits_within(15, "plain")


class OneCycle(L.LightningModule):
    """Sized as Lightning's docs size OneCycleLR: by ``self.trainer.estimated_stepping_batches``,
    which sets the training loader up before a checkpoint is restored."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(4, 2)
        self.order = torch.Generator().manual_seed(1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.layer(batch[0]), batch[1])

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        steps = self.trainer.estimated_stepping_batches
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, 0.1, total_steps=steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def train_dataloader(self) -> ResumableLoader:
        g = torch.Generator().manual_seed(2)
        data = TensorDataset(
            torch.randn(32, 4, generator=g), torch.randint(0, 2, (32,), generator=g)
        )
        progress = self.trainer.fit_loop.epoch_loop.batch_progress.current
        return ResumableLoader(data, batch_size=4, shuffle=True, generator=self.order,
                               consumed=lambda: progress.processed)  # fmt: skip


class Interrupted(Exception):
    pass


class SaveAndStop(L.Callback):
    """A checkpoint in the middle of epoch 1, as a stop signal's, then the run ends."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.current_epoch == 1 and args[-1] == 3:
            trainer.save_checkpoint(self.path)
            raise Interrupted


def _one_cycle_fit(tmp_path: Path, callbacks: list, resume: Path | None = None) -> str:
    trainer = L.Trainer(
        max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=callbacks, default_root_dir=tmp_path,
    )  # fmt: skip
    module = OneCycle()
    with contextlib.suppress(Interrupted):
        trainer.fit(module, ckpt_path=resume)
    return sha256_state_dict(module.state_dict())


def test_a_mid_epoch_resume_restores_the_loader_a_scheduler_set_up_early(tmp_path: Path) -> None:
    from reprotrain.pipeline.resume_point import LoaderStateRestored

    straight = _one_cycle_fit(tmp_path, [LoaderStateRestored()])
    checkpoint = tmp_path / "epoch=1-step=11.ckpt"
    _one_cycle_fit(tmp_path, [SaveAndStop(checkpoint)])
    assert _one_cycle_fit(tmp_path, [LoaderStateRestored()], checkpoint) == straight
    # Control: Lightning alone never applies the loader's state here; the epoch trains
    # other batches (the user's report: the same run ID, other weights).
    assert _one_cycle_fit(tmp_path, [], checkpoint) != straight
