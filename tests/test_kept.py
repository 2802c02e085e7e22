"""The train stage's earlier outputs, kept by env and put back after a failed train stage.

End to end through ``dvc repro`` in tests/test_user_project.py (a refusal only
train can make leaves the earlier outputs byte for byte); here the rules: only
under ``dvc repro`` (the control: by hand nothing is kept), only what is
missing is put back, a success drops what was kept, nothing outside the
pipeline's folder is touched.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from reprotrain.pipeline.kept import KEPT, drop, keep, put_back

OUTPUTS = [Path("models/model.safetensors"), Path("reports/plots/train")]


@pytest.fixture
def pipeline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A pipeline folder with a model and a curves folder, as dvc repro runs its stages."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    monkeypatch.setenv("DVC_STAGE", "env")
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "reports" / "plots" / "train").mkdir(parents=True)
    (tmp_path / "reports" / "plots" / "train" / "val.csv").write_text("epoch\n")
    return tmp_path


def _deleted_by_dvc(root: Path) -> None:
    (root / "models" / "model.safetensors").unlink()
    for file in (root / "reports" / "plots" / "train").iterdir():
        file.unlink()
    (root / "reports" / "plots" / "train").rmdir()


def test_what_dvc_deleted_is_put_back_after_a_failure(pipeline: Path) -> None:
    assert keep([*OUTPUTS, Path("/etc/passwd")]) == OUTPUTS
    _deleted_by_dvc(pipeline)
    assert put_back(OUTPUTS) == OUTPUTS
    assert (pipeline / "models" / "model.safetensors").read_bytes() == b"weights"
    assert (pipeline / "reports" / "plots" / "train" / "val.csv").read_text() == "epoch\n"


def test_only_missing_outputs_are_put_back_and_a_success_drops_what_was_kept(
    pipeline: Path,
) -> None:
    keep(OUTPUTS)
    (pipeline / "models" / "model.safetensors").unlink()
    (pipeline / "models" / "model.safetensors").write_bytes(b"new")  # written by the stage
    assert put_back(OUTPUTS) == []
    assert (pipeline / "models" / "model.safetensors").read_bytes() == b"new"
    drop(OUTPUTS)
    assert not [p for p in (pipeline / KEPT).rglob("*") if p.is_file()]


def test_by_hand_nothing_is_kept_or_put_back(
    pipeline: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DVC_STAGE")
    assert keep(OUTPUTS) == []
    _deleted_by_dvc(pipeline)
    assert put_back(OUTPUTS) == []
    assert not (pipeline / KEPT).exists()


def test_a_keep_that_fails_part_way_keeps_nothing(
    pipeline: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from reprotrain.pipeline import kept

    linked = []

    def full_disk(source: Path, target: Path) -> None:
        if linked:
            raise OSError(28, "No space left on device")
        linked.append(source)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(source.read_bytes())

    monkeypatch.setattr(kept, "_link", full_disk)
    with pytest.raises(OSError):
        keep(OUTPUTS)
    assert not (pipeline / KEPT).exists()  # never a part of the last run to put back
