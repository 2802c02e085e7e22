"""Helpers for tests that run the real `reprotrain` command in fresh processes."""

from __future__ import annotations

import os
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
