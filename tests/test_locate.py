"""locate_divergence names the layer that is non-deterministic, and only that one."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from reprotrain.compare.modules import locate_divergence
from tests.test_trace import NoisyFromStep, NoisyGradFromStep, TinyNet, tiny_data


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    x, y = tiny_data().tensors
    return x[:8], y[:8]


def _training_step(module: nn.Module, batch: Any) -> torch.Tensor:
    return module.training_step(batch, 0)


def test_forward_noise_is_traced_to_its_layer() -> None:
    result = locate_divergence(lambda: TinyNet(NoisyFromStep(0)), _batch(), _training_step, seed=0)
    assert not result.identical
    assert (result.phase, result.module, result.module_type) == (
        "forward",
        "net.2",
        "NoisyFromStep",
    )
    assert result.max_abs_diff is not None and 0 < result.max_abs_diff < 1


def test_backward_only_noise_is_traced_to_its_layer() -> None:
    result = locate_divergence(
        lambda: TinyNet(NoisyGradFromStep(0)), _batch(), _training_step, seed=0
    )
    assert (result.phase, result.module, result.module_type) == (
        "backward",
        "net.2",
        "NoisyGradFromStep",
    )
    assert result.what is not None and result.what.startswith("grad_input")


def test_seeded_dropout_and_inplace_layers_are_not_flagged() -> None:
    def make() -> nn.Module:
        return nn.Sequential(
            nn.Linear(8, 32), nn.ReLU(inplace=True), nn.Dropout(0.5), nn.Linear(32, 3)
        )

    def loss_fn(module: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(module(x), y)

    result = locate_divergence(make, _batch(), loss_fn, seed=3)
    assert result.identical, str(result)


def test_unseeded_initialisation_does_not_matter_and_caller_rng_is_kept() -> None:
    # TinyNet() draws fresh weights each call; the second copy gets the first one's state.
    random.seed(5)
    torch.manual_seed(5)
    expected = (random.random(), torch.rand(1).item())
    random.seed(5)
    torch.manual_seed(5)
    assert locate_divergence(TinyNet, _batch(), _training_step, seed=0).identical
    assert (random.random(), torch.rand(1).item()) == expected


class ReadsTrainer(TinyNet):
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], i: int) -> torch.Tensor:
        return super().training_step(batch, i) * (1 + self.trainer.current_epoch)


class ManualSteps(TinyNet):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


def test_the_command_names_a_step_it_cannot_run_outside_a_trainer_in_one_line() -> None:
    from reprotrain.commands import locate
    from reprotrain.pipeline.config import ConfigError

    with pytest.raises(ConfigError) as reads:
        locate_divergence(ReadsTrainer, _batch(), locate._training_step, seed=0)
    assert "ReadsTrainer: its training_step reads self.trainer" in str(reads.value)
    with pytest.raises(ConfigError) as manual:
        locate._check_steppable(ManualSteps(), "project.ManualSteps")
    assert str(manual.value).startswith(
        "model.class_path: project.ManualSteps sets automatic_optimization = False"
    )
    for refused in (reads, manual):
        assert "\n" not in str(refused.value) and "reprotrain compare" in str(refused.value)
    # Control: the same network without them runs, and is let through.
    assert locate_divergence(TinyNet, _batch(), locate._training_step, seed=0).identical
    locate._check_steppable(TinyNet(), "project.TinyNet")
