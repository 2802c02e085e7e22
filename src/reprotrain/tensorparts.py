"""The dense tensors a sparse, quantized or nested tensor keeps its value in.

A dense tensor (strided, not quantized, not nested) holds its value in its
elements, and its bits are its elements' bytes. Every other kind of tensor
``torch.save`` can hold keeps its value in parts, each a dense tensor
(:func:`tensor_parts`), so its bits are its parts' bits:

* sparse COO: ``indices`` and ``values``, as stored (an uncoalesced tensor's
  order and duplicates are how it was built: ``coalesce()`` it first for the
  canonical form);
* sparse CSR, CSC, BSR, BSC: the compressed indices (``crow_indices`` or
  ``ccol_indices``), the plain ones (``col_indices`` or ``row_indices``) and
  ``values``;
* quantized: ``int_repr`` and the quantization parameters as tensors
  (``scale`` float64, ``zero_point`` int64; per channel ``scales``,
  ``zero_points`` and ``axis``);
* nested: each component, named ``0``, ``1``, ...;
* meta: none (it holds no data).

:func:`layout_name` names the kind (a quantized tensor's with its scheme) and
:func:`shape_of` gives a shape every kind has (a nested tensor's is its
components' shapes). Two coalesced tensors of one layout, dtype and shape hold
the same value exactly when their parts hold the same bits.
:mod:`reprotrain.fingerprint` hashes the parts, :mod:`reprotrain.compare.weights`
compares them.
"""

from __future__ import annotations

import torch

__all__ = ["is_dense", "layout_name", "shape_of", "tensor_parts"]

#: A compressed sparse layout's index parts: compressed, then plain.
_COMPRESSED_INDICES = {
    torch.sparse_csr: ("crow_indices", "col_indices"),
    torch.sparse_bsr: ("crow_indices", "col_indices"),
    torch.sparse_csc: ("ccol_indices", "row_indices"),
    torch.sparse_bsc: ("ccol_indices", "row_indices"),
}
_PER_TENSOR = (torch.per_tensor_affine, torch.per_tensor_symmetric)


def is_dense(tensor: torch.Tensor) -> bool:
    """Whether the tensor's elements are its value: strided, not quantized, not nested, not meta."""
    return (
        tensor.layout == torch.strided
        and not tensor.is_quantized
        and not tensor.is_nested
        and not tensor.is_meta
    )


def layout_name(tensor: torch.Tensor) -> str:
    """``strided``, ``sparse_coo``, ``sparse_csr``..., ``quantized per_tensor_affine``,
    ``nested``, ``nested jagged`` or ``meta``."""
    if tensor.is_meta:
        return "meta"
    if tensor.is_nested:
        return "nested" if tensor.layout == torch.strided else "nested jagged"
    if tensor.is_quantized:
        return f"quantized {str(tensor.qscheme()).removeprefix('torch.')}"
    return str(tensor.layout).removeprefix("torch.")


def shape_of(tensor: torch.Tensor) -> tuple[int, ...] | tuple[tuple[int, ...], ...]:
    """The tensor's shape; a nested tensor's, the shape of each component."""
    if tensor.is_nested:
        return tuple(tuple(part.shape) for part in tensor.unbind())
    return tuple(tensor.shape)


def tensor_parts(tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The named dense tensors that hold a tensor's value; ``[("", tensor)]`` for a dense one."""
    tensor = tensor.detach()
    if tensor.is_meta:
        return []
    if tensor.is_nested:
        return [(str(index), part) for index, part in enumerate(tensor.unbind())]
    if tensor.is_quantized:
        return _quantized_parts(tensor)
    if tensor.layout == torch.sparse_coo:
        # _indices/_values: the stored parts, which indices() refuses for an uncoalesced tensor
        return [("indices", tensor._indices()), ("values", tensor._values())]
    if tensor.layout in _COMPRESSED_INDICES:
        names = _COMPRESSED_INDICES[tensor.layout]
        return [*((name, getattr(tensor, name)()) for name in names), ("values", tensor.values())]
    if not is_dense(tensor):
        raise ValueError(f"a tensor of layout {tensor.layout} has no known parts to read bits from")
    return [("", tensor)]


def _quantized_parts(tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """``int_repr`` and the quantization parameters, each as a tensor."""
    parts = [("int_repr", tensor.int_repr())]
    if tensor.qscheme() in _PER_TENSOR:
        scale = torch.tensor(tensor.q_scale(), dtype=torch.float64)
        return [*parts, ("scale", scale), ("zero_point", torch.tensor(tensor.q_zero_point()))]
    axis = torch.tensor(tensor.q_per_channel_axis())
    return [
        *parts,
        ("scales", tensor.q_per_channel_scales()),
        ("zero_points", tensor.q_per_channel_zero_points()),
        ("axis", axis),
    ]
