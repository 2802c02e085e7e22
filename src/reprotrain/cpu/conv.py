"""The portable profile's 2-D convolutions: im2col around the pinned GEMM.

``convolution`` and its backward (2-D, not transposed, one group, float32 or
float64) as im2col (one strided copy), the pinned GEMM of
:mod:`reprotrain.cpu.gemm`, and col2im (one add per kernel offset: the
same rounding on every CPU). ATen's own slow path calls MKL per sample, through
a kernel stub no library can replace. Other convolutions go to torch's own
kernel.

Two things keep the copies cheap, neither changing a bit. Each thread reuses its
buffers from call to call (:func:`_workspace`). And a forward that autograd will
differentiate keeps its column matrix (:func:`_forward_columns`) for the weight
gradient of its backward (:func:`_backward_columns`), which would otherwise
copy the same columns again: the input's memory is held while kept (not the
tensor, whose autograd graph would be held with it), so it cannot be handed to
another tensor, and a kept matrix is used only for the same input
at the same version (an in-place change since the forward bumps the version, as
autograd's own check of saved tensors does). At most :data:`KEEP_BYTES` are
kept per thread, the oldest dropped first; a forward whose backward never comes
(a prediction made with gradients on) is dropped so.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from reprotrain.cpu.gemm import _mm, _pinned, _product, _torchs_kernel

#: Each thread's reused buffers (:func:`_workspace`) and kept columns (:func:`_forward_columns`).
_buffers = threading.local()
#: At most this many bytes of kept columns (and the inputs they hold alive) per thread.
KEEP_BYTES = 64 * 2**20


def _plain_2d(x: torch.Tensor, weight: torch.Tensor, transposed: bool, groups: int) -> bool:
    """A convolution the im2col path here takes: 2-D, not transposed, one group, float."""
    return x.dim() == 4 and not transposed and groups == 1 and _pinned(x, weight)


def _geometry(x: torch.Tensor, weight: torch.Tensor, conv: Sequence[Any]) -> list[tuple[int, ...]]:
    """Per spatial dim: (kernel, stride, padding, dilation, output size)."""
    stride, padding, dilation = conv[:3]
    dims = []
    for d in (0, 1):
        k, s, p, dil = weight.shape[2 + d], stride[d], padding[d], dilation[d]
        dims.append((k, s, p, dil, (x.shape[2 + d] + 2 * p - dil * (k - 1) - 1) // s + 1))
    return dims


def _workspace(slot: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A buffer of this thread for ``slot``, reused from call to call, uninitialised.

    A convolution's column matrices are megabytes that live for one call; new ones
    each step cost the page faults of fresh memory, which took about a quarter of
    the digits recipe's portable step (``benchmarks/cpu/digits_floor.py``: the conv
    copies with and without). The largest of each slot stays allocated between calls.
    """
    count = math.prod(shape)
    buffer = getattr(_buffers, slot, None)
    if buffer is None or buffer.dtype != dtype or buffer.numel() < count:
        buffer = torch.empty(count, dtype=dtype)
        setattr(_buffers, slot, buffer)
    return buffer[:count].view(*shape)


def _columns(
    x: torch.Tensor, weight: torch.Tensor, conv: Sequence[Any], out: torch.Tensor | None = None
) -> torch.Tensor:
    """im2col of ``x`` (N, C, H, W) as (C*kh*kw, N*Ho*Wo): one strided copy, no arithmetic,
    into ``out`` or else this thread's ``columns`` workspace (valid until the next call)."""
    (kh, sh, ph, dh, ho), (kw, sw, pw, dw, wo) = _geometry(x, weight, conv)
    n, c, height, width = x.shape
    hp, wp = height + 2 * ph, width + 2 * pw
    padded = _workspace("padded", (n, c, hp, wp), x.dtype)
    if ph or pw:
        padded.zero_()
    padded[:, :, ph : ph + height, pw : pw + width] = x
    view = padded.as_strided(
        (c, kh, kw, n, ho, wo),
        (hp * wp, dh * wp, dw, c * hp * wp, sh * wp, sw),
    )
    shape = (c, kh, kw, n, ho, wo)
    columns = _workspace("columns", shape, x.dtype) if out is None else out.view(shape)
    columns.copy_(view)
    return columns.view(c * kh * kw, n * ho * wo)


def _image(
    cols: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, conv: Sequence[Any]
) -> torch.Tensor:
    """col2im: the (C*kh*kw, N*Ho*Wo) gradient of the columns added back into (N, C, H, W),
    one kernel offset after another (each an elementwise add: the same rounding anywhere)."""
    (kh, sh, ph, dh, ho), (kw, sw, pw, dw, wo) = _geometry(x, weight, conv)
    n, c, height, width = x.shape
    padded = _workspace("padded", (n, c, height + 2 * ph, width + 2 * pw), cols.dtype).zero_()
    parts = cols.view(c, kh, kw, n, ho, wo)
    for i in range(kh):
        for j in range(kw):
            rows = slice(i * dh, i * dh + sh * (ho - 1) + 1, sh)
            columns = slice(j * dw, j * dw + sw * (wo - 1) + 1, sw)
            padded[:, :, rows, columns] += parts[:, i, j].transpose(0, 1)
    # clone, not contiguous(): without padding the slice is the whole workspace
    return padded[:, :, ph : ph + height, pw : pw + width].clone(
        memory_format=torch.contiguous_format
    )


@dataclass(eq=False)
class _Kept:
    """A forward's column matrix, kept for its backward's weight gradient."""

    key: tuple[Any, ...]
    #: The input's memory, held (not the tensor: that would hold its autograd graph too):
    #: while kept, no other tensor can be given its address.
    memory: torch.UntypedStorage
    version: int
    columns: torch.Tensor
    buffer: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size() + self.memory.nbytes()


