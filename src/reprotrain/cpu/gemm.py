"""The portable profile's matrix products: one pinned OpenBLAS, in blocks the project fixes.

``mm``, ``addmm``, ``bmm`` and ``baddbmm``, with their ``out=`` overloads (what
``torch.compile``'s CPU code calls: its matrix products are "extern kernels" writing
into buffers it allocates), and the convolutions' GEMMs (
:mod:`reprotrain.cpu.conv`) call one OpenBLAS build from the lock
(``scipy-openblas32``, pinned exactly) with its Haswell kernels forced
(``OPENBLAS_CORETYPE=Haswell``: AVX2 + FMA, fixed blocking) and one OpenBLAS
thread. The product is cut into fixed blocks of
:data:`~reprotrain.cpu.routed.ROW_BLOCK` output rows (one block per matrix of a
batch at least), each computed by one call in one thread; ``threads`` Python
threads share the blocks. So the bits follow neither the host's cores nor
``cpu.threads``: OpenBLAS's own threading splits K-sums by thread count and
silently caps the count at the host's cores (measured,
``../shared/reference/cross-vendor``). The bits do follow each call's shape
(another row block, even another order of the columns, gives other bits), so
callers keep their operands' layout. :mod:`reprotrain.cpu.kernels`
registers these kernels; other dtypes than float32 and float64 go to torch's
own CPU kernel, captured before the override (:data:`_torchs`).
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from reprotrain.cpu.routed import OPENBLAS_VARIABLES, ROW_BLOCK, openblas_library

#: The OpenBLAS core type whose kernels every host runs (needs AVX2 and FMA).
CORETYPE = OPENBLAS_VARIABLES["OPENBLAS_CORETYPE"]
_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112
_INT_MAX = 2**31 - 1
_state: dict[str, Any] = {"library": None, "pool": None, "pool_pid": 0, "threads": 1}
#: torch's own CPU kernels of the routed ops, for what the pinned ones do not take.
_torchs: dict[str, Any] = {}
_load_lock = threading.Lock()


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


def _into(
    out: torch.Tensor,
    result: Callable[[torch.Tensor | None], torch.Tensor],
    shape: tuple[int, ...],
    *inputs: torch.Tensor,
) -> torch.Tensor:
    """An ``out=`` overload: ``result(out)`` straight into ``out`` where it is a contiguous
    float tensor of the product's shape and dtype sharing no memory with an input, else
    computed apart and copied in (resizing ``out`` as torch's ``out=`` does)."""
    direct = (
        tuple(out.shape) == shape
        and out.is_contiguous()
        and _pinned(out, *inputs)
        and not any(
            out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for x in inputs
        )
    )
    if direct:
        result(out)
        return out
    value = result(None)
    if tuple(out.shape) != shape:
        out.resize_(shape)
    return out.copy_(value)


def _mm_out(a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
    if not _pinned(a, b, out):
        return _torchs_kernel("mm.out", a, b, out=out)
    shape = (a.shape[0], b.shape[1])
    return _into(
        out,
        lambda into: _product(a[None], b[None], None, 0.0, 1.0, _batch(into))[0],
        shape,
        a,
        b,
    )


def _addmm_out(
    base: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    beta: float = 1,
    alpha: float = 1,
    out: torch.Tensor,
) -> torch.Tensor:
    if not _pinned(base, a, b, out):
        return _torchs_kernel("addmm.out", base, a, b, beta=beta, alpha=alpha, out=out)
    lifted = base[None] if base.dim() == 2 else base
    return _into(
        out,
        lambda into: _product(a[None], b[None], lifted, beta, alpha, _batch(into))[0],
        (a.shape[0], b.shape[1]),
        base,
        a,
        b,
    )


def _bmm_out(a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
    if not _pinned(a, b, out):
        return _torchs_kernel("bmm.out", a, b, out=out)
    shape = (a.shape[0], a.shape[1], b.shape[2])
    return _into(out, lambda into: _product(a, b, None, 0.0, 1.0, into), shape, a, b)


def _baddbmm_out(
    base: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    beta: float = 1,
    alpha: float = 1,
    out: torch.Tensor,
) -> torch.Tensor:
    if not _pinned(base, a, b, out):
        return _torchs_kernel("baddbmm.out", base, a, b, beta=beta, alpha=alpha, out=out)
    shape = (a.shape[0], a.shape[1], b.shape[2])
    return _into(out, lambda into: _product(a, b, base, beta, alpha, into), shape, base, a, b)


def _batch(matrix: torch.Tensor | None) -> torch.Tensor | None:
    """A 2-D output as the one matrix of a batch (None stays None: a new tensor)."""
    return None if matrix is None else matrix[None]
