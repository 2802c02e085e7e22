"""Per-step fingerprints of a Lightning run, to find where two runs part ways.

``TraceCallback`` writes one row per training batch: int64 fingerprints of
the batch (every tensor in it) and of the RNG states at the step's start
(python, numpy, torch CPU, each initialised CUDA device), the loss's exact
bits (as float64), and the global step, epoch and batch index. Every
``weights_every``-th row also fingerprints the gradients (before the
optimizer step) and the trainable parameters (after it). ``detail="full"``
traces weights on every row, with a fingerprint per parameter tensor and per
RNG source, so compare can name the first one that differs. By default only
every 32nd row traces weights, because a fingerprint reads every byte: on 2
CPU cores a 10M-parameter MLP's gradients and weights take 10-20 ms, a fifth
of its step or more (``benchmarks/trace_overhead.py``). A divergence between
weight rows still shows at once in the next step's loss.

Fingerprints (:mod:`reprotrain.devicehash`) are exact integer hashes of the
bits, computed on the tensors' device, kept there until every ``flush_every``
rows. The same run gives the same trace file, byte for byte.

Limits: only trainable parameters (as of ``on_fit_start``); no buffers
(BatchNorm statistics), optimizer state, non-tensor batch items or
non-global generators (a DataLoader's own generator shows in the batch).

Under DDP every rank traces its own rows (its batch, RNG state and loss;
gradients as DDP leaves them, after the all-reduce, so a backward difference
on one rank shows on every rank at once); at the end of fit (and in every
checkpoint) the rows of all ranks are gathered and rank 0 writes one file with
a ``rank`` column. A trace of a sharded model covers each rank's shard.

Under :class:`~reprotrain.invariant.WorldSizeInvariantStrategy` a row is a
micro-batch: its ``batch_idx`` is the micro-batch's place in the epoch over
all ranks, its loss the micro-batch's own, its RNG state the one seeded for
it; weights are traced on the last micro-batch of every ``weights_every``-th
step (the gradients the step applies, the same on every rank). Rank 0 writes
the rows of all ranks merged in that order as one stream (``world_size`` 1),
so the trace, like the weights, is the same file at any world size.
"""

from __future__ import annotations

import hashlib
import random
import struct
from array import array
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.optim import Optimizer

from reprotrain.atomic import atomic_write_safetensors
from reprotrain.devicehash import fingerprints
from reprotrain.distributed import gather_from_ranks, own_entry
from reprotrain.hashing import safetensors_metadata
from reprotrain.invariant import WorldSizeInvariantStrategy
from reprotrain.tracefile import FORMAT, RECORDS, VERSION, Detail, Trace, load_trace

__all__ = ["DEFAULT_WEIGHTS_EVERY", "Trace", "TraceCallback", "load_trace", "rng_states"]

#: ``weights_every`` for ``detail="default"``: keeps a 10M MLP's CPU step within 3%.
DEFAULT_WEIGHTS_EVERY = 32
_HOST_COLUMNS = ("step", "epoch", "batch_idx", "weights_traced", "rng")


def _key(*parts: object) -> int:
    return _hash_bytes("\0".join(map(str, parts)).encode())


