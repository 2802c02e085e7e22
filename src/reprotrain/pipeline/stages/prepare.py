"""Stage ``prepare``: raw data -> one prepared, split safetensors file.

The default source is scikit-learn's bundled handwritten digits (1,797 8x8
images installed with the package, so no network). ``data.source`` may
instead name a user's ``.npz`` file (arrays ``x``: N x H x W or N x C x H x W,
real-valued and already scaled; ``y``: N integer labels from 0) inside the
raw-data folder that ``dvc.yaml`` passes in; track it with ``dvc add``.
The split is a seeded permutation, so the output bytes depend only on the
raw data, ``seed`` and the two fractions.
"""

from __future__ import annotations

import argparse
import zipfile
from pathlib import Path

import numpy as np
import torch

from reprotrain.pipeline.config import DataConfig, Params
from reprotrain.pipeline.data import SPLITS, PreparedData, save_prepared
from reprotrain.pipeline.errors import DataError

#: The params.yaml keys this stage reads; dvc.yaml lists exactly these.
PARAMS = ("seed", "data.source", "data.val_fraction", "data.test_fraction")
BUILTIN_SOURCE = "digits"


def run(params: Params, args: argparse.Namespace) -> str:
    x, y, source = load_raw(params.data.source, args.raw_dir)
    prepared = split(x, y, params.data, params.seed, source)
    save_prepared(args.out, prepared)
    sizes = ", ".join(f"{s} {len(prepared.split(s)[1])}" for s in SPLITS)
    return f"prepared {source}: {sizes} -> {args.out}"


def load_raw(source: str, raw_dir: Path) -> tuple[np.ndarray, np.ndarray, str]:
    """Images as float32 N x C x H x W and labels as int64, checked."""
    if source == BUILTIN_SOURCE:
        from sklearn.datasets import load_digits

        digits = load_digits()
        return (digits.images[:, None] / 16.0).astype(np.float32), digits.target, BUILTIN_SOURCE
    path = raw_dir / source
    if path.suffix != ".npz":
        raise DataError(f"data.source: {source!r} is neither 'digits' nor an .npz file name")
    if not path.is_file():
        raise DataError(f"{path}: not found; put the file there and `dvc add` it")
    return (*_read_npz(path), source)


def _read_npz(path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {name: archive[name] for name in archive.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
        raise DataError(f"{path}: not a readable .npz file ({err}); re-export it") from None
    missing = {"x", "y"} - set(arrays)
    if missing:
        raise DataError(f"{path}: missing array(s) {sorted(missing)}; expected 'x' and 'y'")
    x, y = arrays["x"], arrays["y"]
    if x.ndim == 3:
        x = x[:, None]
    if x.ndim != 4 or min(x.shape[2:]) < 2:
        raise DataError(f"{path}: x has shape {x.shape}; expected N x H x W or N x C x H x W")
    if x.dtype.kind not in "fiu":
        raise DataError(f"{path}: x has dtype {x.dtype}; expected a real number type")
    if y.ndim != 1 or y.dtype.kind not in "iu" or len(y) != len(x):
        raise DataError(
            f"{path}: y has shape {y.shape} and dtype {y.dtype}; expected {len(x)} integer labels"
        )
    if not np.isfinite(x).all():
        raise DataError(f"{path}: x contains NaN or infinite values; clean the data")
    if len(y) and y.min() < 0:
        raise DataError(f"{path}: y has negative labels (min {y.min()}); labels start at 0")
    return x.astype(np.float32), y.astype(np.int64)


def split(x: np.ndarray, y: np.ndarray, data: DataConfig, seed: int, source: str) -> PreparedData:
    """Seeded train / val / test split; every split must be non-empty."""
    n = len(y)
    n_test = round(n * data.test_fraction)
    n_val = round(n * data.val_fraction)
    if min(n_test, n_val, n - n_test - n_val) < 1:
        raise DataError(
            f"{source}: {n} samples give an empty split with data.val_fraction="
            f"{data.val_fraction} and data.test_fraction={data.test_fraction}; "
            "use more data or other fractions"
        )
    order = np.random.default_rng(seed).permutation(n)
    parts = {"test": order[:n_test], "val": order[n_test : n_test + n_val]}
    parts["train"] = order[n_test + n_val :]
    tensors: dict[str, torch.Tensor] = {}
    for name in SPLITS:
        tensors[f"x_{name}"] = torch.from_numpy(np.ascontiguousarray(x[parts[name]]))
        tensors[f"y_{name}"] = torch.from_numpy(np.ascontiguousarray(y[parts[name]]))
    return PreparedData(tensors, int(y.max()) + 1, source)
