"""The bad-input catalog: each case one clear line, a non-zero exit, and no earlier output lost.

Every case starts from a repository after ``dvc repro`` (``repo_copy``), breaks one
thing the way a user would (params.yaml, a ``dvc exp run -S`` override, a raw
``.npz`` file, a read-only or full output folder, a tampered checkpoint, a CLI
call) and runs what the user would run. It then asserts: non-zero exit, exactly
one ``reprotrain: error:`` line (DVC adds its own "failed to reproduce" line
after it), that the line names the key, file or flag and says what to do, no
traceback, no stray temporary file, and an unchanged hash manifest of
``models/``, ``reports/``, ``data/prepared/`` and ``dvc.lock``.

Read-only and full folders are real mounts (a read-only bind mount, a small
tmpfs) inside a private mount namespace (``unshare``), so they hold for root too
and vanish with the process.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from tests.helpers import DELETE, ROOT, cli_env, params_with, train_argv

#: Words that tell the user what to do; every error line holds one of them.
ACTIONS = (
    "set ", "add it", "remove", "rename", "renumber", "save ", "clean ", "use ", "lower ",
    "copy ", "put ", "fix ", "free ", "make ", "point ", "pass ", "run ", "rerun", "delete",
    "write ", "re-export", "prints", "lists", "downscale", "see `",
)  # fmt: skip
#: The outputs no bad input may delete or change.
WATCHED = ("models", "reports", "data/prepared")
DVC_REPRO = ("dvc", "repro")


@dataclass(frozen=True)
class Case:
    """One bad input and the text its error line must hold (the key, file or flag)."""

    expect: str
    params: Mapping[str, Any] = field(default_factory=dict)
    text: str | None = None  # params.yaml's whole text instead of ``params``
    npz: Mapping[str, np.ndarray] | None = None  # data/raw/user.npz, with prepare.source set
    raw: bytes | None = None  # data/raw/user.npz's bytes
    mount: tuple[str, str] | None = None  # (folder, "ro" or a tmpfs size)
    argv: tuple[str, ...] = DVC_REPRO
    by_dvc: bool = False  # DVC reads params.yaml itself first and reports it (``ERROR:``)
    files: Mapping[str, str] = field(default_factory=dict)  # a user's package, by path


def _x(n: int = 30, side: int = 4, dtype: Any = np.float32) -> np.ndarray:
    return np.zeros((n, side, side), dtype)


def _y(n: int = 30) -> np.ndarray:
    return np.arange(n) % 3


#: A user's package beside params.yaml, as Lightning's docs write one: the digits model with
#: batch norm; data modules that download in prepare_data() or sample with their own sampler.
USER_PACKAGE = {
    "userpkg/__init__.py": "",
    "userpkg/model.py": """\
import torch
from reprotrain.recipes.digits import Classifier


class NormedClassifier(Classifier):
    def __init__(self, input_shape: tuple[int, int, int], num_classes: int) -> None:
        super().__init__(input_shape, num_classes)
        self.norm = torch.nn.BatchNorm1d(4)
""",
    "userpkg/data.py": """\
from torch.utils.data import DataLoader, WeightedRandomSampler
from reprotrain.recipes.digits import DigitsData


class Downloading(DigitsData):
    def prepare_data(self) -> None:
        pass


class Weighted(DigitsData):
    def train_dataloader(self) -> DataLoader:
        data = self.train_dataset()
        sampler = WeightedRandomSampler([1.0] * len(data), len(data))
        return DataLoader(data, batch_size=16, sampler=sampler)
