"""A user's 38-step Lightning fit whose only fault can come after the trace's last weights row.

``--plant`` adds a number between 1 and 2 drawn from the pid to one
gradient at step 37 only (``on_after_backward``; seeded by the pid itself,
not a residue: two runs' pids can differ by a multiple of any small modulus,
each run starting as many threads; and not proportional to it: ``pid * 1e-7``
moved that weight by less than its last bit when two pids lay close, so the
weights of two runs were equal about half the time after Adam's update):
the trace samples weights every 32nd
step (0 and 32), and no later loss sees that last update, so only the final
state shows it. The model has a BatchNorm (buffers) and trains with Adam
(optimizer state). ``TraceCallback`` writes ``trace.safetensors``,
``FinalStateCallback`` writes ``final_state.safetensors`` and Lightning's
``ModelCheckpoint`` ``checkpoints/epoch=0-step=38.ckpt`` (which holds its own
folder) under ``--out``.
Run it as ``reprotrain verify -- python tests/scripts/late_fault_fit.py --out {out}``.
"""

from __future__ import annotations

import argparse
import os
import random
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from reprotrain.determinism import configure_determinism
from reprotrain.trace.callback import TraceCallback
from reprotrain.trace.finalstate import FinalStateCallback

STEPS, PLANT_STEP = 38, 37


class Net(L.LightningModule):
    def __init__(self, plant: bool) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Linear(8, 16),
            torch.nn.BatchNorm1d(16),
            torch.nn.ReLU(),
            torch.nn.Linear(16, 2),
        )
        self.plant = plant

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.body(batch[0]), batch[1])

    def on_after_backward(self) -> None:
        if self.plant and self.trainer.global_step == PLANT_STEP:
            with torch.no_grad():
                self.body[3].weight.grad[0, 0] += random.Random(os.getpid()).uniform(1, 2)  # FAULT

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--plant", action="store_true")
    args = parser.parse_args()
    settings = configure_determinism(0)
    numbers = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(STEPS * 8, 8, generator=numbers), torch.arange(STEPS * 8) % 2)
    trainer = L.Trainer(
        **settings.trainer_flags(),
        max_steps=STEPS,
        logger=False,
        default_root_dir=args.out,  # ModelCheckpoint: checkpoints/epoch=0-step=38.ckpt
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            TraceCallback(args.out / "trace.safetensors"),
            FinalStateCallback(args.out / "final_state.safetensors"),
        ],
    )
    trainer.fit(Net(args.plant), DataLoader(data, batch_size=8))


if __name__ == "__main__":
    main()
