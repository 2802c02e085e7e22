"""Stage prepare: byte-identical output, seeded split, and clear refusals of bad raw data."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from reprotrain.hashing import sha256_file
from reprotrain.pipeline.prepared import load_prepared
from tests.helpers import ROOT, run_cli, run_in_process


def _argv(work: Path, *overrides: str) -> list:
    params = ("--params", ROOT / "params.yaml")
    return ["prepare", *params, *overrides, "--raw-dir", work, "--out", work / "out.safetensors"]


def _prepare(work: Path, *overrides: str):
    """In a fresh process, as DVC runs it."""
    return run_cli(*_argv(work, *overrides), cwd=work)


def _prepare_fast(work: Path, *overrides: str):
    """In this process: for the error paths."""
    return run_in_process(*_argv(work, *overrides))


def test_prepare_is_byte_identical_across_runs(tmp_path: Path, prepared: Path) -> None:
    assert _prepare(tmp_path).returncode == 0
    assert sha256_file(tmp_path / "out.safetensors") == sha256_file(prepared)


def test_digits_split_sizes_and_scaling(prepared: Path) -> None:
    data = load_prepared(prepared)
    sizes = {name: len(data.split(name)[1]) for name in ("train", "val", "test")}
    assert sizes == {"train": 1257, "val": 270, "test": 270}
    assert data.num_classes == 10 and data.input_shape == (1, 8, 8)
    x, _ = data.split("train")
    assert float(x.min()) == 0.0 and float(x.max()) == 1.0


def test_other_seed_gives_another_split(tmp_path: Path, prepared: Path) -> None:
    assert _prepare(tmp_path, "--seed", "1").returncode == 0
    assert sha256_file(tmp_path / "out.safetensors") != sha256_file(prepared)


def _npz(path: Path, **arrays: np.ndarray) -> None:
    np.savez(path, **arrays)


def test_user_npz_is_validated_and_split(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    _npz(tmp_path / "mine.npz", x=rng.random((40, 6, 6)), y=rng.integers(0, 3, 40))
    result = _prepare_fast(tmp_path, "-S", "prepare.source=mine.npz")
    assert result.returncode == 0, result.stderr
    data = load_prepared(tmp_path / "out.safetensors")
    assert data.input_shape == (1, 6, 6) and data.source == "mine.npz"
    assert sum(len(data.split(s)[1]) for s in ("train", "val", "test")) == 40


BAD = {
    "wrong_shape": ({"x": np.zeros((10, 4)), "y": np.zeros(10, int)}, "x has shape (10, 4)"),
    "float_labels": ({"x": np.zeros((10, 4, 4)), "y": np.zeros(10)}, "y has shape (10,) and dtype"),
    "nan": ({"x": np.full((10, 4, 4), np.nan), "y": np.zeros(10, int)}, "NaN or infinite"),
    # finite as float64, infinite as the float32 the pipeline trains on
    "overflow": ({"x": np.full((10, 4, 4), 1e300), "y": np.zeros(10, int)}, "NaN or infinite"),
    "no_channels": ({"x": np.zeros((10, 0, 4, 4)), "y": np.zeros(10, int)}, "(C >= 1"),
    "negative_label": ({"x": np.zeros((10, 4, 4)), "y": -np.ones(10, int)}, "negative labels"),
    "missing_y": ({"x": np.zeros((10, 4, 4))}, "missing array(s) ['y']"),
    "empty_split": ({"x": np.zeros((2, 4, 4)), "y": np.zeros(2, int)}, "give an empty split"),
    "text_x": ({"x": np.array([["a"] * 4] * 10), "y": np.zeros(10, int)}, "x has shape"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_user_data_exit_2_naming_the_file(tmp_path: Path, case: str) -> None:
    arrays, expected = BAD[case]
    _npz(tmp_path / "bad.npz", **arrays)
    result = _prepare_fast(tmp_path, "-S", "prepare.source=bad.npz")
    assert result.returncode == 2
    assert expected in result.stderr and "bad.npz" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out.safetensors").exists()


def test_missing_and_truncated_files_are_refused(tmp_path: Path) -> None:
    missing = _prepare_fast(tmp_path, "-S", "prepare.source=absent.npz")
    assert missing.returncode == 2 and "absent.npz: not found" in missing.stderr
    _npz(tmp_path / "cut.npz", x=np.zeros((10, 4, 4)), y=np.zeros(10, int))
    blob = (tmp_path / "cut.npz").read_bytes()
    (tmp_path / "cut.npz").write_bytes(blob[: len(blob) // 2])
    truncated = _prepare_fast(tmp_path, "-S", "prepare.source=cut.npz")
    assert truncated.returncode == 2 and "not a readable .npz" in truncated.stderr
    assert not (tmp_path / "out.safetensors").exists()


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        ("short_labels", "train: 5 images but 4 labels"),
        ("float_labels", "train: x is (5, 1, 4, 4) torch.float32, y (5,) torch.float32"),
        ("flat_images", "train: x is (5, 16)"),
        ("label_range", "train: labels 0..7 outside 0..2"),
        ("empty_train", "the train split is empty"),
        ("none", ""),  # the control: the same file undamaged loads
    ],
)
def test_a_prepared_file_prepare_would_not_write_is_one_line(
    tmp_path: Path, damage: str, expected: str
) -> None:
    import torch

    from reprotrain.hashing import safetensors_metadata
    from reprotrain.pipeline.errors import DataError

    tensors = {}
    for split in ("train", "val", "test"):
        tensors[f"x_{split}"] = torch.zeros(5, 1, 4, 4)
        tensors[f"y_{split}"] = torch.arange(5) % 3
    if damage == "short_labels":
        tensors["y_train"] = tensors["y_train"][:4]
    elif damage == "float_labels":
        tensors["y_train"] = tensors["y_train"].float()
    elif damage == "flat_images":
        tensors["x_train"] = torch.zeros(5, 16)
    elif damage == "label_range":
        tensors["y_train"] = torch.tensor([0, 1, 2, 7, 1])
    elif damage == "empty_train":
        tensors["x_train"], tensors["y_train"] = torch.zeros(0, 1, 4, 4), torch.zeros(0).long()
    path = tmp_path / "prepared.safetensors"
    from safetensors.torch import save_file

    good = {name: t.contiguous() for name, t in tensors.items()}
    save_file(good, path, metadata=safetensors_metadata({"num_classes": 3, "source": "t"}))
    if damage == "none":
        assert load_prepared(path).num_classes == 3
        return
    with pytest.raises(DataError) as refused:
        load_prepared(path)
    assert expected in str(refused.value) and "\n" not in str(refused.value)
