"""A temporary workspace with the default data prepared, for in-process benchmarks."""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

from reprotrain.pipeline import prepare
from reprotrain.pipeline.config import Params
from reprotrain.pipeline.data import save_prepared

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def train_workspace(params: Params) -> Iterator[argparse.Namespace]:
    """Yield the `train` stage's arguments, pointing into a prepared temporary folder."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        x, y, source = prepare.load_raw(params.data.source, work)
        save_prepared(
            work / "data.safetensors", prepare.split(x, y, params.data, params.seed, source)
        )
        yield argparse.Namespace(
            data=work / "data.safetensors",
            model=work / "model.safetensors",
            metrics=work / "metrics.json",
            plots=work / "plots",
        )
