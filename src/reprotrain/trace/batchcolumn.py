"""The batch column of a trace: each training batch's fingerprint, at the least cost.

A step fingerprints its batch (every tensor in it, :func:`batch_leaves`) in one
of three ways, chosen once per batch layout: ``keep`` (a small batch on CPU,
traced on CPU: its bytes copied to the host, fingerprinted later with the
rows around it), ``copy`` (a small batch on the trace's device: its bits copied
into one buffer there, fingerprinted together at the flush, a few kernels for
all of them: :meth:`BatchColumn.device_column`) or ``now``. A batch holding a
sparse, quantized or nested tensor is fingerprinted at once, from its parts.
Each way gives the same column bytes; only when the work is done differs.
"""

from __future__ import annotations

from typing import Any

import torch

from reprotrain.fingerprint import (
    fingerprints,
    host_bytes,
    host_fingerprints,
    row_fingerprints,
    tensor_bytes,
)
from reprotrain.tensorparts import is_dense, shape_of
from reprotrain.trace.rows import DeviceBatch, KeptBatch, Mixer, batch_leaves, tensor_key

#: A CPU batch up to this size is kept as bytes and fingerprinted with the rows around it.
KEEP_BYTES = 64 * 1024
#: A device batch up to this size is copied and fingerprinted at the flush, with the others.
KEEP_DEVICE_BYTES = 1024 * 1024
#: At a flush, kept device batches are fingerprinted this many bytes of them at a time.
FLUSH_BYTES = 16 * 1024 * 1024


class BatchColumn:
    """Fingerprints of one run's batches on ``device``, the trace's device."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._on_cpu = device.type == "cpu"
        self._mixers: dict[tuple[object, ...], tuple[Mixer, str]] = {}

    def fingerprint(self, batch: Any) -> torch.Tensor | int | KeptBatch | DeviceBatch:
        """The batch column, or a copy of a small batch's bits to fingerprint later."""
        leaves = batch_leaves(batch)
        if not all(is_dense(t) for _, t in leaves):
            return self._parts_fingerprint(leaves)
        signature = tuple((p, t.dtype, t.shape, t.device) for p, t in leaves)
        mix, how = self._mixers.get(signature) or self._mixer(signature)
        tensors = [t for _, t in leaves]
        if how == "keep":
            return KeptBatch(mix, [host_bytes(t) for t in tensors])
        if how == "copy":
            return DeviceBatch(signature, torch.cat([tensor_bytes(t) for t in tensors]))
        if self._on_cpu:
            return mix.host(host_fingerprints(tensors))
        return mix(fingerprints(tensors, self._device))

    def _parts_fingerprint(self, leaves: list[tuple[str, torch.Tensor]]) -> Any:
        """The batch column of a batch holding a sparse, quantized or nested tensor: at once,
        from its parts (:func:`~reprotrain.fingerprint.tensor_bytes`)."""
        mix = Mixer([tensor_key(p, t.dtype, shape_of(t)) for p, t in leaves], self._device)
        tensors = [t for _, t in leaves]
        if self._on_cpu:
            return mix.host(host_fingerprints(tensors))
        return mix(fingerprints(tensors, self._device))

    def _mixer(self, signature: tuple[Any, ...]) -> tuple[Mixer, str]:
        """The mixer of a batch layout, and when such batches are fingerprinted.

        ``keep`` (small, on CPU, traced on CPU): bits copied to the host, for later;
        ``copy`` (small, on the trace's device): bits copied there, for the flush;
        ``now``: at once.
        """
        mix = Mixer(
            [tensor_key(p, dtype, tuple(shape)) for p, dtype, shape, _ in signature], self._device
        )
        size = sum(shape.numel() * dtype.itemsize for _, dtype, shape, _ in signature)
        if self._on_cpu and all(d.type == "cpu" for *_, d in signature) and size <= KEEP_BYTES:
            how = "keep"
        elif not self._on_cpu and all(d == self._device for *_, d in signature):
            how = "copy" if size <= KEEP_DEVICE_BYTES else "now"
        else:
            how = "now"
        self._mixers[signature] = (mix, how)
        return self._mixers[signature]

    def device_column(self, values: list[Any]) -> torch.Tensor:
        """Each row's batch fingerprint: kept batches of one layout fingerprinted together."""
        column = list(values)
        layouts: dict[tuple[Any, ...], list[int]] = {}
        for index, value in enumerate(values):
            if isinstance(value, DeviceBatch):
                layouts.setdefault(value.layout, []).append(index)
        for layout, indices in layouts.items():
            mix = self._mixers[layout][0]
            sizes = [shape.numel() * dtype.itemsize for _, dtype, shape, _ in layout]
            rows = max(1, FLUSH_BYTES // max(1, sum(sizes)))
            for start in range(0, len(indices), rows):
                chunk = indices[start : start + rows]
                data = torch.stack([values[i].data for i in chunk])
                mixed = mix.rows(row_fingerprints(data, sizes))
                for index, value in zip(chunk, mixed.unbind(), strict=True):
                    column[index] = value
        return torch.stack(column)
