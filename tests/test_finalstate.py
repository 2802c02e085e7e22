"""The final parameters, buffers and optimizer state: in the trace, and written as safetensors."""

from __future__ import annotations

import copy
import logging
import sys
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from reprotrain.compare.files import compare_files
from reprotrain.determinism import configure_determinism
from reprotrain.hashing import load_safetensors
from reprotrain.trace.callback import TraceCallback
from reprotrain.trace.diff import compare_traces
from reprotrain.trace.finalstate import (
    FinalStateCallback,
    final_fingerprints,
    final_state,
    write_final_state,
)
from reprotrain.trace.tracefile import load_trace
from tests.helpers import ROOT, run_cli

STEPS = 10


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 2)
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(8, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def _copy(model: torch.nn.Module, optimizer: torch.optim.Optimizer):
    twin = copy.deepcopy(model)
    twin_optimizer = torch.optim.Adam(twin.parameters(), lr=0.1)
    twin_optimizer.load_state_dict(optimizer.state_dict())
    return twin, twin_optimizer


def test_each_part_of_the_final_state_has_its_own_fingerprint() -> None:
    model, optimizer = _trained()
    before = final_fingerprints(final_state(model, [optimizer]))
    twin, twin_optimizer = _copy(model, optimizer)
    assert final_fingerprints(final_state(twin, [twin_optimizer])) == before  # negative control
    twin[1].running_mean[0] += 1e-6
    assert [
        a != b
        for a, b in zip(
            final_fingerprints(final_state(twin, [twin_optimizer])), before, strict=True
        )
    ] == [False, True, False]
    twin_optimizer.state[twin[0].weight]["exp_avg"][0, 0] += 1e-6
    changed = final_fingerprints(final_state(twin, [twin_optimizer]))
    assert [a != b for a, b in zip(changed, before, strict=True)] == [False, True, True]


def test_the_final_state_file_is_the_same_bytes_in_any_folder(tmp_path: Path) -> None:
    model, optimizer = _trained()
    a, b = tmp_path / "run-0", tmp_path / "run-1"
    write_final_state(a / "final.safetensors", model, [optimizer])
    twin, twin_optimizer = _copy(model, optimizer)
    write_final_state(b / "final.safetensors", twin, [twin_optimizer])
    assert (a / "final.safetensors").read_bytes() == (b / "final.safetensors").read_bytes()
    twin[1].running_var[2] += 1e-6  # negative control: a buffer
    write_final_state(b / "final.safetensors", twin, [twin_optimizer])
    verdict = compare_files("final", a / "final.safetensors", b / "final.safetensors", (a, b))
    assert verdict.status == "tensors"
    assert [d.name for d in verdict.tensors] == ["buffers/1.running_var"]
    tensors, metadata = load_safetensors(a / "final.safetensors")
    assert {"parameters/0.weight", "buffers/1.num_batches_tracked", "optimizer/0/0/exp_avg"} <= set(
        tensors
    )
    assert metadata["param_groups"][0][0]["lr"] == "0.1"


def test_a_fit_without_an_optimizer_has_an_empty_optimizer_part(tmp_path: Path) -> None:
    """``configure_optimizers`` may return None; Lightning then steps a stand-in optimizer
    (``_MockOptimizer``) whose state_dict is empty."""
    from lightning.pytorch.core.optimizer import _MockOptimizer

    model, optimizer = _trained()
    state = final_state(model, [_MockOptimizer()])
    assert state["optimizer"] == {} and final_fingerprints(state)[2] == 0
    assert state["parameters"].keys() == dict(model.named_parameters()).keys()
    write_final_state(tmp_path / "final.safetensors", model, [_MockOptimizer()])
    tensors, metadata = load_safetensors(tmp_path / "final.safetensors")
    assert not any(name.startswith("optimizer/") for name in tensors)
    assert metadata["param_groups"] == [[]]
    # Control: with the real optimizer the part holds its state.
    assert final_fingerprints(final_state(model, [optimizer]))[2] != 0


class _LatePlant(L.Callback):
    """Adds ``amount`` to one gradient at the last step only: after the trace's last weights row."""

    def __init__(self, amount: float) -> None:
        self.amount = amount

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_step == STEPS - 1:
            next(pl_module.parameters()).grad.view(-1)[0] += self.amount


class _Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 2)
        )

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.body(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _fit(out: Path, plant: float) -> Path:
    settings = configure_determinism(0)
    data = TensorDataset(
        torch.randn(STEPS * 4, 4, generator=torch.Generator().manual_seed(1)),
        torch.arange(STEPS * 4) % 2,
    )
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    trainer = L.Trainer(
        **settings.trainer_flags(), accelerator="cpu", max_steps=STEPS, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[
            _LatePlant(plant),
            TraceCallback(out / "trace.safetensors"),
            FinalStateCallback(out / "final.safetensors"),
        ],
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on workers
        trainer.fit(_Net(), DataLoader(data, batch_size=4))
    return out


def test_a_gradient_changed_after_the_last_traced_step_is_found_by_the_final_state(
    tmp_path: Path, restore_torch_flags: None
) -> None:
    a, b, planted = (_fit(tmp_path / name, p) for name, p in (("a", 0.0), ("b", 0.0), ("c", 1e-3)))
    assert compare_traces(
        load_trace(a / "trace.safetensors"), load_trace(b / "trace.safetensors")
    ).identical
    assert (a / "final.safetensors").read_bytes() == (b / "final.safetensors").read_bytes()
    diff = compare_traces(
        load_trace(a / "trace.safetensors"), load_trace(planted / "trace.safetensors")
    )
    assert (diff.identical, diff.record, diff.first_step) == (False, "final", 1)
    assert diff.tensor == "parameters, optimizer"
    text = diff.to_text()
    assert "final state parts differing: parameters, optimizer" in text
    assert "first differing tensor" not in text  # the parts are not tensors
    assert "steps 1-9; weights_every=32" in diff.diagnosis
    verdict = compare_files(
        "final", a / "final.safetensors", planted / "final.safetensors", (a, planted)
    )
    assert [d.name for d in verdict.tensors] == [
        "optimizer/0/0/momentum_buffer",
        "parameters/body.0.weight",
    ]


@pytest.mark.slow
def test_verify_finds_a_pid_dependent_gradient_at_the_last_step_in_the_trace_alone(
    tmp_path: Path,
) -> None:
    """The issue's plant: the trace alone finds it; the .ckpt and the final state name it."""
    script = ROOT / "tests" / "scripts" / "late_fault_fit.py"
    ckpt = "checkpoints/epoch=0-step=38.ckpt"
    runs = {}
    for name, options, plant in (
        ("clean", (), ()),  # every file it writes, the .ckpt with its own paths included
        ("trace", ("--output", "trace.safetensors"), ("--plant",)),
        ("weights", ("--output", ckpt, "--output", "final_state.safetensors"), ("--plant",)),
    ):
        runs[name] = run_cli(
            "verify", "--workdir", tmp_path / name, *options, "--",
            sys.executable, script, "--out", "{out}", *plant, cwd=ROOT,
        )  # fmt: skip
    clean, trace, weights = runs["clean"], runs["trace"], runs["weights"]
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert clean.stdout.startswith(f"reprotrain verify: IDENTICAL: 2 runs, {ckpt}, final_state")
    assert trace.returncode == 1, trace.stdout + trace.stderr
    assert "traces diverge at step 33 (row 33): final differs first" in trace.stdout
    assert "    final_state: differs" in trace.stdout.splitlines()
    assert weights.returncode == 1, weights.stdout + weights.stderr
    lines = weights.stdout.splitlines()
    assert any(line.startswith(f"  {ckpt} (checkpoint): ") for line in lines), lines
    assert any(line.startswith("    state_dict/body.3.weight: different") for line in lines)
    assert any(
        line.startswith("    optimizer_states/0/state/4/exp_avg: different") for line in lines
    )
    assert any(line.startswith("    parameters/body.3.weight: different") for line in lines)
