"""A temporary workspace with the default data prepared, for in-process benchmarks."""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

from reprotrain.hashing import canonical_json
from reprotrain.pipeline.config import Params
from reprotrain.pipeline.data import save_prepared
from reprotrain.pipeline.rawdata import load_raw
from reprotrain.pipeline.stages import prepare
from reprotrain.pipeline.stages.env import record_environment

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def train_workspace(params: Params) -> Iterator[argparse.Namespace]:
    """Yield the `train` stage's arguments, pointing into a prepared temporary folder."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        x, y, source = load_raw(params.data.source, work)
        save_prepared(
            work / "data.safetensors", prepare.split(x, y, params.data, params.seed, source)
        )
        environment = record_environment(ROOT / "requirements-cpu.lock")
        (work / "environment.json").write_text(canonical_json(environment))
        yield argparse.Namespace(
            data=work / "data.safetensors",
            model=work / "model.safetensors",
            metrics=work / "metrics.json",
            plots=work / "plots",
            env=work / "environment.json",
            run_record=work / "run.json",
            checkpoints=work / "checkpoints",
            dvc_lock=None,
            trace=None,
            evidence=False,
        )
