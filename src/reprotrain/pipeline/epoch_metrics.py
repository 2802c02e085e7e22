"""A module's own ``on_epoch`` training metrics, kept across a resume in the middle of an epoch.

A checkpoint written inside an epoch (at SIGTERM) holds what the epoch's
metrics have summed so far, which Lightning does not keep, so that the
resumed run's epoch value is the uninterrupted run's, to the bit
(:class:`EpochAccumulators`). The pipeline's own curves are kept by
:class:`~reprotrain.pipeline.curves.CurveCheckpoint`.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torchmetrics import Metric

from reprotrain.distributed.ddp import gather_from_ranks, own_entry
from reprotrain.pipeline.curves import CheckpointPlace


class EpochAccumulators(CheckpointPlace):
    """What a module's ``on_epoch`` training metrics have summed so far, kept in a checkpoint
    written mid-epoch and put back on resume, so the epoch's value is the uninterrupted run's.

    Lightning checkpoints neither part: a tensor logged with ``on_epoch=True``
    sums into the training loop's results (``fit_loop.epoch_loop._results``,
    Lightning 2.6, the version the locks pin), a torchmetrics object into its
    own states (not in the module's ``state_dict``). After a resume both would
    start the epoch from zero. Torchmetrics objects get their states back
    before the first step. A logged tensor's sum is put back at the end of the
    first batch that logs it: that batch added its value to zero, which is
    exactly its value, so ``saved + value`` is the uninterrupted run's sum to the
    bit. Under DDP each rank keeps its own (gathered in rank order, a collective).
    """

    def __init__(self) -> None:
        super().__init__()
        self._sums: dict[str, dict[str, torch.Tensor]] = {}
        self._metrics: dict[str, dict[str, Any]] = {}

    def state_dict(self) -> dict[str, Any]:
        local: dict[str, Any] = {"sums": {}, "metrics": {}}
        if self._in_batch and self._trainer is not None:
            local = {"sums": self._local_sums(), "metrics": self._local_metrics()}
        return {"ranks": gather_from_ranks(local)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        local = own_entry(state["ranks"], "checkpoint holds the epoch's metric sums")
        self._sums, self._metrics = dict(local["sums"]), dict(local["metrics"])

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for name, metric in pl_module.named_modules():
            if isinstance(metric, Metric) and name in self._metrics:
                saved = self._metrics[name]
                for attr, value in saved["states"].items():
                    moved = (
                        [v.to(pl_module.device) for v in value]
                        if isinstance(value, list)
                        else value.to(pl_module.device)
                    )
                    setattr(metric, attr, moved)
                metric._update_count = int(saved["updates"])
                metric._computed = None
        self._metrics = {}

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if not self._sums:
            return
        results = trainer.fit_loop.epoch_loop._results
        for key in [k for k in self._sums if k in results]:
            saved, result = self._sums.pop(key), results[key]
            value = saved["value"].to(result.value)
            if result.meta.is_max_reduction or result.meta.is_min_reduction:
                result.value = result.meta.reduce_fx(value, result.value)
            else:
                result.value = value + result.value
            if "count" in saved:
                result.cumulated_batch_size = saved["count"].to(result.cumulated_batch_size) + (
                    result.cumulated_batch_size
                )

    def _local_sums(self) -> dict[str, dict[str, torch.Tensor]]:
        results = self._trainer.fit_loop.epoch_loop._results  # type: ignore[union-attr]
        sums = {}
        for key, result in results.items():
            if getattr(result, "is_tensor", False) and result.meta.on_epoch:
                entry = {"value": result.value.detach().cpu().clone()}
                if result.meta.is_mean_reduction:
                    entry["count"] = result.cumulated_batch_size.detach().cpu().clone()
                sums[key] = entry
        return sums

    def _local_metrics(self) -> dict[str, dict[str, Any]]:
        module = self._trainer.lightning_module  # type: ignore[union-attr]
        saved = {}
        for name, metric in module.named_modules():
            if isinstance(metric, Metric):
                states = {
                    attr: [v.detach().cpu().clone() for v in value]
                    if isinstance(value, list)
                    else value.detach().cpu().clone()
                    for attr, value in metric.metric_state.items()
                }
                saved[name] = {"states": states, "updates": int(metric._update_count)}
        return saved
