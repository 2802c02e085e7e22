"""fingerprint and tensorparts: dense fingerprints pinned; other tensors by their parts."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch

from reprotrain.fingerprint import fingerprints, host_bytes, host_fingerprints, tensor_bytes
from reprotrain.tensorparts import is_dense, layout_name, shape_of, tensor_parts

CPU = torch.device("cpu")


def _dense_cases() -> dict[str, torch.Tensor]:
    base = torch.arange(-600, 600, dtype=torch.float32) / 7
    return {
        "float32": base,
        "float64 transposed": base.double().view(30, 40).t(),
        "bfloat16 strided": base.bfloat16()[::3],
        "int64": torch.arange(-50, 50),
        "bool": torch.arange(100) % 3 == 0,
        "complex64": torch.complex(base, -base),
        "float16 large": torch.arange(600_000, dtype=torch.float16),  # 1.2 MB: the GEMM path
    }


#: What the fingerprint module gave before it read sparse, quantized and nested tensors:
#: committed traces hold such values, so a dense tensor's fingerprint must never change.
PINNED = {
    "float32": 3144941975,
    "float64 transposed": 2845883678,
    "bfloat16 strided": 3886395505,
    "int64": 328328052,
    "bool": 3565313316,
    "complex64": 479018116,
    "float16 large": 1068311758,
}


@pytest.mark.parametrize("case", sorted(PINNED))
def test_dense_fingerprints_keep_their_pinned_values(case: str) -> None:
    tensor = _dense_cases()[case]
    assert host_fingerprints([tensor]) == [PINNED[case]]
    assert fingerprints([tensor], CPU).tolist() == [PINNED[case]]
    flat = tensor.contiguous().reshape(-1).clone()
    assert host_fingerprints([flat]) == [PINNED[case]]  # a view's bits are its elements'
    flat[1] = flat[0] if bool(flat[1] != flat[0]) else flat[2]
    assert host_fingerprints([flat]) != [PINNED[case]]  # the control: one element moves it


def _coo(scale: float) -> torch.Tensor:
    return (torch.eye(4) * scale).to_sparse()


def _quantized(scale: float) -> torch.Tensor:
    return torch.quantize_per_tensor(torch.ones(3) * scale, 0.1, 0, torch.qint8)


def _per_channel(scale: float) -> torch.Tensor:
    scales, zero_points = torch.tensor([0.1, 0.2], dtype=torch.float64), torch.tensor([0, 1])
    values = torch.ones(2, 3) * scale
    return torch.quantize_per_channel(values, scales, zero_points, 0, torch.quint8)


def _nested(scale: float) -> torch.Tensor:
    return torch.nested.nested_tensor([torch.ones(2), torch.ones(3) * scale])


def _jagged(scale: float) -> torch.Tensor:
    parts = [torch.ones(2, 4), torch.ones(3, 4) * scale]
    return torch.nested.nested_tensor(parts, layout=torch.jagged)


def _compressed(layout: str) -> Callable[[float], torch.Tensor]:
    """A diagonal 4 x 4 made sparse by ``to_<layout>`` (blocks of 2 x 2 for BSR and BSC)."""
    blocks = ((2, 2),) if layout.endswith(("bsr", "bsc")) else ()
    return lambda scale: getattr(torch.eye(4) * scale, f"to_{layout}")(*blocks)


_ROWS = ["crow_indices", "col_indices", "values"]  # CSR and BSR
_COLUMNS = ["ccol_indices", "row_indices", "values"]  # CSC and BSC
#: kind -> (a tensor of it with one value scaled, its parts' names)
OTHER_KINDS: dict[str, tuple[Callable[[float], torch.Tensor], list[str]]] = {
    "sparse_coo": (_coo, ["indices", "values"]),
    "sparse_csr": (_compressed("sparse_csr"), _ROWS),
    "sparse_csc": (_compressed("sparse_csc"), _COLUMNS),
    "sparse_bsr": (_compressed("sparse_bsr"), _ROWS),
    "sparse_bsc": (_compressed("sparse_bsc"), _COLUMNS),
    "quantized per_tensor_affine": (_quantized, ["int_repr", "scale", "zero_point"]),
    "quantized per_channel_affine": (_per_channel, ["int_repr", "scales", "zero_points", "axis"]),
    "nested": (_nested, ["0", "1"]),
    "nested jagged": (_jagged, ["0", "1"]),
}


def _made(kind: str, scale: float) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's beta / prototype / deprecation notes
        return OTHER_KINDS[kind][0](scale)


@pytest.mark.parametrize("kind", sorted(OTHER_KINDS))
def test_sparse_quantized_and_nested_tensors_have_named_dense_parts(kind: str) -> None:
    tensor = _made(kind, 2.0)
    assert not is_dense(tensor) and layout_name(tensor) == kind
    parts = tensor_parts(tensor)
    assert [name for name, _ in parts] == OTHER_KINDS[kind][1]
    assert all(is_dense(part) for _, part in parts)
    assert tensor_parts(torch.ones(2))[0][0] == "" and is_dense(torch.ones(2))


@pytest.mark.parametrize("kind", sorted(OTHER_KINDS))
def test_other_tensors_are_fingerprinted_from_their_parts(kind: str) -> None:
    """The same value, made twice, gives one fingerprint on every path; one value changed
    gives another (the control)."""
    a, b, changed = _made(kind, 2.0), _made(kind, 2.0), _made(kind, 3.0)
    value = host_fingerprints([a])
    assert host_fingerprints([b]) == value == fingerprints([b], CPU).tolist()
    assert host_fingerprints([changed]) != value
    assert host_bytes(a) == tensor_bytes(b).numpy().tobytes() != host_bytes(changed)


def test_the_header_covers_the_shape_and_the_parts_layout() -> None:
    """Parts with the same bytes in another arrangement are another tensor."""
    index, one = torch.tensor([[0], [0]]), torch.tensor([1.0])
    small = torch.sparse_coo_tensor(index, one, (2, 2), check_invariants=True)
    large = torch.sparse_coo_tensor(index, one, (3, 3), check_invariants=True)
    assert host_fingerprints([small]) != host_fingerprints([large])
    assert tensor_bytes(small).numpy().tobytes().startswith(b"sparse_coo torch.float32 (2, 2)\n")


def test_a_sparse_tensor_over_a_mebibyte_is_fingerprinted_as_a_small_one() -> None:
    diagonal = torch.arange(100_000).repeat(2, 1)
    big = torch.sparse_coo_tensor(
        diagonal, torch.ones(100_000), (100_000, 100_000), check_invariants=True
    )
    assert tensor_bytes(big).numel() > 1 << 20
    value = host_fingerprints([big])
    assert value == fingerprints([big], CPU).tolist()
    changed = big.coalesce()
    changed.values()[-1] = 2.0
    assert host_fingerprints([changed]) != value


def test_shape_of_a_nested_tensor_is_its_components_shapes() -> None:
    assert shape_of(_made("nested jagged", 1.0)) == ((2, 4), (3, 4))
    assert shape_of(_made("sparse_coo", 1.0)) == (4, 4) == shape_of(torch.ones(4, 4))


def test_a_meta_tensor_has_no_parts_and_an_unknown_layout_is_refused() -> None:
    assert tensor_parts(torch.empty(3, device="meta")) == []
    assert host_fingerprints([torch.empty(3, device="meta")]) != host_fingerprints(
        [torch.empty(4, device="meta")]
    )
    with pytest.raises(ValueError, match=r"layout torch\._mkldnn has no known parts"):
        tensor_parts(torch.ones(2).to_mkldnn())


def test_a_quantized_tensors_fingerprint_covers_its_scale_and_zero_point() -> None:
    """One int_repr under another scale or zero point is another value: another fingerprint."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized dtypes are deprecated
        tenth = torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8)
        fifth = torch.quantize_per_tensor(torch.full((3,), 2.0), 0.2, 0, torch.qint8)
        shifted = torch.quantize_per_tensor(torch.full((3,), 1.1), 0.1, -1, torch.qint8)
    assert torch.equal(tenth.int_repr(), fifth.int_repr())
    assert torch.equal(tenth.int_repr(), shifted.int_repr())
    values = [host_fingerprints([t])[0] for t in (tenth, fifth, shifted)]
    assert len(set(values)) == 3
