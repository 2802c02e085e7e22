"""Stage ``prepare``: raw data -> one prepared, split safetensors file.

The source is scikit-learn's bundled digits or a user's ``.npz`` file in the
raw-data folder that ``dvc.yaml`` passes in (:mod:`reprotrain.pipeline.rawdata`
says what it must hold; the env stage checked it before DVC ran this). The
split is a seeded permutation, so the output bytes depend only on the raw
data, ``seed`` and the two fractions.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from reprotrain.pipeline.config import DataConfig, Params
from reprotrain.pipeline.data import SPLITS, PreparedData, save_prepared
from reprotrain.pipeline.rawdata import load_raw, split_sizes

#: The params.yaml keys this stage reads; dvc.yaml lists exactly these.
PARAMS = ("seed", "data.source", "data.val_fraction", "data.test_fraction")


def run(params: Params, args: argparse.Namespace) -> str:
    x, y, source = load_raw(params.data.source, args.raw_dir)
    prepared = split(x, y, params.data, params.seed, source)
    save_prepared(args.out, prepared)
    sizes = ", ".join(f"{s} {len(prepared.split(s)[1])}" for s in SPLITS)
    return f"prepared {source}: {sizes} -> {args.out}"


def split(x: np.ndarray, y: np.ndarray, data: DataConfig, seed: int, source: str) -> PreparedData:
    """Seeded train / val / test split; every split must be non-empty."""
    _, n_val, n_test = split_sizes(len(y), data, source)
    order = np.random.default_rng(seed).permutation(len(y))
    parts = {"test": order[:n_test], "val": order[n_test : n_test + n_val]}
    parts["train"] = order[n_test + n_val :]
    tensors: dict[str, torch.Tensor] = {}
    for name in SPLITS:
        tensors[f"x_{name}"] = torch.from_numpy(np.ascontiguousarray(x[parts[name]]))
        tensors[f"y_{name}"] = torch.from_numpy(np.ascontiguousarray(y[parts[name]]))
    return PreparedData(tensors, int(y.max()) + 1, source)
