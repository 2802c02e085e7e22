"""The op catalog and its probe: measured verdicts, torch's own alert text, a negative control.

On this CPU build torch alerts for ``max_unpool2d`` and ``put_(accumulate=False)`` under
``use_deterministic_algorithms(True)``; the catalog must show torch's words, not ours.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from reprotrain.ops.catalog import CATALOG
from reprotrain.ops.probes import OpCase, Thunk, probe_op
from tests.helpers import ROOT, run_cli

CPU = torch.device("cpu")
BY_NAME = {case.name: case for case in CATALOG}


@pytest.fixture(autouse=True)
def _flags(restore_torch_flags: None) -> Iterator[None]:
    yield


def _torch_alert() -> tuple[str, str]:
    """What torch itself raises and warns for max_unpool2d in deterministic mode."""
    out, indices = F.max_pool2d(torch.randn(1, 1, 4, 4), 2, return_indices=True)
    torch.use_deterministic_algorithms(True)
    with pytest.raises(RuntimeError) as raised:
        F.max_unpool2d(out, indices, 2)
    torch.use_deterministic_algorithms(True, warn_only=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        F.max_unpool2d(out, indices, 2)
    torch.use_deterministic_algorithms(False)
    return str(raised.value).splitlines()[0], str(caught[0].message).splitlines()[0]


def test_an_op_that_alerts_shows_torchs_own_raise_and_warning() -> None:
    raised, warned = _torch_alert()
    assert "does not have a deterministic implementation" in raised
    result = probe_op(BY_NAME["max_unpool2d"], CPU, repeats=2)
    assert result.default == "identical" and result.deterministic == "raises"
    assert result.message == raised and result.warning == warned
    assert result.time_ratio is None
    assert torch.are_deterministic_algorithms_enabled() is False  # flags restored


def test_an_op_with_a_deterministic_path_runs_identical_with_a_time_ratio() -> None:
    result = probe_op(BY_NAME["Tensor.scatter_add_"], CPU, repeats=2)
    assert result.deterministic == "runs, identical" and result.message is None
    assert result.default_s and result.deterministic_s
    assert result.time_ratio == pytest.approx(result.deterministic_s / result.default_s)


def _unseeded(device: torch.device, g: torch.Generator) -> Thunk:
    def call() -> tuple[torch.Tensor, ...]:
        noise = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
        return (torch.randn(64, generator=noise).to(device),)

    return call


def test_negative_control_a_really_non_deterministic_op_is_reported_as_differing() -> None:
    result = probe_op(OpCase("synthetic unseeded noise", _unseeded), CPU, repeats=3)
    assert result.default == "differs" and result.default_max_abs_diff > 0
    assert result.deterministic == "runs, differs"  # no alert: torch cannot know


def test_ops_command_writes_markdown_and_json_with_the_alert(tmp_path: Path) -> None:
    md, js = tmp_path / "ops.md", tmp_path / "ops.json"
    only = ("--only", "max_unpool2d", "--only", "Tensor.scatter_add_")
    result = run_cli(
        "ops",
        "--device",
        "cpu",
        *only,
        "--repeats",
        "2",
        "--out-md",
        md,
        "--out-json",
        js,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert "2 ops probed on cpu in" in result.stdout
    report = json.loads(js.read_text())
    assert report["torch"] == torch.__version__ and report["elapsed_s"] > 0
    ops = {op["name"]: op for op in report["ops"]}
    assert ops["max_unpool2d"]["deterministic"] == "raises"
    assert "does not have a deterministic implementation" in ops["max_unpool2d"]["message"]
    assert "| max_unpool2d | identical | **raises** | max_unpooling2d_forward_out" in md.read_text()


def test_committed_cpu_catalog_covers_every_op_and_names_its_build() -> None:
    report = json.loads((ROOT / "docs/cpu/ops.json").read_text())
    assert [op["name"] for op in report["ops"]] == [case.name for case in CATALOG]
    assert report["device"] == "cpu" and report["torch"] and report["device_name"]
    alerts = [op for op in report["ops"] if op["deterministic"] in ("raises", "warns")]
    assert alerts and all("deterministic" in op["message"] for op in alerts)
    assert report["elapsed_s"] < 120


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_catalog_finds_ops_that_alert_with_torchs_text() -> None:
    cuda = torch.device("cuda")
    results = [probe_op(case, cuda, repeats=2) for case in CATALOG]
    alerts = [r for r in results if r.deterministic in ("raises", "warns")]
    assert alerts, "torch documents CUDA ops that alert under determinism; none did"
    assert all("deterministic" in (r.message or "") for r in alerts)
    assert all(r.deterministic != "runs, differs" for r in results)
