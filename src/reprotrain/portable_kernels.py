"""Kernels the portable CPU profile chooses, so that the CPU does not choose them.

Under ``cpu.profile: portable`` a training step's kernels must give the same
bits on any x86-64 CPU with AVX2 and FMA, whatever its vendor, model, caches or
core count. ATen's own kernels do at the pinned ISA level (``cpuprofile``);
three families of kernels that torch hands to MKL do not, and :func:`enable`
replaces them on the CPU dispatch key through ``torch.library``:

* **Matrix products** (``mm``, ``addmm``, ``bmm``, ``baddbmm``) and 2-D
  convolutions (``convolution`` and its backward: im2col as one strided copy,
  col2im as one add per kernel offset, around the same GEMM; ATen's own slow
  path calls MKL per sample, through a kernel stub no library can replace):
  one OpenBLAS build from the lock (``scipy-openblas32``, pinned exactly) with
  its Haswell kernels forced (``OPENBLAS_CORETYPE=Haswell``: AVX2 + FMA, fixed
  blocking), called with one OpenBLAS thread. The product is cut into fixed blocks of
  :data:`~reprotrain.cpuprofile.ROW_BLOCK` output rows (one block per matrix
  of a batch at least), each computed by one call in one thread; ``threads``
  Python threads share the blocks. So the bits follow neither the host's cores
  nor ``cpu.threads``: OpenBLAS's own threading splits K-sums by thread count
  and silently caps the count at the host's cores (measured,
  ``../shared/reference/cross-vendor``). MKL's ``COMPATIBLE`` branch gave one
  set of bits on both vendors too, but at SSE2 speed (about 2.5x slower per
  GEMM here).
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
(:data:`~reprotrain.cpuprofile.MKL_VML_OPS`; tests/test_portable_kernels.py).
"""

from __future__ import annotations

import ctypes
import math
import os
import threading
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from reprotrain.cpuprofile import OPENBLAS_VARIABLES, ROUTED, ROW_BLOCK, openblas_library

#: The OpenBLAS core type whose kernels every host runs (needs AVX2 and FMA).
CORETYPE = OPENBLAS_VARIABLES["OPENBLAS_CORETYPE"]
_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112
_INT_MAX = 2**31 - 1
_state: dict[str, Any] = {"library": None, "pool": None, "pool_pid": 0, "threads": 1}
#: torch's own CPU kernels of the routed ops, for what the pinned ones do not take.
_torchs: dict[str, Any] = {}
_load_lock = threading.Lock()
#: Each thread's reused buffers of the convolutions (:func:`_workspace`).
_buffers = threading.local()


class KernelsUnavailable(RuntimeError):
    """The pinned OpenBLAS cannot be loaded: the portable profile cannot run here."""


def _load_blas() -> Any:
    """The pinned OpenBLAS (scipy-openblas32), loaded once with its Haswell kernels forced."""
    with _load_lock:
        if "blas" in _state:
            return _state["blas"]
        try:
            library = openblas_library()
        except FileNotFoundError as err:
            raise KernelsUnavailable(str(err)) from None
        # OpenBLAS reads these once, when it loads; the profile exports them too.
        for name, value in OPENBLAS_VARIABLES.items():
            os.environ[name] = value
        blas = ctypes.CDLL(str(library))  # CDLL: calls release the GIL
        blas.scipy_openblas_get_corename.restype = ctypes.c_char_p
        core = blas.scipy_openblas_get_corename().decode()
        if core.lower() != CORETYPE.lower():
            raise KernelsUnavailable(
                f"OpenBLAS runs its {core} kernels, not {CORETYPE}: OpenBLAS was loaded before "
                "the portable profile set OPENBLAS_CORETYPE, or this CPU lacks AVX2/FMA"
            )
        blas.scipy_openblas_set_num_threads(1)
        c_int, c_ptr = ctypes.c_int, ctypes.c_void_p
        for name, real in (
            ("scipy_cblas_sgemm_batch_strided", ctypes.c_float),
            ("scipy_cblas_dgemm_batch_strided", ctypes.c_double),
        ):
            fn = getattr(blas, name)
            fn.restype = None
            fn.argtypes = [c_int] * 6 + [real, *[c_ptr, c_int, c_int] * 2, real, c_ptr, c_int]
            fn.argtypes += [c_int, c_int]
        _state["blas"] = blas
        return blas


