"""A user's Lightning script (no pipeline), with one planted fault at a time.

Written from docs/library.md and docs/any-script.md alone:
``configure_determinism`` before the model, ``TraceCallback`` and
``OpRecorder`` in the Trainer, weights saved with safetensors. Run it as
``reprotrain verify -- python tests/scripts/fault_fit.py --out {out} --fault NAME``.
The data comes from two DataLoader workers and is augmented with a NumPy
``Generator`` that each worker makes for itself in ``worker_init_fn``
(torch seeds the legacy global ``np.random`` in workers, not a Generator).

Faults: ``workers`` makes that Generator without a seed (the worker's seed
from ``get_worker_info()`` left out), so every run's workers draw from fresh
entropy. It shows at the first op that reads the batch (its line says
``SHOWS workers``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import lightning as L
import numpy as np
import torch
from safetensors.torch import save_file
from torch.utils.data import DataLoader, Dataset, get_worker_info

from reprotrain.determinism import configure_determinism
from reprotrain.ops.recorder import OpRecorder
from reprotrain.trace.callback import TraceCallback


class Jittered(Dataset):
    """Fixed samples with NumPy noise added when read (an augmentation)."""

    def __init__(self, fault: str) -> None:
        numbers = np.random.default_rng(0)
        self.x = numbers.standard_normal((256, 16)).astype(np.float32)
        self.y = numbers.integers(0, 4, 256)
        self.fault = fault
        self.rng = np.random.default_rng(0)  # the main process's; each worker makes its own

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        noise = self.rng.normal(0.0, 0.05, 16).astype(np.float32)
        return torch.from_numpy(self.x[i] + noise), int(self.y[i])


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(64, 4)
        )

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(self.body(x), y)  # SHOWS workers

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def seed_worker(_: int) -> None:
    """Give this worker its own NumPy Generator, from the seed torch gave the worker."""
    info = get_worker_info()
    if info.dataset.fault == "workers":
        info.dataset.rng = np.random.default_rng()  # FAULT workers
    else:
        info.dataset.rng = np.random.default_rng(info.seed)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--fault", default="none")
    args = parser.parse_args()
    settings = configure_determinism(0)
    loader = DataLoader(
        Jittered(args.fault),
        batch_size=32,
        shuffle=True,
        generator=torch.Generator().manual_seed(0),
        num_workers=2,
        worker_init_fn=seed_worker,
    )
    trainer = L.Trainer(
        **settings.trainer_flags(),
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[TraceCallback(args.out / "trace.safetensors"), OpRecorder()],
    )
    model = Net()
    trainer.fit(model, loader)
    save_file(model.state_dict(), args.out / "model.safetensors")


if __name__ == "__main__":
    main()
