"""`reprotrain bench`: paired step times per mode, and the cost figures computed from them."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from reprotrain.commands.bench import effect_pct
from tests.helpers import ROOT, run_cli, run_in_process


def test_bench_runs_both_workloads_and_its_cost_matches_its_step_times(
    prepared: Path, tmp_path: Path
) -> None:
    out = tmp_path / "bench.json"
    result = run_cli(
        "bench",
        *("--params", ROOT / "params.yaml", "-S", f"data.init_args.path={prepared}"),
        *("--device", "cpu"),
        *("--steps", "2", "--warmup", "1", "--repeats", "3"),
        *("--batch-size", "4", "--image-size", "16", "--width", "4", "--out", out),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 paired repeats x (1 warm-up + 2 timed steps)" in result.stdout
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["torch"].startswith("2.")
    assert "not applicable on the CPU" in report["autotune_note"]
    assert report["workloads"]["conv"]["size"]["image_size"] == 16
    for workload in report["workloads"].values():
        modes = workload["modes"]
        assert set(modes) == {"deterministic", "default", "default_no_autotune"}
        for figures in modes.values():
            assert len(figures["step_times_s"]) == 3 and min(figures["step_times_s"]) > 0
            assert figures["median_step_s"] == statistics.median(figures["step_times_s"])
        det, default = modes["deterministic"]["median_step_s"], modes["default"]["median_step_s"]
        cost = workload["determinism_cost"]
        assert cost["pct"] == pytest.approx(100 * (det / default - 1), rel=1e-12)
        ratios = [
            a / b
            for a, b in zip(
                modes["deterministic"]["step_times_s"],
                modes["default"]["step_times_s"],
                strict=True,
            )
        ]
        assert cost["paired_ratios"] == pytest.approx(ratios)
        low, high = cost["ci95"]
        assert low <= high
        autotune = workload["autotune_effect"]
        no_tune = modes["default_no_autotune"]["median_step_s"]
        assert autotune["pct"] == pytest.approx(100 * (default / no_tune - 1), rel=1e-12)


def test_effect_interval_is_seeded_and_exact_for_constant_pairs() -> None:
    same = effect_pct([2.0] * 5, [1.0] * 5, seed=0)
    assert same["pct"] == 100.0 and same["ci95"] == [100.0, 100.0]
    noisy = ([1.1, 1.3, 0.9, 1.2, 1.0], [1.0, 1.0, 1.1, 0.9, 1.0])
    assert effect_pct(*noisy, seed=3) == effect_pct(*noisy, seed=3)


def test_bench_refuses_a_missing_cuda_device_or_too_few_repeats() -> None:
    params = ("--params", ROOT / "params.yaml")
    few = run_in_process("bench", *params, "--repeats", "1")
    assert few.returncode == 2 and "--repeats must be >= 2" in few.stderr
    if not torch.cuda.is_available():
        cuda = run_in_process("bench", *params, "--device", "cuda")
        assert cuda.returncode == 2 and "no CUDA device" in cuda.stderr


class DocsStyle(L.LightningModule):
    """Written as Lightning's docs write one: a scheduler sized by ``self.trainer``, a
    dict from ``training_step``, ``self.log``."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 2)

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        loss = F.cross_entropy(self.layer(batch[0]), batch[1])
        self.log("train_loss", loss)
        return {"loss": loss}

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        steps = self.trainer.estimated_stepping_batches
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, 0.1, total_steps=steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class ManualOptimization(DocsStyle):
    """Two optimizers stepped by hand, as a GAN's (global_step counts both steps), and a
    ModelCheckpoint of its own (which would write under the Trainer's root)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.other = nn.Linear(4, 2)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        for optimizer, layer in zip(self.optimizers(), (self.layer, self.other), strict=True):
            optimizer.zero_grad()
            self.manual_backward(F.cross_entropy(layer(batch[0]), batch[1]))
            optimizer.step()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [torch.optim.SGD(m.parameters(), lr=0.1) for m in (self.layer, self.other)]

    def configure_callbacks(self) -> list[L.Callback]:
        from lightning.pytorch.callbacks import ModelCheckpoint

        return [ModelCheckpoint()]


@pytest.mark.parametrize("module_class", [DocsStyle, ManualOptimization])
def test_bench_times_a_module_as_its_trainer_would_train_it(
    module_class: type, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from reprotrain.commands._steptime import _lightning_step_times

    monkeypatch.chdir(tmp_path)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g))] * 2
    module = module_class()
    before = module.layer.weight.detach().clone()
    times = _lightning_step_times(module, batches, steps=3, warmup=2, device=torch.device("cpu"))
    assert len(times) == 3 and min(times) > 0
    assert not torch.equal(module.layer.weight, before)  # it trained
    assert list(tmp_path.iterdir()) == []  # and wrote nothing
    # Control: outside a Trainer, as bench's loop ran them before, neither can run: one
    # sizes its scheduler by the trainer, the other's step asks it for the optimizers.
    fresh = module_class()
    with pytest.raises(RuntimeError, match="not attached to a `Trainer`"):
        if module_class is ManualOptimization:
            fresh.training_step(batches[0], 0)
        else:
            fresh.configure_optimizers()


def test_the_deterministic_mode_sets_what_configure_determinism_sets() -> None:
    from reprotrain.commands._steptime import modes_restored, set_mode
    from reprotrain.determinism import configure_determinism

    before = torch.utils.deterministic.fill_uninitialized_memory
    with modes_restored():
        configure_determinism(0, True)
        expected = (
            torch.are_deterministic_algorithms_enabled(),
            torch.utils.deterministic.fill_uninitialized_memory,
        )
        torch.utils.deterministic.fill_uninitialized_memory = True  # torch's own default
        set_mode("deterministic")
        now = (
            torch.are_deterministic_algorithms_enabled(),
            torch.utils.deterministic.fill_uninitialized_memory,
        )
        assert now == expected == (True, False)
    assert torch.utils.deterministic.fill_uninitialized_memory == before  # put back
