"""Integer fingerprints of tensor bits, on the tensor's own device, for per-step traces.

A tensor's fingerprint is ``sum(byte[j] * c[j]) mod 2**32`` over its raw
bytes, ``c[j]`` a fixed odd hash of the position, in integer arithmetic on
the tensor's own device (int8 matmul on CPU; elsewhere float32, exact because
every partial sum is an integer below 2**24), so reduction order, thread
count and device do not change it. Guarantee: the same bits give the same
fingerprint, on every device; a change within
one byte always changes it; other changes collide with probability about
2**-32 (2**-24 for the worst patterns, such as two flipped sign bits).

CPU fingerprints run on one thread, briefly switching torch's global thread
count. :mod:`reprotrain.trace` records them per training step; for files on
disk use sha256 (:mod:`reprotrain.hashing`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

__all__ = ["fingerprint", "fingerprints", "tensor_bytes"]

_LOW32 = 0xFFFFFFFF
_BLOCK, _LANES = 1024, 8  # bytes per matmul row; weight columns
_SMALL_BYTES = 64 * _BLOCK  # tensors up to this size share one batched computation
_tables: dict[torch.device, tuple[torch.Tensor, ...]] = {}
_groups: dict[tuple[object, ...], tuple[torch.Tensor, torch.Tensor]] = {}


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (Wellons' hash prospector) of non-negative int64 values, in [0, 2**32)."""
    x = (x ^ (x >> 16)) & _LOW32
    x = (x * 0x7FEB352D) & _LOW32
    x = (x ^ (x >> 15)) & _LOW32
    x = (x * 0x846CA68B) & _LOW32
    return x ^ (x >> 16)


def _signed32(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x >= 1 << 31, x - (1 << 32), x).to(torch.int32)


def _weights(device: torch.device, rows: int) -> tuple[torch.Tensor, ...]:
    """W (int8, K x 8), R (int32, >= rows x 8) and C (int32, the first _SMALL_BYTES c[j]).

    ``c[m*K + k] = sum_n W[k, n] * R[m, n] mod 2**32``; column 0 of W and R is odd
    and R's other columns even, so every c[j] is odd. |W| <= 63 keeps int8
    kernels that add product pairs in int16 exact.
    """
    cached = _tables.get(device)
    if cached is None or cached[1].shape[0] < rows:
        size = max(rows, 2 * (0 if cached is None else cached[1].shape[0]), 256)
        lanes = torch.arange(_LANES, device=device)
        w = _mix32(torch.arange(_BLOCK * _LANES, device=device)).view(_BLOCK, _LANES) % 127 - 63
        w[:, 0] |= 1
        r = _mix32(torch.arange(size, device=device)[:, None] * _LANES + lanes + (1 << 40))
        r = torch.where(lanes == 0, r | 1, r & ~1)
        c = (w * r[: _SMALL_BYTES // _BLOCK, None]).sum(-1).reshape(-1) & _LOW32
        cached = _tables[device] = (w.to(torch.int8), _signed32(r), _signed32(c))
    return cached


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bits as a flat int8 tensor (a view when it is contiguous)."""
    flat = tensor.detach().contiguous().reshape(-1)
    return (flat.view(torch.uint8) if flat.dtype == torch.bool else flat).view(torch.int8)


def _large(data: torch.Tensor) -> torch.Tensor:
    """Unreduced fingerprint (0-d int64, right mod 2**32) of one byte tensor."""
    rows, tail = divmod(data.numel(), _BLOCK)
    w, r, _ = _weights(data.device, rows + 1)
    if rows:
        body = data[: rows * _BLOCK].view(rows, _BLOCK)
        if data.device.type == "cpu":
            sums = torch._int_mm(body, w)  # exact int32: |sum| <= 1024 * 128 * 63
        else:  # partial sums are integers below 2**24: exact in float32, even TF32
            sums = (body.to(torch.float32) @ w.to(torch.float32)).to(torch.int32)
        total = (sums * r[:rows]).sum(dtype=torch.int64)  # int32 products wrap mod 2**32
    else:
        total = torch.zeros((), dtype=torch.int64, device=data.device)
    if tail:
        total = total + (data[-tail:, None].to(torch.int64) * w[:tail] * r[rows]).sum()
    return total


def _small(data: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Unreduced fingerprints of several small byte tensors, in a handful of kernels."""
    sizes = tuple(d.numel() for d in data)
    cached = _groups.get((device, sizes))
    if cached is None:
        c = _weights(device, 1)[2]
        bounds = torch.tensor([0, *itertools.accumulate(sizes)], device=device)
        if len(_groups) > 256:  # batches of ever-new shapes must not grow this forever
            _groups.clear()
        cached = _groups[device, sizes] = (torch.cat([c[:n] for n in sizes]), bounds)
    coefficients, bounds = cached
    products = torch.cat(data).to(torch.int32) * coefficients
    # Exact int64 running sums (bounds[0] is the leading 0); differences split the segments.
    running = torch.cat([bounds[:1], products.cumsum(0, dtype=torch.int64)])
    return running[bounds].diff()


def fingerprints(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """int64 tensor on ``device``: one fingerprint in ``[0, 2**32)`` per tensor."""
    if not tensors:
        return torch.zeros(0, dtype=torch.int64, device=device)
    # One CPU thread reads as fast as memory allows and never waits at a barrier for a
    # core busy elsewhere: two threads were 12x slower on a loaded 2-core machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        data = [tensor_bytes(t) for t in tensors]
        small = [i for i, d in enumerate(data) if d.numel() <= _SMALL_BYTES and d.device == device]
        parts: dict[int, torch.Tensor] = {}
        if small:
            parts = dict(zip(small, _small([data[i] for i in small], device).unbind(), strict=True))
        ordered = [parts[i] if i in parts else _large(d).to(device) for i, d in enumerate(data)]
        return torch.stack(ordered) & _LOW32
    finally:
        torch.set_num_threads(threads)


def fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """0-d int64 fingerprint in ``[0, 2**32)`` of the tensor's bits, on its own device."""
    return fingerprints([tensor], tensor.device)[0]
