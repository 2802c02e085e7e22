"""Two state dicts compared tensor by tensor: bitwise equal, or by how much they differ.

``compare_weights`` reports, per tensor in name order, whether the bits are
equal: the same layout, dtype and shape, and the same bytes, compared as
integers (so ``-0.0`` vs ``0.0`` or another NaN payload is a difference, and
a NaN with the same bits is not). A sparse, quantized or nested tensor is
compared by its parts (:mod:`reprotrain.tensorparts`; a sparse COO tensor
coalesced first), and ``note`` names the parts that differ.

With the bits it gives the largest absolute difference and the relative L2
distance ``||a-b|| / ||a||``, computed in float64 (complex128 for complex
tensors; a position where both hold NaN, or the same infinity, counts as 0),
where they mean something: of two dense tensors; of two sparse tensors'
values, where their indices are equal; of two quantized tensors' dequantized
values; of two nested tensors' components. Where they do not (another
sparsity pattern, a dtype with no float value such as packed float4 or
``bits8``, a meta tensor, which holds no data) they are left out and ``note``
says why. Missing, extra and reshaped tensors and tensors of another layout
are named, not compared. ``weights_table`` renders the list as a fixed-width table.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from reprotrain.fingerprint import tensor_bytes
from reprotrain.tensorparts import is_dense, layout_name, shape_of, tensor_parts

__all__ = ["TensorDiff", "compare_tensors", "compare_weights", "weights_table"]

#: dtypes whose values convert to float64 (or complex128): a difference has a magnitude.
#: By name: the package allows torch >= 2.4, and some (float8_e8m0fnu: 2.7) came later.
_NUMERIC = frozenset(
    getattr(torch, name)
    for name in (
        *("bool", "uint8", "int8", "int16", "uint16", "int32", "uint32", "int64", "uint64"),
        *("float16", "bfloat16", "float32", "float64"),
        *("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"),
        *("float8_e8m0fnu", "complex32", "complex64", "complex128"),
    )
    if hasattr(torch, name)
)
_SPARSE_VALUES = "values"


@dataclass(frozen=True)
class TensorDiff:
    """One tensor of two state dicts; ``status`` is equal, different, missing, extra, shape
    or layout; ``note`` says which parts differ, or why there is no magnitude."""

    name: str
    status: Literal["equal", "different", "missing", "extra", "shape", "layout"]
    max_abs_diff: float | None = None
    rel_l2: float | None = None
    shape_a: tuple[Any, ...] | None = None
    shape_b: tuple[Any, ...] | None = None
    dtype_a: str | None = None
    dtype_b: str | None = None
    layout_a: str | None = None
    layout_b: str | None = None
    note: str = ""

    @property
    def equal(self) -> bool:
        return self.status == "equal"

    def to_text(self) -> str:
        if self.status in ("equal", "different"):
            facts = [self.note] if self.note else []
            if self.dtype_a != self.dtype_b:
                facts.insert(0, f"dtype {self.dtype_a} vs {self.dtype_b}")
            text = f"{self.name}: {self.status}" + (f" ({'; '.join(facts)})" if facts else "")
            if self.max_abs_diff is None or self.rel_l2 is None:
                return text
            return f"{text}, max |a-b| {self.max_abs_diff:.3g}, rel L2 {self.rel_l2:.3g}"
        if self.status == "shape":
            return f"{self.name}: shape {self.shape_a} vs {self.shape_b}"
        if self.status == "layout":
            return f"{self.name}: layout {self.layout_a} vs {self.layout_b}"
        side = "b" if self.status == "missing" else "a"
        return f"{self.name}: {self.status} (not in {side})"


def compare_weights(
    a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]
) -> list[TensorDiff]:
    """Per tensor, in name order: bitwise equality, max abs diff and ||a-b|| / ||a||."""
    out: list[TensorDiff] = []
    for name in sorted(set(a) | set(b)):
        if name not in b:
            out.append(TensorDiff(name, "missing", shape_a=shape_of(a[name])))
        elif name not in a:
            out.append(TensorDiff(name, "extra", shape_b=shape_of(b[name])))
        else:
            out.append(compare_tensors(name, a[name], b[name]))
    return out


def compare_tensors(name: str, a: torch.Tensor, b: torch.Tensor) -> TensorDiff:
    """One tensor of each state dict: its layout, shape, bits and, where it has one, magnitude."""
    ta, tb = _comparable(a), _comparable(b)
    facts = {
        "shape_a": shape_of(ta), "shape_b": shape_of(tb),
        "dtype_a": str(ta.dtype), "dtype_b": str(tb.dtype),
        "layout_a": layout_name(ta), "layout_b": layout_name(tb),
    }  # fmt: skip
    if facts["layout_a"] != facts["layout_b"]:
        return TensorDiff(name, "layout", **facts)
    if facts["shape_a"] != facts["shape_b"]:
        return TensorDiff(name, "shape", **facts)
    parts_a, parts_b = tensor_parts(ta), tensor_parts(tb)
    differing = [
        part for (part, x), (_, y) in zip(parts_a, parts_b, strict=True) if not _same_bits(x, y)
    ]
    if ta.dtype == tb.dtype and not differing:
        return TensorDiff(name, "equal", *_magnitude_of_equal(ta), **facts)
    pair = _numeric_pair(ta, tb, parts_a, parts_b, differing)
    notes = [f"parts differing: {', '.join(differing)}"] if differing and not is_dense(ta) else []
    if isinstance(pair, str):
        return TensorDiff(name, "different", **facts, note="; ".join([*notes, pair]))
    max_abs, rel = _magnitude(*pair)
    if max_abs == 0 and ta.dtype == tb.dtype and is_dense(ta):
        notes.append(_why_no_magnitude(ta.dtype))
    return TensorDiff(name, "different", max_abs, rel, **facts, note="; ".join(notes))


def _same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether two dense tensors have one dtype and shape and the same bytes (NaN == NaN)."""
    if x.dtype != y.dtype or x.shape != y.shape:
        return False
    return torch.equal(tensor_bytes(x), tensor_bytes(y))  # int8: no float semantics


