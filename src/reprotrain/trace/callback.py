"""Per-step fingerprints of a Lightning run, to find where two runs part ways.

``TraceCallback`` writes one row per training batch: int64 fingerprints of
the batch (every tensor in it) and of the RNG states at the step's start
(python, numpy, torch CPU, each initialised CUDA device), the loss's exact
bits (as float64), and the global step, epoch and batch index. Every
``weights_every``-th row also fingerprints the gradients (before the
optimizer step) and the trainable parameters (after it). ``detail="full"``
traces weights on every row, with a fingerprint per parameter tensor and per
RNG source, so compare can name the first one that differs. By default only
every 32nd row traces weights, because a fingerprint reads every byte: on one
CPU thread a 10M-parameter MLP's gradients and weights (80 MB) take about
130 ms, more than its step; every 32nd row that is 4.2 ms per 100 ms step
(``benchmarks/overhead/trace_overhead.py``). A divergence between weight rows still
shows at once in the next step's loss.

The loss is what ``training_step`` returned. Under manual optimization
(``automatic_optimization = False``) a step that returns no loss records the
first loss it gave ``manual_backward`` (read in ``on_before_backward``), and
such a trace has one more column, ``backward_losses``: every loss the step
gave backward (several with two optimizers) as one int64, their count ``h``
then ``h = h * 3 + bits`` for each loss's float64 bits, in order (a
non-scalar loss by its float64 sum). ``loss`` then holds the first loss's
bits and value, ``backward_losses`` all of them; a step with no backward
records NaN and a count of 0. Traces of automatic optimization have no such
column: their bytes are as before it existed.

Fingerprints (:mod:`reprotrain.fingerprint`) are exact integer hashes of the
bits, computed on the tensors' device, kept there until every ``flush_every``
rows. The same run gives the same trace file, byte for byte, whatever
``flush_every`` and wherever the rows were built.

On a GPU a step never waits for the device (``torch.cuda.set_sync_debug_mode``
finds no synchronising call in a step's hooks: ``tests/test_trace.py``), and
it launches as few kernels as it can, since a small model's step is bound by
the host launching kernels: it copies a batch of up to 1 MiB into one buffer
and the loss as float64 (two kernels), and keeps both; every ``flush_every``
rows the kept batches are fingerprinted together, a few kernels for all of
them (:func:`~reprotrain.fingerprint.row_fingerprints`), and the rows read to
the host at once. Weight rows are fingerprinted at their step. The rows are
the same bytes as when every step fingerprinted its own batch.

On CPU, where a small model's step is short and each library call in a hook
costs several microseconds (the step has pushed the hook's code and data out
of the caches), a row is Python ints and a step does only what cannot wait:
it captures the RNG states (:mod:`reprotrain.trace.rngstate`), copies a batch of
up to 64 KiB and reads the loss. Every 64 rows (and at a flush) the captured
states are hashed and the batches fingerprinted together, where that code
runs hot. Cost (``benchmarks/overhead/trace_overhead.py``, one torch thread on a
shared 2-core machine): the pipeline's 38k-parameter model pays 0.15-0.16 ms
per step at default detail, 1.6% of its 9.8 ms step (0.7-0.8 ms, 7%, before
this scheme; 0.19-0.27 ms while the RNG states were read with the libraries'
own getters, see :mod:`reprotrain.trace.rngstate`).

At the end of fit ``final_state`` fingerprints every parameter, buffer and
the optimizer state (:mod:`reprotrain.trace.finalstate`): a divergence after the
last weights row, or in a buffer, still shows. Limits: rows trace only
trainable parameters; no non-tensor batch items or non-global generators
(a DataLoader's own generator shows in the batch).

Under DDP every rank traces its own rows (its batch, RNG state and loss;
gradients as DDP leaves them, after the all-reduce, so a backward difference
on one rank shows on every rank at once); at the end of fit (and in every
checkpoint) the rows of all ranks are gathered and rank 0 writes one file with
a ``rank`` column. A trace of a sharded model covers each rank's shard.

Under :class:`~reprotrain.distributed.worldsize.WorldSizeInvariantStrategy` a row is a
micro-batch: its ``batch_idx`` is the micro-batch's place in the epoch over
all ranks, its loss the micro-batch's own, its RNG state the one seeded for
it; weights are traced on the last micro-batch of every ``weights_every``-th
step (the gradients the step applies, the same on every rank). Rank 0 writes
the rows of all ranks merged in that order as one stream (``world_size`` 1),
so the trace, like the weights, is the same file at any world size.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.optim import Optimizer

from reprotrain.atomic import atomic_write_safetensors
from reprotrain.distributed.ddp import gather_from_ranks, own_entry
from reprotrain.distributed.worldsize import WorldSizeInvariantStrategy
from reprotrain.fingerprint import bytes_fingerprints, fingerprints, host_fingerprints
from reprotrain.hashing import safetensors_metadata
from reprotrain.trace.batchcolumn import BatchColumn
from reprotrain.trace.finalstate import FINAL_PARTS, final_fingerprints, final_state
from reprotrain.trace.rngstate import RngDigests, capture_rng, rng_states
from reprotrain.trace.rows import (
    KeptBatch,
    Mixer,
    chain,
    chain_losses,
    float64_bits,
    float64_value,
    tensor_key,
)
from reprotrain.trace.tracefile import FORMAT, RECORDS, VERSION, Detail

__all__ = ["DEFAULT_WEIGHTS_EVERY", "TraceCallback"]

#: ``weights_every`` for ``detail="default"``: a 10M MLP's CPU step pays about 4% for weights.
DEFAULT_WEIGHTS_EVERY = 32
_HOST_COLUMNS = ("step", "epoch", "batch_idx", "weights_traced", "rng")
#: Host rows whose RNG states (and kept CPU batches) are hashed together, at most.
_KEEP_ROWS = 64


class TraceCallback(Callback):
    """Record per-step fingerprints during ``fit`` and write them to ``path`` at its end.

    With ``path=None`` nothing is written automatically: call :meth:`write`
    (the pipeline writes the trace together with its other outputs). The rows
    ride along in Lightning checkpoints, so a resumed fit continues the trace.

    ``weights_every``: trace gradients and parameters on every n-th row
    (default 1 with ``detail="full"``, else ``DEFAULT_WEIGHTS_EVERY``).
    ``flush_every``: rows kept on the device before one copy to the host
    (on CPU: before the rows become one array).
    """

    def __init__(
        self,
        path: str | Path | None,
        detail: Detail = "default",
        flush_every: int = 64,
        weights_every: int | None = None,
    ) -> None:
        if detail not in ("default", "full"):
            raise ValueError(f"detail must be 'default' or 'full', got {detail!r}")
        self.weights_every = weights_every or (1 if detail == "full" else DEFAULT_WEIGHTS_EVERY)
        if flush_every < 1 or self.weights_every < 1:
            raise ValueError("flush_every and weights_every must be >= 1")
        self.path = None if path is None else Path(path)
        self.detail, self.flush_every = detail, flush_every
        self._restored: dict[str, Any] | None = None

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # on_fit_start, not on_train_start: a fit resumed from its final checkpoint runs no
        # training loop (no on_train_start / on_train_end), and must still write its trace.
        named = [(n, p) for n, p in pl_module.named_parameters() if p.requires_grad]
        self._names, self._params = tuple(n for n, _ in named), [p for _, p in named]
        self._device = pl_module.device
        # On CPU the rows are Python ints until a flush: no torch kernel per row for them.
        self._on_cpu = self._device.type == "cpu"
        self._mix = Mixer([tensor_key(n, p.dtype, tuple(p.shape)) for n, p in named], self._device)
        self._batches = BatchColumn(self._device)
        self._rng_sources = tuple(rng_states())
        self._rng_digests = RngDigests(self._rng_sources if self.detail == "full" else ())
        width = 2 + (2 * len(named) if self.detail == "full" else 0)
        self._untraced = torch.zeros(width, dtype=torch.int64, device=self._device)
        self._untraced_row = [0] * width
        self._pending: list[Any] = []  # (batch, loss, weights) of device rows; on CPU lists
        self._kept: list[list[Any]] = []  # CPU rows, to finish: KeptBatch, loss as a float
        self._unhashed: list[list[Any]] = []  # host rows whose rng columns are an RngCapture
        self._flushed: list[np.ndarray] = []
        self._host: list[list[int]] = []  # step, epoch, batch_idx, traced, rng, rng sources
        self._grads: torch.Tensor | list[int] | None = None
        self._gathered: list[dict[str, Any]] | None = None  # every rank's rows, at the end
        self._final: list[int] | None = None  # the final state's fingerprints, at the end
        self._merge_ranks = isinstance(trainer.strategy, WorldSizeInvariantStrategy)
        self._manual = not pl_module.automatic_optimization
        self._backward: list[torch.Tensor] = []  # float64 copies of this step's backward losses
        if self._restored is not None:  # resuming: keep the rows of the steps already run
            self._continue(self._restored)
            return
        initial = fingerprints(self._params, self._device)
        self._initial = int(self._mix(initial))

    def state_dict(self) -> dict[str, Any]:
        """Every rank's rows so far, as tensors (checkpoints load with ``weights_only=True``)."""
        return {"ranks": gather_from_ranks(self._local_state())}

    def _local_state(self) -> dict[str, Any]:
        self._flush()
        rows = np.concatenate(self._flushed) if self._flushed else np.zeros((0, 0), np.int64)
        state = {
            "settings": self._settings(),
            "names": list(self._names),
            "initial": self._initial,
            "rows": torch.from_numpy(rows),
            "host": torch.tensor(self._host, dtype=torch.int64),
        }
        if self._final is not None:
            state["final"] = torch.tensor(self._final, dtype=torch.int64)
        return state

    def _settings(self) -> list[Any]:
        """What a resumed fit must trace the same way; "manual" adds the backward_losses column."""
        return [self.detail, self.weights_every, *(["manual"] if self._manual else [])]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = state_dict

    def _continue(self, restored: dict[str, Any]) -> None:
        state = own_entry(restored["ranks"], "checkpoint holds the trace rows")
        if state["settings"] != self._settings():
            raise ValueError(
                f"checkpoint traced with detail/weights_every {state['settings']}, "
                f"this run uses {self._settings()}"
            )
        if tuple(state["names"]) != self._names:
            raise ValueError("checkpoint traced other parameters than this model has")
        self._initial = state["initial"]
        if len(state["rows"]):
            self._flushed.append(state["rows"].numpy())
        self._host = state["host"].tolist()
        self._restored = None

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._grads = None
        self._backward = []
        if self._merge_ranks:
            strategy = trainer.strategy
            per_rank = trainer.accumulate_grad_batches
            micro_batch = strategy.first_micro_batch + batch_idx % per_rank
            batch_idx = batch_idx // per_rank * strategy.micro_batches + micro_batch
            last = micro_batch == strategy.micro_batches - 1
            self._traced = last and trainer.global_step % self.weights_every == 0
        else:
            self._traced = len(self._host) % self.weights_every == 0
        self._batch_fp = self._batches.fingerprint(batch)
        row = [trainer.global_step, trainer.current_epoch, batch_idx, int(self._traced)]
        previous = self._unhashed[-1][4] if self._unhashed else None
        row.append(capture_rng(previous))  # hashed with the rows around it (_finish_rows)
        self._host.append(row)
        self._unhashed.append(row)

    def on_before_backward(
        self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor
    ) -> None:
        if self._manual:  # Lightning calls it for manual_backward too
            loss = loss.detach().to(torch.float64, copy=True)
            self._backward.append(loss.reshape(()) if loss.numel() == 1 else loss.sum())

    def on_before_optimizer_step(
        self, trainer: Trainer, pl_module: LightningModule, optimizer: Optimizer
    ) -> None:
        if self._traced:
            zero = torch.zeros((), dtype=torch.int64, device=self._device)
            fps = self._fingerprint([zero if p.grad is None else p.grad for p in self._params])
            # Several optimizer steps in one batch (manual optimization): chain them.
            self._grads = fps if self._grads is None else chain(self._grads, fps)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if self._merge_ranks:
            loss = trainer.strategy.micro_batch_loss  # Lightning's is divided by the rank's share
        if not isinstance(loss, torch.Tensor):  # manual optimization that returns nothing
            loss = self._backward[0] if self._backward else torch.tensor(float("nan"))
        if self._on_cpu:
            self._append_host_row(float64_value(loss))
        else:
            # float64 holds every float loss exactly: its bits are the loss bits, and the value.
            # A copy, so a later in-place change of the loss tensor cannot reach the row.
            loss = loss.detach().reshape(()).to(self._device, torch.float64, copy=True)
            weights = self._fingerprint_weights() if self._traced else None
            backward = chain_losses(self._backward, self._device) if self._manual else None
            self._pending.append((self._batch_fp, loss, weights, backward))
        if len(self._pending) >= self.flush_every:
            self._flush()
        elif len(self._unhashed) >= _KEEP_ROWS:
            self._finish_rows()

    def _append_host_row(self, loss: float) -> None:
        weights = self._fingerprint_weights() if self._traced else self._untraced_row
        row = [self._batch_fp, loss, *weights]  # the first two finished by _finish_rows
        if self._manual:
            row.append(chain_losses(self._backward, None))  # a Python int, as the row
        self._pending.append(row)
        self._kept.append(row)

    def _finish_rows(self) -> None:
        """Finish the rows kept since the last call, many at once where the code runs hot.

        Hash their RNG states; on CPU fingerprint their kept batches and turn
        their losses into bits.
        """
        for row in self._unhashed:
            row[4:] = self._rng_digests(row[4])
        kept = [row[0] for row in self._kept if isinstance(row[0], KeptBatch)]
        values = iter(bytes_fingerprints([leaf for batch in kept for leaf in batch.leaves]))
        for row in self._kept:
            if isinstance(row[0], KeptBatch):
                row[0] = row[0].mix.host([next(values) for _ in row[0].leaves])
            row[1] = float64_bits(row[1])
        self._unhashed, self._kept = [], []

    def _fingerprint(self, tensors: list[torch.Tensor]) -> Any:
        """Fingerprints of parameters or gradients: Python ints on CPU, else on the device."""
        return host_fingerprints(tensors) if self._on_cpu else fingerprints(tensors, self._device)

    def _fingerprint_weights(self) -> Any:
        """grads and params columns, then with ``detail="full"`` the per-tensor ones."""
        params = self._fingerprint(self._params)
        if self._on_cpu:
            grads = [0] * len(params) if self._grads is None else self._grads
            weights = [self._mix.host(grads), self._mix.host(params)]
            return weights + grads + params if self.detail == "full" else weights
        grads = torch.zeros_like(params) if self._grads is None else self._grads
        weights = torch.stack([self._mix(grads), self._mix(params)])
        return torch.cat([weights, grads, params]) if self.detail == "full" else weights

    def _flush(self) -> None:
        self._finish_rows()
        if not self._pending:
            return
        if self._on_cpu:
            self._flushed.append(np.array(self._pending, dtype=np.int64))
        else:
            self._flushed.append(self._device_rows(self._pending).cpu().numpy())
        self._pending = []

    def _device_rows(self, pending: list[Any]) -> torch.Tensor:
        """The kept device rows as one ``rows x width`` int64 tensor, built together."""
        batches = self._batches.device_column([batch for batch, *_ in pending])
        losses = torch.stack([loss for _, loss, *_ in pending]).view(torch.int64)
        weights = torch.stack([self._untraced if w is None else w for _, _, w, _ in pending])
        columns = [batches[:, None], losses[:, None], weights]
        if self._manual:
            columns.append(torch.stack([backward for *_, backward in pending])[:, None])
        return torch.cat(columns, dim=1)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._final = final_fingerprints(final_state(pl_module, trainer.optimizers))
        self._gathered = gather_from_ranks(self._local_state())
        if trainer.is_global_zero and self.path is not None:
            self.write(self.path)

    def write(self, path: str | Path) -> None:
        """Write every rank's rows as one trace file: deterministic bytes, atomic.

        Under DDP call it on rank 0 after ``fit`` (which gathered the ranks' rows).
        """
        ranks = self._gathered or [self._local_state()]
        parts = [self._tensors(state) for state in ranks]
        tensors = {name: torch.cat([part[name] for part in parts]) for name in parts[0]}
        tensors["rank"] = torch.cat(
            [torch.full((len(part["step"]),), r, dtype=torch.int64) for r, part in enumerate(parts)]
        )
        if self._merge_ranks:  # one stream in micro-batch order, whatever the world size
            order = np.lexsort((tensors["batch_idx"].numpy(), tensors["epoch"].numpy()))
            tensors = {name: t[torch.from_numpy(order)].contiguous() for name, t in tensors.items()}
            tensors["rank"].zero_()
            ranks = ranks[:1]
        tensors["initial_params"] = torch.tensor([s["initial"] for s in ranks], dtype=torch.int64)
        unknown = torch.zeros(len(FINAL_PARTS), dtype=torch.int64)  # written before fit ended
        tensors["final_state"] = torch.stack([s.get("final", unknown) for s in ranks])
        names = {"param_names": list(self._names), "rng_sources": list(self._rng_sources)}
        metadata = safetensors_metadata(
            {"format": FORMAT, "version": VERSION, "detail": self.detail, **names,
             "weights_every": self.weights_every, "records": list(RECORDS),
             "world_size": len(ranks)}
        )  # fmt: skip
        atomic_write_safetensors(path, tensors, metadata)

    def _tensors(self, state: dict[str, Any]) -> dict[str, torch.Tensor]:
        """One rank's rows (a ``_local_state``) as the file's columns."""
        n = len(self._names)
        per_param = 2 * n if self.detail == "full" else 0
        empty = torch.zeros((0, 4 + per_param + int(self._manual)), dtype=torch.int64)
        rows = torch.cat([empty, state["rows"].reshape(-1, empty.shape[1])])
        width = len(_HOST_COLUMNS) + (len(self._rng_sources) if self.detail == "full" else 0)
        host = state["host"].reshape(-1, width)
        tensors = {name: host[:, i] for i, name in enumerate(_HOST_COLUMNS)}
        tensors |= {name: rows[:, i] for i, name in enumerate(("batch", "loss", "grads", "params"))}
        tensors["weights_traced"] = tensors["weights_traced"].bool()
        tensors["loss_value"] = rows[:, 1].contiguous().view(torch.float64)
        if self.detail == "full":
            by_param = rows[:, 4 : 4 + per_param].split(n, dim=1)
            tensors["grads_per_param"], tensors["params_per_param"] = by_param
            tensors["rng_per_source"] = host[:, len(_HOST_COLUMNS) :]
        if self._manual:
            tensors["backward_losses"] = rows[:, -1]
        return tensors
