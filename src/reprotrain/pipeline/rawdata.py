"""The raw data a user supplies: where it may live and what it must hold.

``prepare.source`` is ``digits`` (scikit-learn's bundled 1,797 8x8 handwritten
digits, installed with the package) or the name of an ``.npz`` file inside the
raw-data folder (``data/raw``), with arrays ``x``: N x H x W or N x C x H x W,
real-valued and already scaled, and ``y``: N integer labels from 0. The name
must resolve inside that folder: ``..`` and symlinks that lead out are
refused, so a stage reads only what ``dvc add`` tracks there.

Light on purpose (numpy only; scikit-learn when the digits are asked for):
the env stage checks the raw data with it before DVC touches any output
(:mod:`reprotrain.pipeline.preflight`), and the prepare stage reads it.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np

from reprotrain.pipeline.config import PrepareConfig
from reprotrain.pipeline.errors import DataError

BUILTIN_SOURCE = "digits"


def source_path(source: str, raw_dir: Path) -> Path:
    """The file ``prepare.source`` names, checked to lie inside ``raw_dir``."""
    path = raw_dir / source
    if path.suffix != ".npz":
        raise DataError(
            f"prepare.source: {source!r} is neither 'digits' nor an .npz file name; "
            f"set it to 'digits' or to a file in {raw_dir}"
        )
    inside = raw_dir.resolve()
    if inside not in path.resolve().parents:
        raise DataError(
            f"prepare.source: {source!r} resolves outside {raw_dir} (.. or a symlink); "
            f"copy the file into {raw_dir} and `dvc add` it there"
        )
    if not path.is_file():
        raise DataError(f"{path}: not found; put the file there and `dvc add` it")
    return path


def load_raw(source: str, raw_dir: Path) -> tuple[np.ndarray, np.ndarray, str]:
    """Images as float32 N x C x H x W and labels as int64, checked."""
    if source == BUILTIN_SOURCE:
        from sklearn.datasets import load_digits

        digits = load_digits()
        return (digits.images[:, None] / 16.0).astype(np.float32), digits.target, BUILTIN_SOURCE
    path = source_path(source, raw_dir)
    return (*_read_npz(path), source)


def _read_npz(path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {name: archive[name] for name in archive.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
        raise DataError(f"{path}: not a readable .npz file ({err}); re-export it") from None
    missing = {"x", "y"} - set(arrays)
    if missing:
        raise DataError(
            f"{path}: missing array(s) {sorted(missing)}; save both, np.savez(path, x=images, "
            "y=labels)"
        )
    x, y = arrays["x"], arrays["y"]
    if x.ndim == 3:
        x = x[:, None]
    if x.ndim != 4 or min(x.shape[2:]) < 2 or x.shape[1] < 1:
        raise DataError(
            f"{path}: x has shape {x.shape}; expected N x H x W or N x C x H x W (C >= 1, "
            "H, W >= 2); "
            "save x as a stack of images"
        )
    if x.dtype.kind not in "fiu":
        raise DataError(f"{path}: x has dtype {x.dtype}; save x as floats or integers")
    if y.ndim != 1 or y.dtype.kind not in "iu" or len(y) != len(x):
        raise DataError(
            f"{path}: y has shape {y.shape} and dtype {y.dtype}; save y as {len(x)} integer "
            "labels, one per image in x"
        )
    images = x.astype(np.float32)  # checked as trained: float64's 1e300 is float32's inf
    if not np.isfinite(images).all():
        raise DataError(
            f"{path}: x contains NaN or infinite values as float32 (beyond +-3.4e38); clean "
            "the data"
        )
    if len(y) and y.min() < 0:
        raise DataError(
            f"{path}: y has negative labels (min {y.min()}); renumber the classes 0..K-1"
        )
    if len(y) and y.max() >= len(y):
        raise DataError(
            f"{path}: y has label {y.max()} for {len(y)} samples; labels are class indices: "
            "renumber the classes 0..K-1"
        )
    return images, y.astype(np.int64)


def split_sizes(n: int, prepare: PrepareConfig, source: str) -> tuple[int, int, int]:
    """(train, val, test) sample counts; every split must be non-empty."""
    n_test = round(n * prepare.test_fraction)
    n_val = round(n * prepare.val_fraction)
    if min(n_test, n_val, n - n_test - n_val) < 1:
        raise DataError(
            f"{source}: {n} samples give an empty split with prepare.val_fraction="
            f"{prepare.val_fraction} and prepare.test_fraction={prepare.test_fraction}; "
            "use more data or other fractions"
        )
    return n - n_test - n_val, n_val, n_test
