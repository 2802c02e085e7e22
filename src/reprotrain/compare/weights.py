"""Two state dicts compared tensor by tensor: bitwise equal, or by how much they differ.

``compare_weights`` reports, per tensor in name order, whether the bits are
equal (``torch.equal`` with the same dtype, so ``-0.0`` vs ``0.0`` or another
NaN payload counts as different), the largest absolute difference and the
relative L2 distance ``||a-b|| / ||a||`` computed in float64 (complex128 for
complex tensors); missing, extra and reshaped tensors are named, not compared.
``weights_table`` renders the list as a fixed-width table.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = ["TensorDiff", "compare_weights", "weights_table"]


@dataclass(frozen=True)
class TensorDiff:
    """One tensor of two state dicts; ``status`` is equal, different, missing, extra or shape."""

    name: str
    status: Literal["equal", "different", "missing", "extra", "shape"]
    max_abs_diff: float | None = None
    rel_l2: float | None = None
    shape_a: tuple[int, ...] | None = None
    shape_b: tuple[int, ...] | None = None
    dtype_a: str | None = None
    dtype_b: str | None = None

    @property
    def equal(self) -> bool:
        return self.status == "equal"

    def to_text(self) -> str:
        if self.status in ("equal", "different"):
            return (
                f"{self.name}: {self.status}, max |a-b| {self.max_abs_diff:.3g}, "
                f"rel L2 {self.rel_l2:.3g}"
            )
        if self.status == "shape":
            return f"{self.name}: shape {self.shape_a} vs {self.shape_b}"
        side = "b" if self.status == "missing" else "a"
        return f"{self.name}: {self.status} (not in {side})"


def compare_weights(
    a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]
) -> list[TensorDiff]:
    """Per tensor, in name order: bitwise equality, max abs diff and ||a-b|| / ||a||."""
    out: list[TensorDiff] = []
    for name in sorted(set(a) | set(b)):
        if name not in b:
            out.append(TensorDiff(name, "missing", shape_a=tuple(a[name].shape)))
            continue
        if name not in a:
            out.append(TensorDiff(name, "extra", shape_b=tuple(b[name].shape)))
            continue
        ta, tb = a[name].detach().cpu(), b[name].detach().cpu()
        shapes = {"shape_a": tuple(ta.shape), "shape_b": tuple(tb.shape)}
        dtypes = {"dtype_a": str(ta.dtype), "dtype_b": str(tb.dtype)}
        if ta.shape != tb.shape:
            out.append(TensorDiff(name, "shape", **shapes, **dtypes))
            continue
        wide = torch.complex128 if ta.is_complex() or tb.is_complex() else torch.float64
        delta = ta.to(wide) - tb.to(wide)
        max_abs = float(delta.abs().max()) if delta.numel() else 0.0
        norm_a = float(torch.linalg.vector_norm(ta.to(wide)))
        norm_d = float(torch.linalg.vector_norm(delta))
        rel = norm_d / norm_a if norm_a else (0.0 if norm_d == 0 else float("inf"))
        # torch.equal, not the float diff: -0.0 vs 0.0 or a NaN payload is a bit difference.
        status = "equal" if ta.dtype == tb.dtype and torch.equal(ta, tb) else "different"
        out.append(TensorDiff(name, status, max_abs, rel, **shapes, **dtypes))
    return out


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
