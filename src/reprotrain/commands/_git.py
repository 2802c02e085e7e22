"""git and the DVC files it tracks, as the commands ask them: one helper for each question.

Every call runs ``git`` in a given repository folder (a path given to one is
relative to that folder, as ``git show REV:./PATH`` reads it). Two kinds of
answer: :func:`git` is for a step that must succeed (a clone, a checkout) and
turns a failure into one :class:`~reprotrain.pipeline.errors.DataError` line
with git's own message; the queries (:func:`git_show`, :func:`is_revision`,
:func:`tracked_dvc_files`) answer "not there" (None, False, nothing) when git
says no, is missing, or takes over :data:`QUERY_TIMEOUT_S`, and the command
decides what that means. :func:`changed_paths` is the exception: a rerun's
verdict needs it, so a failure there is an error.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from reprotrain.pipeline.errors import DataError

#: A query that takes longer than this is answered "not there".
QUERY_TIMEOUT_S = 30


def git(repo: Path, *args: str) -> str:
    """The output of ``git ARGS`` in ``repo``; a failure is a DataError naming the command."""
    done = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise DataError(f"git {' '.join(args)}: {done.stderr.strip() or 'failed'}")
    return done.stdout


def _query(repo: Path, *args: str) -> subprocess.CompletedProcess[bytes] | None:
    try:
        return subprocess.run(
            ["git", *args], cwd=repo, capture_output=True, check=False, timeout=QUERY_TIMEOUT_S
        )
    except (OSError, subprocess.SubprocessError):
        return None


def is_revision(repo: Path, rev: str) -> bool:
    """Whether ``rev`` names a commit of ``repo``."""
    done = _query(repo, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    return done is not None and done.returncode == 0


def git_show(repo: Path, rev: str, path: str) -> bytes | None:
    """The bytes of ``path`` (relative to ``repo``) as committed at ``rev``; None if not there."""
    done = _query(repo, "show", f"{rev}:./{path}")
    return done.stdout if done is not None and done.returncode == 0 else None


def changed_paths(repo: Path) -> list[str]:
    """Paths ``git status`` reports changed or new in ``repo`` (one per file)."""
    done = subprocess.run(
        ["git", "status", "--porcelain", "-z", "--untracked-files=all"],
        cwd=repo,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise DataError(f"git status in {repo}: {done.stderr.strip() or 'failed'}")
    return sorted({entry[3:] for entry in done.stdout.split("\0") if len(entry) > 3})


def tracked_dvc_files(repo: Path) -> list[Path]:
    """The ``.dvc`` files (from ``dvc add``) git tracks in ``repo``."""
    done = _query(repo, "ls-files", "-z", "--", "*.dvc")
    if done is None or done.returncode != 0:
        return []
    return [repo / name for name in done.stdout.decode().split("\0") if name]


def share_dvc_cache(repo: Path, clone: Path) -> None:
    """Check out the clone's ``dvc add``-ed inputs from ``repo``'s DVC cache.

    Only the targets of ``.dvc`` files: the stages' outputs must still be made
    by the clone's own ``dvc repro`` (``verify --reference`` runs it with
    ``--no-run-cache``, so no stage is restored from an earlier run either).
    What the cache lacks stays missing, and the repro's error says so.
    """
    cache = repo / ".dvc" / "cache"
    added = [str(path.relative_to(clone)) for path in tracked_dvc_files(clone)]
    if not cache.is_dir() or not added:
        return
    dvc = [sys.executable, "-m", "dvc"]
    for argv in (["cache", "dir", "--local", str(cache)], ["checkout", "--quiet", *added]):
        subprocess.run([*dvc, *argv], cwd=clone, capture_output=True, check=False)
