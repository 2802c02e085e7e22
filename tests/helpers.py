"""Helpers for tests that run the real `reprotrain` command in fresh processes."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cli_env(**extra: str) -> dict[str, str]:
    """The environment for a fresh `reprotrain` process: no inherited hash seed."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONHASHSEED", "CI")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["DVC_NO_ANALYTICS"] = "1"
    return {**env, **extra}


def run_cli(*args: str | Path, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """Run `python -m reprotrain ARGS` in a fresh process; never raises on failure."""
    return subprocess.run(
        [sys.executable, "-m", "reprotrain", *map(str, args)],
        cwd=cwd,
        env=cli_env(**env),
        capture_output=True,
        text=True,
        timeout=600,
    )


def run_in_process(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """`reprotrain ARGS` in this process: fast (no interpreter start, no torch import).

    Paths must be absolute. For error paths; the end-to-end tests use run_cli.
    """
    from reprotrain.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def run_checked(*cmd: str | Path, cwd: Path, **env: str) -> str:
    """Run a command (dvc, git, reprotrain...) in a fresh process; fail the test if it fails."""
    result = subprocess.run(
        [str(c) for c in cmd],
        cwd=cwd,
        env=cli_env(**env),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, f"{' '.join(map(str, cmd))}\n{result.stdout}\n{result.stderr}"
    return result.stdout + result.stderr


def copy_checkout(dest: Path) -> Path:
    """A fresh git repository holding this checkout's files (tracked or not, never ignored)."""
    listed = run_checked("git", "ls-files", "-z", "-co", "--exclude-standard", cwd=ROOT)
    for name in filter(None, listed.split("\0")):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    run_checked("git", "init", "-q", cwd=dest)
    commit_all(dest, "copy of the checkout")
    return dest


def commit_all(repo: Path, message: str) -> None:
    run_checked("git", "add", "-A", cwd=repo)
    run_checked(
        "git",
        "-c",
        "user.name=t",
        "-c",
        "user.email=t@t",
        "commit",
        "--allow-empty",
        "-qm",
        message,
        cwd=repo,
    )


def stage_argv(repo: Path, stage: str) -> list[str]:
    """The `reprotrain` arguments of a stage, as `dvc.yaml` in ``repo`` writes them."""
    import shlex

    import yaml

    cmd = yaml.safe_load((repo / "dvc.yaml").read_text())["stages"][stage]["cmd"]
    return shlex.split(cmd)[1:]