def _hash_bytes(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


def _mixer(keys: Sequence[int], device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """Combines per-tensor fingerprints with their keys (name, dtype, shape) into one int64."""
    # Odd multipliers below 2**31 keep each product inside int64 before the sum wraps.
    mult = torch.tensor([(k & 0x7FFFFFFF) | 1 for k in keys], dtype=torch.int64, device=device)
    offset = sum(k >> 32 for k in keys)
    return lambda fps: (fps * mult).sum() + offset


def _leaves(obj: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(path, tensor) for every tensor in nested tuples, lists and mappings, in a fixed order."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, Mapping):
        for key in sorted(obj, key=str):
            yield from _leaves(obj[key], f"{path}.{key}")
    elif isinstance(obj, (list, tuple)):
        for index, item in enumerate(obj):
            yield from _leaves(item, f"{path}.{index}")


def rng_states() -> dict[str, bytes]:
    """The raw state of each global RNG; CUDA only where already initialised."""
    version, words, gauss = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    out = {
        "python": array("Q", words).tobytes() + repr((version, gauss)).encode(),
        "numpy": keys.tobytes() + struct.pack("<qqd", pos, has_gauss, cached),
        "torch": torch.get_rng_state().numpy().tobytes(),
    }
    # Asking an uninitialised CUDA for its state would start a context on every GPU.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for index, generator in enumerate(torch.cuda.default_generators):
            out[f"cuda:{index}"] = generator.get_state().numpy().tobytes()
    return out


class TraceCallback(Callback):
    """Record per-step fingerprints during ``fit`` and write them to ``path`` at its end.

    With ``path=None`` nothing is written automatically: call :meth:`write`
    (the pipeline writes the trace together with its other outputs). The rows
    ride along in Lightning checkpoints, so a resumed fit continues the trace.

    ``weights_every``: trace gradients and parameters on every n-th row
    (default 1 with ``detail="full"``, else ``DEFAULT_WEIGHTS_EVERY``).
    ``flush_every``: rows kept on the device before one copy to the host.
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
        self._mix = _mixer([_key(n, p.dtype, tuple(p.shape)) for n, p in named], self._device)
        self._batch_mixers: dict[tuple[object, ...], Callable[[torch.Tensor], torch.Tensor]] = {}
        self._rng_sources = tuple(rng_states())
        width = 2 + (2 * len(named) if self.detail == "full" else 0)
        self._untraced = torch.zeros(width, dtype=torch.int64, device=self._device)
        self._pending: list[torch.Tensor] = []
        self._flushed: list[np.ndarray] = []
        self._host: list[list[int]] = []  # step, epoch, batch_idx, traced, rng, rng sources
        self._grads: torch.Tensor | None = None
        self._gathered: list[dict[str, Any]] | None = None  # every rank's rows, at the end
        self._merge_ranks = isinstance(trainer.strategy, WorldSizeInvariantStrategy)
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
        return {
            "settings": [self.detail, self.weights_every],
            "names": list(self._names),
            "initial": self._initial,
            "rows": torch.from_numpy(rows),
            "host": torch.tensor(self._host, dtype=torch.int64),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = state_dict

    def _continue(self, restored: dict[str, Any]) -> None:
        state = own_entry(restored["ranks"], "checkpoint holds the trace rows")
        if state["settings"] != [self.detail, self.weights_every]:
            raise ValueError(
                f"checkpoint traced with detail/weights_every {state['settings']}, "
                f"this run uses {[self.detail, self.weights_every]}"
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
        strategy = trainer.strategy
        if isinstance(strategy, WorldSizeInvariantStrategy):
            per_rank = trainer.accumulate_grad_batches
            micro_batch = strategy.first_micro_batch + batch_idx % per_rank
            batch_idx = batch_idx // per_rank * strategy.micro_batches + micro_batch
            last = micro_batch == strategy.micro_batches - 1
            self._traced = last and trainer.global_step % self.weights_every == 0
        else:
            self._traced = len(self._host) % self.weights_every == 0
        leaves = list(_leaves(batch))
        signature = tuple((p, t.dtype, tuple(t.shape)) for p, t in leaves)
        if (mix := self._batch_mixers.get(signature)) is None:
            mix = self._batch_mixers[signature] = _mixer(
                [_key(*s) for s in signature], self._device
            )
        self._batch_fp = mix(fingerprints([t for _, t in leaves], self._device))
        states = rng_states()
        combined = _hash_bytes(b"".join(n.encode() + b"\0" + s for n, s in states.items()))
        sources = []
        if self.detail == "full":
            sources = [_hash_bytes(states[s]) if s in states else 0 for s in self._rng_sources]
        position = [trainer.global_step, trainer.current_epoch, batch_idx, int(self._traced)]
        self._host.append([*position, combined, *sources])

    def on_before_optimizer_step(
        self, trainer: Trainer, pl_module: LightningModule, optimizer: Optimizer
    ) -> None:
        if self._traced:
            zero = torch.zeros((), dtype=torch.int64, device=self._device)
            fps = fingerprints(
                [zero if p.grad is None else p.grad for p in self._params], self._device
            )
            # Several optimizer steps in one batch (manual optimization): chain them.
            self._grads = fps if self._grads is None else self._grads * 3 + fps

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if isinstance(trainer.strategy, WorldSizeInvariantStrategy):
            loss = trainer.strategy.micro_batch_loss  # Lightning's is divided by the rank's share
        if not isinstance(loss, torch.Tensor):  # manual optimization that returns nothing
            loss = torch.tensor(float("nan"))
        # float64 holds every float loss exactly: its bits are the loss bits, and the value.
        loss = loss.detach().reshape(()).to(self._device, torch.float64).view(torch.int64)
        weights = self._untraced
        if self._traced:
            params = fingerprints(self._params, self._device)
            grads = torch.zeros_like(params) if self._grads is None else self._grads
            weights = torch.stack([self._mix(grads), self._mix(params)])
            if self.detail == "full":
                weights = torch.cat([weights, grads, params])
        self._pending.append(torch.cat([torch.stack([self._batch_fp, loss]), weights]))
        if len(self._pending) >= self.flush_every:
            self._flush()

    def _flush(self) -> None:
        if self._pending:
            self._flushed.append(torch.stack(self._pending).cpu().numpy())
            self._pending = []

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
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
        empty = torch.zeros((0, 4 + (2 * n if self.detail == "full" else 0)), dtype=torch.int64)
        rows = torch.cat([empty, state["rows"].reshape(-1, empty.shape[1])])
        width = len(_HOST_COLUMNS) + (len(self._rng_sources) if self.detail == "full" else 0)
        host = state["host"].reshape(-1, width)
        tensors = {name: host[:, i] for i, name in enumerate(_HOST_COLUMNS)}
        tensors |= {name: rows[:, i] for i, name in enumerate(("batch", "loss", "grads", "params"))}
        tensors["weights_traced"] = tensors["weights_traced"].bool()
        tensors["loss_value"] = rows[:, 1].contiguous().view(torch.float64)
        if self.detail == "full":
            tensors["grads_per_param"], tensors["params_per_param"] = rows[:, 4:].split(n, dim=1)
            tensors["rng_per_source"] = host[:, len(_HOST_COLUMNS) :]
        return tensors