def _magnitude(x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """max |x-y| and ||x-y|| / ||x|| in float64 (complex128); where both are NaN or the
    same infinity the difference is 0, not NaN, and ||x|| leaves out x's NaNs."""
    wide = torch.complex128 if x.is_complex() or y.is_complex() else torch.float64
    xw, yw = x.to(wide), y.to(wide)
    same = (xw == yw) | (xw.isnan() & yw.isnan())
    delta = torch.where(same, torch.zeros((), dtype=wide), xw - yw)
    max_abs = float(delta.abs().max()) if delta.numel() else 0.0
    norm_x = float(torch.linalg.vector_norm(torch.where(xw.isnan(), 0, xw)))
    norm_d = float(torch.linalg.vector_norm(delta))
    rel = norm_d / norm_x if norm_x else (0.0 if norm_d == 0 else float("inf"))
    return max_abs, rel


def _why_no_magnitude(dtype: torch.dtype) -> str:
    """Why two dense tensors of ``dtype`` with other bits can differ by 0."""
    if dtype.is_floating_point or dtype.is_complex:
        return "equal values, other bits: a signed zero or a NaN payload"
    return "values differ below float64's resolution"


def _comparable(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor on the host, in its canonical form: COO coalesced, conjugate and negative
    views resolved (their bits are another tensor's)."""
    tensor = tensor.detach()
    if tensor.is_meta:
        return tensor
    tensor = tensor.cpu()
    if tensor.layout == torch.sparse_coo:
        return tensor.coalesce()
    if is_dense(tensor):
        return tensor.resolve_conj().resolve_neg()
    return tensor


def _magnitude_of_equal(tensor: torch.Tensor) -> tuple[float | None, float | None]:
    """0 and 0 for equal bits, where the tensor has a float value at all."""
    return (0.0, 0.0) if _numeric(tensor) else (None, None)


def _numeric(tensor: torch.Tensor) -> bool:
    return not tensor.is_meta and (tensor.is_quantized or tensor.dtype in _NUMERIC)


def _numeric_pair(
    ta: torch.Tensor,
    tb: torch.Tensor,
    parts_a: list[tuple[str, torch.Tensor]],
    parts_b: list[tuple[str, torch.Tensor]],
    differing: list[str],
) -> tuple[torch.Tensor, torch.Tensor] | str:
    """The two tensors whose difference is the magnitude, or why there is none."""
    if ta.is_meta:
        return "meta tensors hold no data"
    if not (_numeric(ta) and _numeric(tb)):
        return f"no float value for {ta.dtype if not _numeric(ta) else tb.dtype}: no max |a-b|"
    if ta.is_quantized:
        return ta.dequantize(), tb.dequantize()
    if ta.is_nested:
        return _flat_cat(parts_a, ta.dtype), _flat_cat(parts_b, tb.dtype)
    if is_dense(ta):
        return ta, tb
    if [part for part in differing if part != _SPARSE_VALUES]:
        return "another sparsity pattern: no max |a-b|"
    return dict(parts_a)[_SPARSE_VALUES], dict(parts_b)[_SPARSE_VALUES]


def _flat_cat(parts: list[tuple[str, torch.Tensor]], dtype: torch.dtype) -> torch.Tensor:
    """A nested tensor's components, flattened one after another."""
    return torch.cat([torch.zeros(0, dtype=dtype), *(part.reshape(-1) for _, part in parts)])


def weights_table(diffs: list[TensorDiff]) -> str:
    """A fixed-width table: tensor, equal / different / missing..., max |a-b|, relative L2."""
    width = max(len("tensor"), *(len(d.name) for d in diffs))
    lines = [f"  {'tensor':<{width}}  {'status':<9}  {'max |a-b|':>10}  {'rel L2':>10}"]
    for d in diffs:
        numbers = ("", "")
        if d.max_abs_diff is not None and d.rel_l2 is not None:
            numbers = (f"{d.max_abs_diff:.3g}", f"{d.rel_l2:.3g}")
        lines.append(f"  {d.name:<{width}}  {d.status:<9}  {numbers[0]:>10}  {numbers[1]:>10}")
    return "\n".join(lines)
