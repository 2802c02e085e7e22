"""The commands' one git helper: a must-succeed step is one error line, a query says "not there"."""

from __future__ import annotations

from pathlib import Path

import pytest

from reprotrain.commands._git import (
    changed_paths,
    git,
    git_show,
    is_revision,
    tracked_dvc_files,
)
from reprotrain.pipeline.errors import DataError
from tests.helpers import commit_all, run_checked


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A repository with one commit: a file, and a ``.dvc`` sidecar in a subfolder."""
    (tmp_path / "reports").mkdir()
    (tmp_path / "reports" / "run.json").write_text('{"run_id": "a"}\n')
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "raw.dvc").write_text("outs:\n- md5: 0\n  path: raw\n")
    run_checked("git", "init", "-q", cwd=tmp_path)
    commit_all(tmp_path, "first")
    return tmp_path


def test_show_reads_a_committed_file_and_says_none_for_what_is_not_there(repo: Path) -> None:
    (repo / "reports" / "run.json").write_text("changed\n")
    assert git_show(repo, "HEAD", "reports/run.json") == b'{"run_id": "a"}\n'
    # Relative to the folder given, as a command run from there reads it.
    assert git_show(repo / "reports", "HEAD", "run.json") == b'{"run_id": "a"}\n'
    assert git_show(repo, "HEAD", "reports/missing.json") is None
    assert git_show(repo, "no-such-rev", "reports/run.json") is None


def test_a_revision_is_a_commit_and_a_typo_is_not(repo: Path) -> None:
    assert is_revision(repo, "HEAD")
    assert not is_revision(repo, "HEAD~5")
    assert not is_revision(repo, "reports/run.json")


def test_a_failed_step_is_one_data_error_with_gits_message(repo: Path) -> None:
    assert git(repo, "rev-parse", "--abbrev-ref", "HEAD").strip()
    with pytest.raises(DataError, match=r"^git checkout -q no-such-rev: .*no-such-rev"):
        git(repo, "checkout", "-q", "no-such-rev")


def test_changed_paths_lists_edited_and_new_files_only(repo: Path) -> None:
    assert changed_paths(repo) == []
    (repo / "reports" / "run.json").write_text("changed\n")
    (repo / "reports" / "new.csv").write_text("x\n")
    assert changed_paths(repo) == ["reports/new.csv", "reports/run.json"]


def test_tracked_dvc_files_are_the_committed_sidecars_and_nothing_outside_git(
    repo: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    (repo / "untracked.dvc").write_text("outs: []\n")
    assert tracked_dvc_files(repo) == [repo / "data" / "raw.dvc"]
    # Negative control: a folder git does not know answers nothing, without an error.
    assert tracked_dvc_files(tmp_path_factory.mktemp("plain")) == []
