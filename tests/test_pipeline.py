"""`dvc repro` end to end in a temporary copy of the repository.

Full pipeline runs: the guarantee the product makes, so the forced repro runs
in `make test`; the experiment run (one more whole pipeline) is marked slow.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from reprotrain.hashing import load_safetensors
from tests.helpers import run_checked


def test_forced_repro_gives_a_byte_identical_dvc_lock(repo_copy: Path) -> None:
    tracked = ["dvc.lock", "reports/metrics.json", "reports/train_metrics.json", "reports/run.json"]
    before = {name: (repo_copy / name).read_bytes() for name in tracked}
    run_checked("dvc", "repro", "--force", cwd=repo_copy)
    assert {name: (repo_copy / name).read_bytes() for name in tracked} == before
    status = run_checked("dvc", "status", cwd=repo_copy)
    # The env stages are always_changed by design; nothing else may be out of date.
    always = ["env:", "\talways changed"]
    for lm in ("lm-compiled", "lm"):  # dvc status lists them sorted
        always += [f"pipelines/{lm}/dvc.yaml:env:", "\talways changed"]
    assert [line for line in status.splitlines() if line.strip()] == always


def test_nothing_tracked_holds_a_path_time_or_host(dvc_repo: Path) -> None:
    for path in [dvc_repo / "dvc.lock", *sorted((dvc_repo / "reports").rglob("*.*"))]:
        text = path.read_text()
        assert str(dvc_repo) not in text and socket.gethostname() not in text, path
    assert not (dvc_repo / "lightning_logs").exists()


def test_plots_render_in_dvc_format(dvc_repo: Path) -> None:
    shown = json.loads(run_checked("dvc", "plots", "show", "--json", cwd=dvc_repo))["data"]
    pipelines = ("dvc.yaml", "pipelines/lm/dvc.yaml", "pipelines/lm-compiled/dvc.yaml")
    names = ("train_loss", "validation")
    assert set(shown) == {f"{p}::{name}" for p in pipelines for name in names}
    rows = shown["dvc.yaml::validation"][0]["content"]["data"]["values"]
    assert {row["epoch"] for row in rows} == {str(epoch) for epoch in range(10)}
    assert {"val_loss", "val_acc"} <= set(rows[0])
    lm = shown["pipelines/lm/dvc.yaml::validation"][0]["content"]["data"]["values"]
    assert {row["epoch"] for row in lm} == {str(epoch) for epoch in range(4)}


@pytest.mark.slow
def test_dvc_exp_run_with_a_param_override(repo_copy: Path) -> None:
    run_checked("dvc", "exp", "run", "-S", "seed=7", "--name", "seed7", cwd=repo_copy)
    shown = json.loads(run_checked("dvc", "exp", "show", "--json", cwd=repo_copy))
    names = {e.get("name") for rev in shown for e in (rev.get("experiments") or [])}
    assert "seed7" in names, shown
    diff = json.loads(
        run_checked("dvc", "params", "diff", "HEAD", "seed7", "--json", cwd=repo_copy)
    )
    assert (diff["params.yaml"]["seed"]["old"], diff["params.yaml"]["seed"]["new"]) == (42, 7)


@pytest.mark.slow
def test_dvc_exp_run_sets_an_init_arg_of_each_pipeline(repo_copy: Path) -> None:
    """`dvc exp run -S model.init_args.hidden=128`: the override reaches the built model."""
    run_checked(
        *("dvc", "exp", "run", "-S", "model.init_args.hidden=128", "--name", "wide"),
        cwd=repo_copy,
    )
    diff = json.loads(run_checked("dvc", "params", "diff", "HEAD", "wide", "--json", cwd=repo_copy))
    hidden = diff["params.yaml"]["model.init_args.hidden"]
    assert (hidden["old"], hidden["new"]) == (64, 128)
    run_checked("dvc", "exp", "apply", "wide", cwd=repo_copy)
    weights, _ = load_safetensors(repo_copy / "models" / "model.safetensors")
    assert weights["net.7.weight"].shape[0] == 128  # control: 64 in the committed model
    run_record = json.loads((repo_copy / "reports" / "run.json").read_text())
    assert run_record["inputs"]["recipe"]["model"]["init_args"]["hidden"] == 128
    lm = "pipelines/lm/params.yaml:model.init_args.n_embd=32"
    run_checked("dvc", "exp", "run", "pipelines/lm/dvc.yaml", "-S", lm, cwd=repo_copy)
    lm_weights, _ = load_safetensors(repo_copy / "pipelines/lm/models/model.safetensors")
    assert lm_weights["token_embedding.weight"].shape[1] == 32  # 64 in the committed model
