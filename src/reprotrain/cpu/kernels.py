"""Kernels the portable CPU profile chooses, so that the CPU does not choose them.

Under ``cpu.profile: portable`` a training step's kernels must give the same
bits on any x86-64 CPU with AVX2 and FMA, whatever its vendor, model, caches or
core count. ATen's own kernels do at the pinned ISA level (``cpu.profile``);
three families of kernels that torch hands to MKL do not, and :func:`enable`
replaces them on the CPU dispatch key through ``torch.library``:

* **Matrix products** (``mm``, ``addmm``, ``bmm``, ``baddbmm`` and their ``out=``
  overloads, which ``torch.compile``'s CPU code calls,
  :mod:`reprotrain.cpu.gemm`) and 2-D convolutions (``convolution`` and
  its backward, im2col around the same GEMM: :mod:`reprotrain.cpu.conv`):
  one OpenBLAS build from the lock with its Haswell kernels forced, in fixed
  blocks of output rows, so the bits follow neither the host's cores nor
  ``cpu.threads``. MKL's ``COMPATIBLE`` branch gave one set of bits on both
  vendors too, but at SSE2 speed (about 2.5x slower per GEMM here).
* **``bernoulli_(p: float)``** (dropout's mask): torch samples it with MKL's
  VSL generator on Intel CPUs only (a ``cpuinfo`` vendor test in ATen's
  ``DistributionKernels.cpp``) and with ATen's own generator elsewhere, so the
  same seed draws other masks on the two vendors. The override always takes
  ATen's generator path (the probability passed as a float64 tensor, which
  draws the same stream as ATen's scalar path: tested), on every vendor.
* **``sqrt``** (Adam's update): ATen hands it to MKL's vector math (VML), whose
  results are not exact-rounded and differ between an Intel and an AMD CPU (the
  one op that split the vendors' training: docs/cpu-profile.md). The override
  computes it with NumPy's ufunc, that is the CPU's square-root instruction,
  exact-rounded by IEEE 754 on every x86-64.

Other dtypes than float32 and float64, and other convolutions (1-D, 3-D,
grouped, transposed), go to torch's own CPU kernel, captured before the
override. What is not routed (``mv``/``addmv``, linear algebra, MKL's other VML
functions) is listed in docs/cpu-profile.md; a training step that reaches
MKL's BLAS shows up in ``MKL_VERBOSE``, one that reaches VML by the op's name
(:data:`~reprotrain.cpu.routed.MKL_VML_OPS`; tests/test_portable_kernels.py).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from reprotrain.cpu import conv
from reprotrain.cpu.conv import _convolution, _convolution_backward
from reprotrain.cpu.gemm import (
    FLOATS,
    KernelsUnavailable,
    _addmm,
    _addmm_out,
    _baddbmm,
    _baddbmm_out,
    _bmm,
    _bmm_out,
    _load_blas,
    _mm,
    _mm_out,
    _state,
    _torchs,
    _torchs_kernel,
)
from reprotrain.cpu.routed import ROUTED

__all__ = ["KernelsUnavailable", "disable", "enable"]


def _bernoulli(
    x: torch.Tensor, p: float = 0.5, *, generator: torch.Generator | None = None
) -> torch.Tensor:
    # One float64 probability: ATen's tensor path expands it to x itself (same stream as a
    # full tensor of it, without writing 8 bytes per element: megabytes for attention's)
    return x.bernoulli_(torch.tensor(p, dtype=torch.float64), generator=generator)


def _ieee_sqrt(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = sqrt(x)`` rounded as IEEE 754 requires, through NumPy's ufunc: the
    CPU's own square-root instruction, whose result is exact-rounded on every x86-64."""
    with np.errstate(invalid="ignore"):  # a negative gives NaN, as torch's does
        np.sqrt(x.detach().numpy(), out=out.detach().numpy())
    return out


