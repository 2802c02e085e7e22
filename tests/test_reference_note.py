"""After ``make repro``: one line when the committed reference was made on another kind of
machine (a field that moves the bits differs), nothing otherwise."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from reprotrain.commands.reference_note import reference_note
from tests.helpers import ROOT, commit_all, run_checked, run_cli

RECORD = Path("reports/environment.json")


def _repo(tmp_path: Path) -> Path:
    """A repository whose HEAD holds this checkout's environment record."""
    (tmp_path / "reports").mkdir()
    shutil.copy(ROOT / RECORD, tmp_path / RECORD)
    run_checked("git", "init", "-q", cwd=tmp_path)
    commit_all(tmp_path, "the reference")
    return tmp_path


def _set(repo: Path, section: str, key: str, value: object) -> None:
    record = json.loads((repo / RECORD).read_text())
    record[section][key] = value
    (repo / RECORD).write_text(json.dumps(record))


def test_another_torch_build_is_named_in_one_line(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    committed = json.loads((repo / RECORD).read_text())["torch"]["version"]
    other = "2.99.0+cpu"
    _set(repo, "torch", "version", other)
    line = reference_note(repo, RECORD)
    assert line is not None and "\n" not in line
    assert f"torch.version {committed} -> {other}" in line and "make check-reference" in line
    done = run_cli("reference-note", RECORD, cwd=repo)
    assert done.returncode == 0 and done.stdout.strip() == line


def test_the_same_record_or_a_field_that_moves_no_bit_says_nothing(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    assert reference_note(repo, RECORD) is None
    _set(repo, "variables", "REPROTRAIN_UNRELATED", "x")  # provenance only
    assert reference_note(repo, RECORD) is None
    assert reference_note(repo, Path("pipelines/lm/reports/environment.json")) is None  # absent
