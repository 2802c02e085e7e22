"""The train and evaluate stages' earlier outputs, kept by env and put back after a failure.

End to end through ``dvc repro`` in tests/test_user_project.py (a refusal only
train can make leaves the earlier outputs byte for byte) and
tests/test_evaluate.py (a failed evaluate leaves ``metrics.json``); here the
rules: only under ``dvc repro`` (the control: by hand nothing is kept), the
earlier outputs replace what a failed run wrote (and what it wrote of an output
nothing was kept of goes), a success drops what was kept, nothing outside the
pipeline's folder is touched; the env stage keeps both stages' outputs; and the
error says once, on its one line, that they are back (a traceback: on the line
after the exception's, never inside its message).
"""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest

from reprotrain.cli import main
from reprotrain.pipeline.errors import DataError
from reprotrain.pipeline.kept import KEPT, drop, keep, put_back
from tests.helpers import ROOT

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


def test_what_a_failed_run_wrote_gives_way_to_the_earlier_outputs(
    pipeline: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    keep(OUTPUTS)
    _deleted_by_dvc(pipeline)
    (pipeline / "dvc.yaml").write_text(
        "stages:\n  train:\n    cmd: reprotrain train\n    outs:\n"
        "      - models/model.safetensors\n      - reports/metrics.json\n"
        "      - reports/kept.json:\n          persist: true\n"
    )
    monkeypatch.setenv("DVC_STAGE", "train")
    (pipeline / "models" / "model.safetensors").write_bytes(b"new")  # written, then it failed
    (pipeline / "reports" / "metrics.json").write_text("{}")  # of an output nothing was kept of
    (pipeline / "reports" / "kept.json").write_text("{}")  # DVC leaves a persist output be
    written = [*OUTPUTS, Path("reports/metrics.json"), Path("reports/kept.json")]
    assert put_back(written) == OUTPUTS
    assert (pipeline / "models" / "model.safetensors").read_bytes() == b"weights"
    assert not (pipeline / "reports" / "metrics.json").exists()  # nothing partial stays
    assert (pipeline / "reports" / "kept.json").exists()  # the control: not DVC's to delete


def test_a_success_drops_what_was_kept(pipeline: Path) -> None:
    keep(OUTPUTS)
    (pipeline / "models" / "model.safetensors").unlink()
    (pipeline / "models" / "model.safetensors").write_bytes(b"new")  # written by the stage
    drop(OUTPUTS)
    assert not [p for p in (pipeline / KEPT).rglob("*") if p.is_file()]
    assert (pipeline / "models" / "model.safetensors").read_bytes() == b"new"


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


#: A pipeline's train and evaluate stages as dvc.yaml writes them (the env stage reads them).
DVC_YAML = """\
stages:
  train:
    cmd: >-
      reprotrain train --model models/model.safetensors --metrics reports/train_metrics.json
      --plots reports/plots/train --env reports/environment.json --run-record reports/run.json
      --checkpoints checkpoints
  evaluate:
    cmd: reprotrain evaluate --model models/model.safetensors --metrics reports/metrics.json
"""
TRAIN = ["train", *DVC_YAML.split("reprotrain train")[1].split("evaluate:")[0].split()]
EVALUATE = ["evaluate", *DVC_YAML.split("reprotrain evaluate")[1].split()]


@pytest.fixture
def earlier_run(pipeline: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The pipeline with its dvc.yaml, params.yaml and test metrics; the env stage has kept
    the train and evaluate stages' outputs, and DVC deleted them, as before either runs."""
    from reprotrain.pipeline.stages import env

    (pipeline / "dvc.yaml").write_text(DVC_YAML)
    (pipeline / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    (pipeline / "reports" / "metrics.json").write_text('{"test_samples": 3}')
    env.keep_earlier_outputs(env.pipeline_stage("train"), env.pipeline_stage("evaluate"))
    _deleted_by_dvc(pipeline)
    (pipeline / "reports" / "metrics.json").unlink()
    return pipeline


def _error_lines(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def test_the_env_stage_keeps_evaluate_outputs_beside_train_ones(
    earlier_run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from reprotrain.pipeline.kept import evaluate_outputs, train_outputs
    from reprotrain.pipeline.stages import env

    monkeypatch.setenv("DVC_STAGE", "train")
    drop(train_outputs(env.pipeline_stage("train")))  # train succeeded: its own are dropped
    assert put_back(evaluate_outputs(env.pipeline_stage("evaluate"))) == [
        Path("reports/metrics.json")
    ]
    assert (earlier_run / "reports" / "metrics.json").read_text() == '{"test_samples": 3}'
    # Control: a pipeline whose dvc.yaml has no evaluate stage keeps train's alone.
    (earlier_run / "dvc.yaml").write_text(DVC_YAML.split("  evaluate:")[0])
    assert env.pipeline_stage("evaluate") is None


def test_a_failed_evaluate_puts_the_earlier_metrics_back_and_says_so_once(
    earlier_run: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DVC_STAGE", "evaluate")
    (earlier_run / "models" / "model.safetensors").write_bytes(b"not weights")
    assert main(EVALUATE) == 2
    [line] = _error_lines(capsys)
    assert line.startswith("reprotrain: error: models/model.safetensors: not a reprotrain model")
    assert line.endswith(" (the earlier outputs are back in place: reports/metrics.json)")
    assert "dvc checkout" not in line
    assert (earlier_run / "reports" / "metrics.json").read_text() == '{"test_samples": 3}'
    # Control: run again, nothing is left kept: the line says where DVC keeps outputs instead.
    (earlier_run / "reports" / "metrics.json").unlink()
    assert main(EVALUATE) == 2
    [line] = _error_lines(capsys)
    assert "back in place" not in line and "`dvc checkout evaluate` restores them" in line
    assert not (earlier_run / "reports" / "metrics.json").exists()


def test_a_train_refusal_under_dvc_ends_in_one_true_note(
    earlier_run: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from reprotrain.pipeline.stages import train

    def refused(*_: object) -> str:
        raise DataError("data.class_path: refused; fix it")

    monkeypatch.setattr(train, "_train", refused)
    monkeypatch.setenv("DVC_STAGE", "train")
    assert main(TRAIN) == 2
    assert _error_lines(capsys) == [
        "reprotrain: error: data.class_path: refused; fix it (the earlier outputs are back in "
        "place: models/model.safetensors, reports/plots/train)"
    ]
    # Control: with nothing to put back, the one note says where DVC keeps them.
    assert main(TRAIN) == 2
    [line] = _error_lines(capsys)
    assert line.startswith("reprotrain: error: data.class_path: refused; fix it (dvc repro ")
    assert "back in place" not in line and line.count(" (") == 1


def test_the_put_back_note_follows_a_traceback_line_and_stays_out_of_a_key_error(
    earlier_run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from reprotrain.pipeline.stages import train

    def user_code(*_: object) -> str:
        return {}["loss"]

    monkeypatch.setattr(train, "_train", user_code)
    monkeypatch.setenv("DVC_STAGE", "train")
    with pytest.raises(KeyError) as raised:
        main(TRAIN)
    assert raised.value.args == ("loss",)  # its message, quoted by KeyError, is its own
    assert traceback.format_exception(raised.value)[-2:] == [
        "KeyError: 'loss'\n",
        "the earlier outputs are back in place: models/model.safetensors, reports/plots/train\n",
    ]
    # Control: with nothing to put back, no note.
    with pytest.raises(KeyError) as raised:
        main(TRAIN)
    assert not hasattr(raised.value, "__notes__")
