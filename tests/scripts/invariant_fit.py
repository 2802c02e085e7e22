"""A user's own Lightning script in world-size invariant mode (not the pipeline).

    python invariant_fit.py OUT DEVICES [--plain] [--num-nodes N]

Trains a small MLP with dropout and a random per-sample augmentation in
DataLoader workers, then rank 0 writes the weights to OUT (safetensors) and
the per-step losses to OUT.json. ``--plain`` trains with plain DDP (the
negative control); ``--batchnorm`` adds a layer the mode must refuse.
Lightning starts the other ranks by rerunning this file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import lightning as L
import torch
from safetensors.torch import save_file
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from reprotrain.determinism import configure_determinism
from reprotrain.distributed.ddp import ddp_strategy, worker_start
from reprotrain.distributed.microbatches import MicroBatchSampler, sample_rng
from reprotrain.distributed.worldsize import WorldSizeInvariantStrategy, step_loss

BATCH, MICRO, SEED = 32, 4, 7


class Noisy(Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(200, 20, generator=g), torch.randint(0, 4, (200,), generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, item):  # type: ignore[no-untyped-def]
        index, key = item if isinstance(item, tuple) else (item, None)
        x = self.x[index]
        if key is not None:  # keyed: the same draw at any world size, in any worker
            x = x + 0.1 * torch.from_numpy(sample_rng(key).standard_normal(20)).float()
        return x, self.y[index]


class Mlp(L.LightningModule):
    def __init__(self, batchnorm: bool = False) -> None:
        super().__init__()
        norm = nn.BatchNorm1d(64) if batchnorm else nn.Identity()
        self.net = nn.Sequential(
            nn.Linear(20, 64), norm, nn.ReLU(), nn.Dropout(0.3), nn.Linear(64, 4)
        )
        self.losses: list[float] = []

    def training_step(self, batch, _):  # type: ignore[no-untyped-def]
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def on_before_optimizer_step(self, optimizer) -> None:  # type: ignore[no-untyped-def]
        loss = step_loss(self.trainer)
        if loss is not None:
            self.losses.append(float(loss))

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.Adam(self.parameters(), lr=0.01)


class Data(L.LightningDataModule):
    def __init__(self, plain: bool) -> None:
        super().__init__()
        self.plain = plain
        self.generator = torch.Generator().manual_seed(SEED)

    def train_dataloader(self) -> DataLoader:
        rank, world = self.trainer.global_rank, self.trainer.world_size
        # workers start from a fork server, not forked beside gloo's threads (a hang, twice)
        start = {"num_workers": 2, "multiprocessing_context": worker_start(Noisy())}
        if self.plain:  # each rank: its strided share of one shuffle, BATCH / world each
            order = torch.randperm(200, generator=self.generator)[rank::world].tolist()
            return DataLoader(Noisy(), batch_size=BATCH // world, sampler=order, **start)
        sampler = MicroBatchSampler(200, BATCH, MICRO, rank, world, self.generator)
        return DataLoader(Noisy(), batch_sampler=sampler, generator=self.generator, **start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("devices", type=int)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--plain", action="store_true")
    parser.add_argument("--batchnorm", action="store_true")
    parser.add_argument("--gpu", action="store_true", help="one GPU per process, NCCL")
    args = parser.parse_args()
    configure_determinism(SEED, True)
    world = args.devices * args.num_nodes
    accelerator = "gpu" if args.gpu else "cpu"
    if args.plain:
        strategy, accumulate = ddp_strategy(accelerator), 1
    else:
        strategy = WorldSizeInvariantStrategy(BATCH // MICRO, SEED, accelerator)
        accumulate = strategy.micro_batches_per_rank(world)
    model = Mlp(args.batchnorm)
    trainer = L.Trainer(
        accelerator=accelerator, strategy=strategy, devices=args.devices, num_nodes=args.num_nodes,
        accumulate_grad_batches=accumulate, use_distributed_sampler=False, max_epochs=2,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, deterministic=True,
    )  # fmt: skip
    trainer.fit(model, datamodule=Data(args.plain))
    if trainer.is_global_zero:
        save_file({k: v.contiguous() for k, v in model.net.state_dict().items()}, args.out)
        record = {"losses": model.losses, "steps": trainer.global_step}
        Path(args.out + ".json").write_text(json.dumps(record))


if __name__ == "__main__":
    sys.exit(main())