def _root_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The float dtype torch computes ``sqrt(x)`` in, where the routed kernel takes it:
    ``x``'s own (float32, float64), or the default one for integers and bools (as torch
    promotes them); None for half, bfloat16 and complex (no MKL there: torch's kernel)."""
    dtype = x.dtype if x.is_floating_point() or x.is_complex() else torch.get_default_dtype()
    return dtype if dtype in FLOATS else None


def _writes_safely(out: torch.Tensor, x: torch.Tensor) -> bool:
    """No element of ``out`` is written twice, and ``out`` shares no memory with ``x``
    unless it is ``x`` itself: else torch's kernel, which raises as it does natively."""
    if torch._debug_has_internal_overlap(out) == 1:
        return False
    if out.untyped_storage().data_ptr() != x.untyped_storage().data_ptr():
        return True
    same = (out.data_ptr(), out.shape, out.stride()) == (x.data_ptr(), x.shape, x.stride())
    return same and out.dtype == x.dtype


def _sqrt(x: torch.Tensor) -> torch.Tensor:
    dtype = _root_dtype(x)
    if dtype is None:
        return _torchs_kernel("sqrt", x)
    x = x.to(dtype)  # integers: torch promotes them so
    return _ieee_sqrt(x, torch.empty_like(x))


def _sqrt_(x: torch.Tensor) -> torch.Tensor:
    if _root_dtype(x) != x.dtype or not _writes_safely(x, x):
        return _torchs_kernel("sqrt_", x)
    return _ieee_sqrt(x, x)


def _sqrt_out(x: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
    dtype = _root_dtype(x)
    if dtype is None or out.dtype not in FLOATS or not _writes_safely(out, x):
        return _torchs_kernel("sqrt.out", x, out=out)  # it raises where torch's raises
    if out.shape != x.shape:
        if out.numel():  # as torch's out= warns
            warnings.warn(
                f"An output with one or more elements was resized since it had shape "
                f"{list(out.shape)}, which does not match the required output shape "
                f"{list(x.shape)}. This behavior is deprecated.",
                UserWarning,
                stacklevel=2,
            )
        out.resize_(x.shape)
    if out.dtype != dtype:  # computed in the input's dtype, then cast, as torch does
        return out.copy_(_sqrt(x))
    return _ieee_sqrt(x.to(dtype), out)


_KERNELS: dict[str, Callable[..., Any]] = {
    "mm": _mm,
    "addmm": _addmm,
    "bmm": _bmm,
    "baddbmm": _baddbmm,
    "mm.out": _mm_out,
    "addmm.out": _addmm_out,
    "bmm.out": _bmm_out,
    "baddbmm.out": _baddbmm_out,
    "convolution": _convolution,
    "convolution_backward": _convolution_backward,
    "bernoulli_.float": _bernoulli,
    "sqrt": _sqrt,
    "sqrt_": _sqrt_,
    "sqrt.out": _sqrt_out,
}


def enable(threads: int = 1) -> None:
    """Route :data:`ROUTED` to the pinned kernels in this process, ``threads`` sharing the blocks.

    Raises :class:`KernelsUnavailable` when the pinned OpenBLAS cannot load.
    Idempotent; :func:`disable` restores torch's own kernels.
    """
    _load_blas()
    if _state["library"] is None:
        for name in ROUTED:  # torch's kernels, before ours replace them
            _torchs[name] = torch._C._dispatch_get_computed_kernel_for_dispatch_key(
                f"aten::{name}", torch._C.DispatchKey.CPU
            )
        library = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():  # torch warns on every replaced kernel; that is the point
            warnings.simplefilter("ignore", UserWarning)
            for name in ROUTED:
                library.impl(name, _KERNELS[name], "CPU")
        _state["library"] = library
    if threads != _state["threads"]:
        if _state["pool"] is not None and _state["pool_pid"] == os.getpid():
            _state["pool"].shutdown()
        _state.update(pool=None, threads=threads)


def disable() -> None:
    """Give the routed ops back to torch's own kernels (a no-op when they are not routed)."""
    if _state["library"] is not None:
        _state["library"]._destroy()
        _state["library"] = None
    conv.forget()