def _thread_list(name: str) -> list[Any]:
    if not hasattr(_buffers, name):
        setattr(_buffers, name, [])
    return getattr(_buffers, name)


def _key(x: torch.Tensor, weight: torch.Tensor, conv: Sequence[Any]) -> tuple[Any, ...]:
    stride, padding, dilation = conv[:3]
    where = (x.data_ptr(), x.shape, x.stride(), x.dtype)
    return (*where, weight.shape, tuple(stride), tuple(padding), tuple(dilation))


def _room_for(size: int) -> None:
    """Drop spare buffers, then the oldest kept columns, until ``size`` more bytes fit."""
    kept, spare = _thread_list("kept"), _thread_list("spare")
    used = sum(k.nbytes for k in kept) + sum(b.numel() * b.element_size() for b in spare)
    while used + size > KEEP_BYTES and (spare or kept):
        if spare:
            dropped = spare.pop()
            used -= dropped.numel() * dropped.element_size()
        else:
            used -= kept.pop(0).nbytes


def _spare_buffer(count: int, dtype: torch.dtype) -> torch.Tensor:
    """The smallest spare buffer that holds ``count`` elements (reused: no fresh pages), or a
    new one."""
    spare = _thread_list("spare")
    fits = [i for i, b in enumerate(spare) if b.dtype == dtype and b.numel() >= count]
    if fits:
        return spare.pop(min(fits, key=lambda i: spare[i].numel()))
    return torch.empty(count, dtype=dtype)


def _forward_columns(x: torch.Tensor, weight: torch.Tensor, conv: Sequence[Any]) -> torch.Tensor:
    """The forward's columns; kept for the backward when the weight's gradient will be taken."""
    if not (torch.is_grad_enabled() and weight.requires_grad):
        return _columns(x, weight, conv)
    (kh, *_, ho), (kw, *_, wo) = _geometry(x, weight, conv)
    count = x.shape[1] * kh * kw * x.shape[0] * ho * wo
    memory = x.untyped_storage()
    if count * x.element_size() + memory.nbytes() > KEEP_BYTES:
        return _columns(x, weight, conv)
    buffer = _spare_buffer(count, x.dtype)
    columns = _columns(x, weight, conv, buffer[:count])
    kept = _Kept(_key(x, weight, conv), memory, x._version, columns, buffer)
    _room_for(kept.nbytes)
    _thread_list("kept").append(kept)
    return columns


def _backward_columns(x: torch.Tensor, weight: torch.Tensor, conv: Sequence[Any]) -> torch.Tensor:
    """The columns of ``x`` for a weight gradient: the forward's, when kept for this very input
    at this version (their buffer is then spare again: use them before the next convolution),
    or copied anew."""
    kept, key = _thread_list("kept"), _key(x, weight, conv)
    for i in range(len(kept) - 1, -1, -1):  # the latest forward's backward comes first
        if kept[i].key == key and kept[i].version == x._version:
            found = kept.pop(i)
            _thread_list("spare").append(found.buffer)
            return found.columns
    return _columns(x, weight, conv)


def forget() -> None:
    """Free this thread's kept columns and spare buffers."""
    _thread_list("kept").clear()
    _thread_list("spare").clear()


def _convolution(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *conv: Any,
) -> torch.Tensor:
    transposed, groups = conv[3], conv[5]  # conv: stride, padding, dilation, transposed, _, groups
    if not _plain_2d(x, weight, transposed, groups):
        return _torchs_kernel("convolution", x, weight, bias, *conv)
    (*_, ho), (*_, wo) = _geometry(x, weight, conv)
    matrix, cols = weight.reshape(weight.shape[0], -1), _forward_columns(x, weight, conv)
    rows = _workspace("rows", (1, matrix.shape[0], cols.shape[1]), x.dtype)
    base = None if bias is None else bias[None, :, None]  # no base: _product's beta is 0
    _product(matrix[None], cols[None], base, 1.0, 1.0, rows)
    # clone, not contiguous(): with one image the view is contiguous, and the workspace's
    out = rows.view(weight.shape[0], x.shape[0], ho, wo).transpose(0, 1)
    return out.clone(memory_format=torch.contiguous_format)


def _convolution_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias_sizes: Sequence[int] | None,
    *conv: Any,
) -> tuple[torch.Tensor | None, ...]:
    transposed, groups, mask = conv[3], conv[5], conv[6]  # as convolution's, then output_mask
    if not _plain_2d(x, weight, transposed, groups) or not _pinned(grad, x):
        return _torchs_kernel("convolution_backward", grad, x, weight, bias_sizes, *conv)
    grad_rows = grad.transpose(0, 1).reshape(weight.shape[0], -1)  # (O, N*Ho*Wo)
    grad_input = grad_weight = grad_bias = None
    if mask[0]:
        matrix = weight.reshape(weight.shape[0], -1).t()
        cols = _workspace("columns", (1, matrix.shape[0], grad_rows.shape[1]), grad.dtype)
        _product(matrix[None], grad_rows[None], None, 0.0, 1.0, cols)  # (C*kh*kw, N*Ho*Wo)
        grad_input = _image(cols[0], x, weight, conv)
    if mask[1]:
        cols = _backward_columns(x, weight, conv)
        grad_weight = _mm(grad_rows, cols.t()).reshape(weight.shape)
    if mask[2]:
        grad_bias = grad_rows.sum(1)
    return grad_input, grad_weight, grad_bias