""",
}
# The stages that build its classes depend on it, as the env stage asks of a user's code.
USER_PACKAGE["dvc.yaml"] = (
    (ROOT / "dvc.yaml")
    .read_text()
    .replace("      - src/reprotrain\n", "      - src/reprotrain\n      - userpkg\n")
)
NORMED = {
    "model": {"class_path": "userpkg.model.NormedClassifier", "init_args": {}},
    "train.world_size_invariant": True,
}


def _user(expect: str, params: Mapping[str, Any], argv: tuple[str, ...] = DVC_REPRO) -> Case:
    return Case(expect, params, argv=argv, files=USER_PACKAGE)


def _values(key: str, *bad: Any) -> dict[str, Case]:
    """One case per bad value of ``key``."""
    return {f"{key}: {value!r}": Case(key, {key: value}) for value in bad}


CATALOG: dict[str, Case] = {
    # params.yaml: each key's type, range or choice.
    **_values("seed", -1, "42", 1.5),
    **_values("deterministic", "maybe"),
    **_values("cpu.profile", "fast"),
    **_values("cpu.threads", 0),
    **_values("prepare.source", 5),
    **_values("prepare.val_fraction", 0),
    **_values("prepare.test_fraction", 1.2),
    **_values("data.init_args.batch_size", 2.5, 0),
    **_values("data.init_args.num_workers", -1),
    **_values("data.init_args.augment", 3),
    **_values("model.init_args.channels", 0),
    **_values("model.init_args.hidden", 2.5),
    **_values("model.init_args.dropout", 1.5),
    **_values("train.max_epochs", 0),
    **_values("train.checkpoint_every_n_epochs", 0),
    **_values("train.trace", "partial"),
    **_values("model.init_args.optimizer", "lbfgs"),
    **_values("model.init_args.lr", 0),
    **_values("model.init_args.weight_decay", -0.1),
    **_values("train.accelerator", "auto"),
    **_values("train.strategy", "fsdp"),
    **_values("train.precision", "8-bit"),
    **_values("train.num_nodes", 0),
    # params.yaml: rules across keys, and what the machine lacks.
    "fractions add to 1": Case(
        "prepare.val_fraction + prepare.test_fraction",
        {"prepare.val_fraction": 0.5, "prepare.test_fraction": 0.5},
    ),
    "two devices, one process": Case("train.strategy", {"train.devices": 2}),
    "gpu without CUDA": Case("train.accelerator", {"train.accelerator": "gpu"}),
    "unknown source": Case("prepare.source", {"prepare.source": "nope.csv"}),
    "source outside data/raw": Case("resolves outside", {"prepare.source": "../outside.npz"}),
    "source missing": Case("user.npz: not found", {"prepare.source": "user.npz"}),
    # params.yaml: its structure.
    "missing key": Case("missing key 'seed'", {"seed": DELETE}),
    "missing section": Case("missing key 'model'", {"model": DELETE}),
    "unknown key": Case("unknown key 'colour'", {"colour": "red"}),
    "unknown nested key": Case("unknown key 'train.momentum'", {"train.momentum": 0.9}),
    # The model and data module params.yaml names (imported and type-checked, not built).
    "model class missing": Case("model.class_path", {"model.class_path": "mypkg.Net"}),
    "data class of the wrong kind": Case(
        "is not a LightningDataModule",
        {"data.class_path": "reprotrain.recipes.digits.Classifier"},
    ),
    "misspelt init arg": Case("model.init_args.hiddn", {"model.init_args.hiddn": 3}),
    "linked arg set by hand": Case(
        "model.init_args.num_classes", {"model.init_args.num_classes": 3}
    ),
    "empty file": Case("params.yaml: expected a mapping", text=""),
    "a list": Case("params.yaml", text="- seed\n- 42\n", by_dvc=True),
    "broken YAML": Case("params.yaml", text="seed: [\n", by_dvc=True),
    "section not a mapping": Case("model: expected a mapping", params={"model": 3}),
    # dvc exp run -S: DVC writes the value into params.yaml, then runs the stages.
    **{
        f"dvc exp run -S {item}": Case(item.split("=")[0], argv=("dvc", "exp", "run", "-S", item))
        for item in ("model.init_args.dropout=1.5", "model.init_args.lr=-1", "seed=abc")
    },
    # The raw data file.
    "npz with NaN": Case("x contains NaN", npz={"x": np.full((30, 4, 4), np.nan), "y": _y()}),
    "npz with inf": Case("x contains NaN", npz={"x": np.full((30, 4, 4), np.inf), "y": _y()}),
    "npz with negative labels": Case("negative labels", npz={"x": _x(), "y": -np.ones(30, int)}),
    "npz with sparse labels": Case("y has label", npz={"x": _x(), "y": _y() * 1000}),
    "npz with float labels": Case("y has shape", npz={"x": _x(), "y": _y() * 0.5}),
    "npz with too few labels": Case("y has shape", npz={"x": _x(), "y": _y(20)}),
    "npz with 2-D labels": Case("y has shape", npz={"x": _x(), "y": np.zeros((30, 2), int)}),
    "npz without y": Case("missing array(s) ['y']", npz={"x": _x()}),
    "npz without x": Case("missing array(s) ['x']", npz={"y": _y()}),
    "npz with 1-D x": Case("x has shape", npz={"x": np.zeros(30), "y": _y()}),
    "npz with 5-D x": Case("x has shape", npz={"x": np.zeros((30, 1, 1, 4, 4)), "y": _y()}),
    "npz with complex x": Case("x has dtype", npz={"x": _x(dtype=complex), "y": _y()}),
    "npz with objects": Case(
        "not a readable .npz", npz={"x": np.array([object()] * 30), "y": _y()}
    ),
    "npz not a zip": Case("not a readable .npz", raw=b"not an archive"),
    "npz with 3 samples": Case("empty split", npz={"x": _x(3), "y": _y(3)}),
    "npz with no samples": Case("empty split", npz={"x": _x(0), "y": _y(0)}),
    "npz too large to train": Case(
        "GiB to train", npz={"x": np.zeros((4, 1, 4000, 4000), np.float32), "y": _y(4) % 2}
    ),
    # Output folders that cannot take the outputs (real mounts, also for root).
    "read-only models/": Case("models/: cannot write", mount=("models", "ro")),
    "read-only reports/": Case("reports/: cannot write", mount=("reports", "ro")),
    "full models/": Case("models/: 0.1 MiB free", mount=("models", "96k")),
    "full data/prepared/": Case("data/prepared/: 0.1 MiB free", mount=("data/prepared", "96k")),
    # CLI misuse, run directly.
    "compare a missing path": Case(
        "nope: neither a folder", argv=("reprotrain", "compare", "nope", "HEAD")
    ),
    "verify --runs 1": Case("--runs 1", argv=("reprotrain", "verify", "--runs", "1")),
    "verify --runs x": Case("--runs", argv=("reprotrain", "verify", "--runs", "x")),
    "unknown flag": Case("--bogus", argv=("reprotrain", "locate", "--bogus")),
    "an override without =": Case("override 'seed'", argv=("reprotrain", "params", "-S", "seed")),
    "an unknown override": Case(
        "unknown key 'nope'", argv=("reprotrain", "params", "-S", "nope=1")
    ),
    "evaluate a missing model": Case(
        "missing.safetensors",
        argv=(
            "reprotrain",
            "evaluate",
            "--model",
            "missing.safetensors",
            "--data",
            "data/prepared/dataset.safetensors",
            "--metrics",
            "reports/metrics.json",
        ),
    ),
    "env --diff of missing records": Case(
        "a.json", argv=("reprotrain", "env", "--diff", "a.json", "b.json")
    ),
    # A user's package (issue 42's cases): refused at env, before DVC deletes an output.
    "batch norm under world-size invariance": _user("norm: batch norm with running", NORMED),
    "batch norm, verify --world-sizes 1,2": _user(
        "norm: batch norm with running", NORMED, ("reprotrain", "verify", "--world-sizes", "1,2")
    ),
    "a data module that downloads": _user(
        "defines prepare_data()",
        {"data.class_path": "userpkg.data.Downloading", "data.init_args.path": "data/mnist"},
    ),
    "its own sampler under DDP": _user(
        "WeightedRandomSampler",
        {"data.class_path": "userpkg.data.Weighted", "train.strategy": "ddp", "train.devices": 2},
    ),
}


def _manifest(repo: Path) -> dict[str, str]:
    files = [repo / "dvc.lock"]
    for folder in WATCHED:
        files += sorted(p for p in (repo / folder).rglob("*") if p.is_file())
    return {str(p.relative_to(repo)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def _in_mount(folder: str, how: str, argv: tuple[str, ...]) -> list[str]:
    """``argv`` in a private mount namespace where ``folder`` is read-only or a small tmpfs."""
    if how == "ro":
        mount = 'mount --bind "$d" "$d" && mount -o remount,bind,ro "$d"'
    else:
        mount = f'mount -t tmpfs -o size={how} tmpfs "$d"'
    script = f'd=$1; shift; {mount} && exec "$@"'
    return ["unshare", "--mount", "--map-root-user", "sh", "-c", script, "sh", folder, *argv]


def _break(repo: Path, case: Case) -> None:
    for name, text in case.files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    params = dict(case.params)
    if case.npz is not None or case.raw is not None:
        params["prepare.source"] = "user.npz"
        target = repo / "data/raw/user.npz"
        if case.npz is not None:
            np.savez(target, **case.npz)
        else:
            target.write_bytes(case.raw or b"")
    text = yaml.safe_dump(params_with(params)) if case.text is None else case.text
    if params or case.text is not None:
        (repo / "params.yaml").write_text(text)


def test_the_catalog_has_fifty_cases() -> None:
    assert len(CATALOG) >= 50, len(CATALOG)


@pytest.mark.slow
@pytest.mark.parametrize("name", CATALOG)
def test_bad_input_is_one_line_and_keeps_every_earlier_output(
    repo_copy: Path, name: str, tmp_path: Path
) -> None:
    case = CATALOG[name]
    before = _manifest(repo_copy)
    _break(repo_copy, case)
    argv = _in_mount(*case.mount, case.argv) if case.mount else list(case.argv)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    result = subprocess.run(
        argv, cwd=repo_copy, env=cli_env(TMPDIR=str(scratch)), capture_output=True, text=True
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    ours = [line for line in result.stderr.splitlines() if line.startswith("reprotrain: error:")]
    if case.by_dvc:  # no stage ran: DVC's own first error line names the file
        dvcs = [line for line in output.splitlines() if line.startswith("ERROR:")]
        assert not ours and dvcs and case.expect in dvcs[0], output
    else:
        assert len(ours) == 1, output
        assert case.expect in ours[0], ours[0]
        assert any(action in ours[0] for action in ACTIONS), f"not what to do: {ours[0]}"
    assert "Traceback" not in output
    assert _manifest(repo_copy) == before
    strays = [*repo_copy.rglob(".*.tmp-*"), *repo_copy.rglob(".reprotrain-write-check-*")]
    assert not [*strays, *scratch.glob("reprotrain*")], strays


@pytest.mark.slow
def test_a_disk_that_fills_during_training_ends_in_one_line_without_a_temp_file(
    prepared: Path, env_record: Path, tmp_path: Path
) -> None:
    # Past the env stage's space check (train run alone): the model write itself fails.
    out = tmp_path / "run"
    out.mkdir()
    argv = train_argv(prepared, env_record, out, "-S", "train.max_epochs=1")
    argv[argv.index("--model") + 1] = str(out / "models/model.safetensors")
    (out / "models").mkdir()
    cmd = [sys.executable, "-m", "reprotrain", *argv]
    result = subprocess.run(
        _in_mount(str(out / "models"), "64k", tuple(cmd)),
        cwd=out,
        env=cli_env(),
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("reprotrain: error: ") and "model.safetensors: No space left" in last
    assert "free disk space there and rerun" in last
    assert "Traceback" not in result.stderr