def _operand(x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """``x`` (3-D: matrices) as a row-major BLAS operand: (tensor, transpose flag, leading
    dimension); each matrix is laid out alike, so one flag and dimension hold for all."""
    rows, cols = x.shape[1:]
    if x.stride(2) == 1 and x.stride(1) >= max(1, cols):
        return x, _NO_TRANS, x.stride(1)
    if x.stride(1) == 1 and x.stride(2) >= max(1, rows):
        return x, _TRANS, x.stride(2)
    x = x.contiguous()
    return x, _NO_TRANS, max(1, cols)


def _calls(
    a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, alpha: float, beta: float
) -> list[Callable[[], None]]:
    """The calls making ``c[i] = alpha * a[i] @ b[i] + beta * c[i]`` (3-D, ``c`` contiguous).

    One OpenBLAS strided-batch call per block of ROW_BLOCK output rows and share of the
    matrices (``threads`` shares). Each matrix's block is computed as one GEMM of that
    many rows would compute it, whichever call or share holds it: the bits follow the
    blocks alone (a block of other rows gives other bits: tested).
    """
    blas = _state["blas"]
    fp32 = c.dtype == torch.float32
    gemm = blas.scipy_cblas_sgemm_batch_strided if fp32 else blas.scipy_cblas_dgemm_batch_strided
    a, trans_a, lda = _operand(a)
    b, trans_b, ldb = _operand(b)
    count, m, n, k = c.shape[0], c.shape[1], c.shape[2], a.shape[2]
    size, row = a.element_size(), a.stride(1)  # logical rows, whichever way A is stored
    strides = (a.stride(0), b.stride(0), c.stride(0))
    # BLAS takes 32-bit strides: matrices further apart are called one at a time.
    per_call = -(-count // _state["threads"]) if max(strides) <= _INT_MAX else 1
    stride_a, stride_b, stride_c = strides if per_call > 1 else (0, 0, 0)

    def call(first: int, matrices: int, start: int) -> Callable[[], None]:
        # a, b and c are read when the call runs, so a copied operand lives until then
        rows = min(ROW_BLOCK, m - start)
        return lambda: gemm(
            *(_ROW_MAJOR, trans_a, trans_b, rows, n, k, alpha),
            *(a.data_ptr() + (first * strides[0] + start * row) * size, lda, stride_a),
            *(b.data_ptr() + first * strides[1] * size, ldb, stride_b, beta),
            *(c.data_ptr() + (first * strides[2] + start * n) * size, n, stride_c, matrices),
        )

    return [
        call(first, min(per_call, count - first), start)
        for start in range(0, m, ROW_BLOCK)
        for first in range(0, count, per_call)
    ]


def _pool() -> ThreadPoolExecutor | None:
    """The helper threads of this process (``threads - 1``: the caller computes a share too);
    a forked child (a DataLoader worker) makes its own."""
    threads, pool = _state["threads"], _state["pool"]
    if threads > 1 and (pool is None or _state["pool_pid"] != os.getpid()):
        pool = _state["pool"] = ThreadPoolExecutor(threads - 1, "reprotrain-gemm")
        _state["pool_pid"] = os.getpid()
    return pool if threads > 1 else None


def _serially(calls: Sequence[Callable[[], None]]) -> None:
    for call in calls:
        call()


def _run(calls: Sequence[Callable[[], None]]) -> None:
    """Make every call: ``threads`` contiguous shares, one of them in the calling thread.

    One task per helper thread, not one per block: a task per 128-row block cost
    more in hand-offs than the second core gave (2 threads ran slower than one,
    issue 43). Which thread makes a call never changes its bits.
    """
    pool = _pool()
    if pool is None or len(calls) == 1:
        _serially(calls)
        return
    share = -(-len(calls) // _state["threads"])
    shares = [calls[start : start + share] for start in range(0, len(calls), share)]
    helped = [pool.submit(_serially, part) for part in shares[1:]]
    try:
        _serially(shares[0])
    finally:  # the helpers write into tensors the caller owns: wait for them, even on error
        for future in helped:
            future.result()


def _batched(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, alpha: float, beta: float) -> None:
    """``c[i] = alpha * a[i] @ b[i] + beta * c[i]`` for 3-D operands; ``c`` contiguous."""
    if c.numel() == 0:
        return
    if a.shape[-1] == 0:  # an empty sum: BLAS would not touch C
        c.mul_(beta) if beta != 0 else c.zero_()
        return
    _run(_calls(a, b, c, alpha, beta))


#: The dtypes the pinned kernels (OpenBLAS's GEMM, the CPU's square root) compute in.
FLOATS = frozenset({torch.float32, torch.float64})


def _pinned(*tensors: torch.Tensor | None) -> bool:
    """Whether the pinned GEMM takes these operands: float32 or float64, one dtype."""
    dtypes = {t.dtype for t in tensors if t is not None}
    return len(dtypes) == 1 and dtypes <= FLOATS


def _torchs_kernel(name: str, *args: Any, **kwargs: Any) -> Any:
    """torch's own CPU kernel of ``name``, as registered before :func:`enable`."""
    return _torchs[name].call_boxed(
        torch._C.DispatchKeySet(torch._C.DispatchKey.CPU), *args, **kwargs
    )


def _product(
    a: torch.Tensor,
    b: torch.Tensor,
    base: torch.Tensor | None,
    beta: float,
    alpha: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``beta * base + alpha * a @ b`` for 3-D float ``a`` and ``b``, base broadcast, into
    ``out`` (contiguous, of the product's shape) or a new tensor."""
    shape = (a.shape[0], a.shape[1], b.shape[2])
    out = torch.empty(shape, dtype=a.dtype) if out is None else out
    if base is not None and beta != 0:
        out.copy_(base.expand(shape))
    _batched(a, b, out, alpha, beta if base is not None else 0.0)
    return out


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if not _pinned(a, b):
        return _torchs_kernel("mm", a, b)
    return _product(a[None], b[None], None, 0.0, 1.0)[0]


def _addmm(
    base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: float = 1, alpha: float = 1
) -> torch.Tensor:
    if not _pinned(base, a, b):
        return _torchs_kernel("addmm", base, a, b, beta=beta, alpha=alpha)
    return _product(a[None], b[None], base[None] if base.dim() == 2 else base, beta, alpha)[0]


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if not _pinned(a, b):
        return _torchs_kernel("bmm", a, b)
    return _product(a, b, None, 0.0, 1.0)


def _baddbmm(
    base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: float = 1, alpha: float = 1
) -> torch.Tensor:
    if not _pinned(base, a, b):
        return _torchs_kernel("baddbmm", base, a, b, beta=beta, alpha=alpha)
    return _product(a, b, base, beta, alpha)


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
    the digits recipe's portable step (``benchmarks/digits_floor.py``: the conv
    copies with and without). The largest of each slot stays allocated between calls.
    """
    count = math.prod(shape)
    buffer = getattr(_buffers, slot, None)
    if buffer is None or buffer.dtype != dtype or buffer.numel() < count:
        buffer = torch.empty(count, dtype=dtype)
        setattr(_buffers, slot, buffer)
    return buffer[:count].view(*shape)


def _columns(x: torch.Tensor, weight: torch.Tensor, conv: Sequence[Any]) -> torch.Tensor:
    """im2col of ``x`` (N, C, H, W) as (C*kh*kw, N*Ho*Wo): one strided copy, no arithmetic,
    into this thread's ``columns`` workspace (valid until the next call)."""
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
    columns = _workspace("columns", (c, kh, kw, n, ho, wo), x.dtype)
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
    matrix, cols = weight.reshape(weight.shape[0], -1), _columns(x, weight, conv)
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
        grad_weight = _mm(grad_rows, _columns(x, weight, conv).t()).reshape(weight.shape)
    if mask[2]:
        grad_bias = grad_rows.sum(1)
    return grad_input, grad_weight, grad_bias


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
