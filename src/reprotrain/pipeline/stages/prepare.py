"""Stage ``prepare``: raw data -> one prepared, split safetensors file (or a shard folder).

The source is scikit-learn's bundled digits or a user's ``.npz`` file in the
raw-data folder that ``dvc.yaml`` passes in (:mod:`reprotrain.pipeline.rawdata`
says what it must hold; the env stage checked it before DVC ran this). The
split is a seeded permutation, so the output bytes depend only on the raw
data, ``seed`` and the two fractions. With ``--samples-per-shard N`` the
output is a shard folder (docs/data.md), which training reads from disk a
batch at a time; the raw arrays are still read whole here.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from reprotrain.pipeline.command import Command, add_paths
from reprotrain.pipeline.config import Params, PrepareConfig
from reprotrain.pipeline.errors import DataError

if TYPE_CHECKING:  # numpy and torch load when the stage runs, not when the CLI reads it
    import numpy as np

    from reprotrain.pipeline.prepared import PreparedData

#: The params.yaml keys this stage reads; dvc.yaml lists exactly these.
PARAMS = ("seed", "prepare")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    paths = {"raw-dir": "folder of user raw data", "out": "prepared dataset file to write"}
    add_paths(parser, paths, required=True)
    parser.add_argument(
        "--samples-per-shard",
        type=positive_integer,
        metavar="N",
        help="write --out as a shard folder of N samples per shard, read from disk a batch "
        "at a time when training (docs/data.md), instead of one file",
    )


def positive_integer(text: str) -> int:
    """An integer >= 1 (argparse names the function in its error: "invalid positive_integer
    value: 'abc'")."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


COMMAND = Command(
    "materialise and split the dataset", add_arguments, takes_params=True, restarts=True
)


def run(params: Params, args: argparse.Namespace) -> str:
    from reprotrain.pipeline.prepared import SPLITS, save_prepared
    from reprotrain.pipeline.rawdata import load_raw

    if params.prepare is None:
        raise DataError(
            "params has no prepare section, which this stage reads; add it (`reprotrain params "
            "--defaults` prints it), or drop the prepare stage from dvc.yaml"
        )
    x, y, source = load_raw(params.prepare.source, args.raw_dir)
    prepared = split(x, y, params.prepare, params.seed, source)
    save_prepared(args.out, prepared, args.samples_per_shard)
    sizes = ", ".join(f"{s} {len(prepared.split(s)[1])}" for s in SPLITS)
    return f"prepared {source}: {sizes} -> {args.out}"


def split(
    x: np.ndarray, y: np.ndarray, data: PrepareConfig, seed: int, source: str
) -> PreparedData:
    """Seeded train / val / test split; every split must be non-empty."""
    import numpy as np
    import torch

    from reprotrain.pipeline.prepared import SPLITS, PreparedData
    from reprotrain.pipeline.rawdata import split_sizes

    _, n_val, n_test = split_sizes(len(y), data, source)
    order = np.random.default_rng(seed).permutation(len(y))
    parts = {"test": order[:n_test], "val": order[n_test : n_test + n_val]}
    parts["train"] = order[n_test + n_val :]
    tensors: dict[str, torch.Tensor] = {}
    for name in SPLITS:
        tensors[f"x_{name}"] = torch.from_numpy(np.ascontiguousarray(x[parts[name]]))
        tensors[f"y_{name}"] = torch.from_numpy(np.ascontiguousarray(y[parts[name]]))
    return PreparedData(tensors, int(y.max()) + 1, source)
