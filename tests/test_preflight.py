"""Bad input stops the pipeline in the env stage, before DVC deletes any output."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
import yaml

from reprotrain.pipeline.config import Params
from reprotrain.pipeline.errors import DataError
from reprotrain.pipeline.params_file import load_params
from reprotrain.pipeline.preflight import (
    Sizes,
    check_raw_data,
    network_parameters,
    preflight,
    training_bytes,
)
from reprotrain.pipeline.recipe import resolve_recipe
from tests.helpers import ROOT, cli_env, params_with

DEFAULTS = ROOT / "params.yaml"


def _params(tmp_path: Path, **changes: object) -> Path:
    """params.yaml with ``changes`` (dotted keys) applied, raw YAML values kept as given."""
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params_with(changes)))
    return path


def _raw(tmp_path: Path, name: str = "user.npz", **arrays: np.ndarray) -> Path:
    raw = tmp_path / "raw"
    raw.mkdir(exist_ok=True)
    np.savez(raw / name, **arrays)
    return raw


def _preflight(params: Params, raw: Path, gpus: list) -> str:
    """:func:`preflight` as the env stage calls it, with the resolved model's sizes."""
    return preflight(params, Sizes.of(resolve_recipe(params)), check_raw_data(params, raw), gpus)


def test_the_default_params_and_digits_pass(tmp_path: Path) -> None:
    text = _preflight(load_params(DEFAULTS), tmp_path, gpus=[])
    assert "1797 samples" in text and "1x8x8" in text and "10 classes" in text


def test_network_parameter_count_matches_the_real_network() -> None:
    import torch  # noqa: F401  (the real network, for the count)

    from reprotrain.recipes.digits import build_network

    cnn = Sizes.of(resolve_recipe(load_params(DEFAULTS))).cnn
    assert cnn == (16, 64)
    for shape in ((1, 8, 8), (3, 17, 9)):
        net = build_network(shape, 7, *cnn, dropout=0.25)
        assert network_parameters(cnn, shape, 7) == sum(p.numel() for p in net.parameters())


USER_DATA = {
    "nan": ({"x": np.full((20, 4, 4), np.nan), "y": np.arange(20) % 2}, "NaN"),
    "negative labels": ({"x": np.zeros((20, 4, 4)), "y": -np.ones(20, int)}, "negative"),
    "missing y": ({"x": np.zeros((20, 4, 4))}, "missing array(s) ['y']"),
    "too few samples": ({"x": np.zeros((3, 4, 4)), "y": np.arange(3)}, "empty split"),
    "too large to train": (
        {"x": np.zeros((10, 1, 3000, 3000), np.float32), "y": np.arange(10) % 2},
        "GiB to train",
    ),
}


@pytest.mark.parametrize("case", USER_DATA)
def test_bad_user_data_is_one_data_error_naming_the_file(tmp_path: Path, case: str) -> None:
    arrays, expected = USER_DATA[case]
    raw = _raw(tmp_path, **arrays)
    params = load_params(_params(tmp_path, **{"prepare.source": "user.npz"}))
    with pytest.raises(DataError, match=r"user\.npz") as caught:
        _preflight(params, raw, gpus=[])
    assert expected in str(caught.value) and "\n" not in str(caught.value)


def test_a_source_outside_the_raw_folder_is_refused(tmp_path: Path) -> None:
    _raw(tmp_path, "outside.npz", x=np.zeros((20, 4, 4)), y=np.arange(20) % 2)
    inside = tmp_path / "raw" / "sub"
    inside.mkdir()
    (inside / "link.npz").symlink_to(tmp_path / "raw" / "outside.npz")
    for source in ("../outside.npz", "link.npz"):
        params = load_params(_params(tmp_path, **{"prepare.source": source}))
        with pytest.raises(DataError, match="resolves outside"):
            _preflight(params, inside, gpus=[])
    # Negative control: the same file inside the folder is accepted.
    params = load_params(_params(tmp_path, **{"prepare.source": "outside.npz"}))
    assert "20 samples" in _preflight(params, tmp_path / "raw", gpus=[])


def test_a_gpu_asked_for_where_none_is_visible_is_refused(tmp_path: Path) -> None:
    params = load_params(_params(tmp_path, **{"train.accelerator": "gpu"}))
    with pytest.raises(DataError, match=r"train.accelerator: gpu.*set train.accelerator: cpu"):
        _preflight(params, tmp_path, gpus=[])
    big = [{"name": "A", "memory": "81559 MiB"}]
    assert "checked the prepare stage's raw data" in _preflight(params, tmp_path, gpus=big)
    small = [{"name": "A", "memory": "1 MiB"}]
    with pytest.raises(DataError, match="GiB to train"):
        _preflight(params, tmp_path, gpus=small)


def test_memory_estimate_grows_with_the_batch(tmp_path: Path) -> None:
    small = Sizes.of(
        resolve_recipe(load_params(_params(tmp_path, **{"data.init_args.batch_size": 8})))
    )
    large = Sizes.of(
        resolve_recipe(load_params(_params(tmp_path, **{"data.init_args.batch_size": 4096})))
    )
    assert training_bytes(large, (1, 64, 64), 10) > training_bytes(small, (1, 64, 64), 10)
    # Another module's size is not estimated (no figure is made up for it).
    assert training_bytes(Sizes(4096, None), (1, 64, 64), 10) == 0


def test_env_stage_cli_refuses_bad_params_and_keeps_its_record(tmp_path: Path) -> None:
    out = tmp_path / "environment.json"
    out.write_text("previous record")
    _params(tmp_path, **{"model.init_args.dropout": 1.5})
    lock = ROOT / "requirements-cpu.lock"
    cmd = ["reprotrain", "env", "--lock", str(lock), "--raw-dir", "raw", "--out", str(out)]
    (tmp_path / "raw").mkdir()
    env = cli_env()
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert result.returncode == 2 and "model.init_args.dropout" in result.stderr
    assert out.read_text() == "previous record"
    _params(tmp_path)
    ok = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert out.read_text() != "previous record"
    assert out.stat().st_size > 100


def test_a_file_where_an_output_folder_must_be_is_one_line(tmp_path: Path) -> None:
    from reprotrain.pipeline.preflight import check_outputs

    (tmp_path / "checkpoints").write_text("x")  # a file, where the run's folder goes
    with pytest.raises(DataError) as refused:
        check_outputs({tmp_path / "checkpoints" / "run" / "epoch=0.ckpt": 1})
    assert str(refused.value).startswith(f"{tmp_path / 'checkpoints'}: a file where a folder")
    # Control: with the file moved away, the folder to be made is checked in its parent.
    (tmp_path / "checkpoints").unlink()
    check_outputs({tmp_path / "checkpoints" / "run" / "epoch=0.ckpt": 1})
