"""A clean clone of a commit, and the environment that runs *its* code, for rebuilding.

``verify --reference`` and ``verify-attestation --rebuild`` run ``dvc repro`` in a
clone of a commit, and DVC hashes the clone's ``src/`` as the stages' code: so
the stages must run the clone's package too, not the one installed here.
:func:`clone_environment` gives them either

* this interpreter with the clone's ``src/`` first on ``PYTHONPATH``, where
  the installed distributions are exactly the clone's lock (its packages at
  its pins: ``lock_status``), so the code and the dependencies are the
  commit's; or
* a fresh virtual environment in the clone, made by the clone's own
  ``make venv`` from its own lock (hash-checked), with the clone's package
  installed in it, where they are not, or where ``fresh`` asks for one (an
  auditor's rebuild);
* this environment as it is, for a project that uses reprotrain as a
  dependency (no ``src/reprotrain`` in it): its own code is the clone's, and
  the environment record it writes says which reprotrain and lock ran it.

Either way the env stage then records the lock's state, and the deciding
record is compared with the one that is being reproduced.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from reprotrain.commands._children import run_child
from reprotrain.commands._git import git
from reprotrain.pipeline.errors import DataError

#: The lock the env stage checks outside a container (dvc.yaml's default).
DEFAULT_LOCK = "requirements-cpu.lock"


def clone_at(source: str, commit: str, clone: Path) -> Path:
    """``source`` (a URL or a folder) cloned into ``clone`` and checked out at ``commit``."""
    git(Path.cwd(), "clone", "-q", "--no-checkout", source, str(clone))
    try:
        git(clone, "checkout", "-q", commit)
    except DataError:
        raise DataError(
            f"commit {commit[:12]} is not in {source}: give the repository that holds it (--repo)"
        ) from None
    return clone


def clone_environment(
    clone: Path, lock: str = DEFAULT_LOCK, fresh: bool = False, venv: Path | None = None
) -> dict[str, str]:
    """Variables under which ``dvc``/``reprotrain`` in ``clone`` run the clone's own code.

    ``venv``: where a fresh environment goes (default: the clone's ``.venv``); one that is
    there already, made from a lock of the same bytes, is brought up to the clone's lock and
    package (seconds) instead of made anew.
    """
    from reprotrain.pipeline.stages.env import NOT_LOCKED
    from reprotrain.provenance.environment import lock_status

    here = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    if not (clone / "src" / "reprotrain").is_dir():
        return here  # a project that uses reprotrain: its own code is the clone's (cwd)
    exact = (clone / lock).is_file() and lock_status(clone / lock, NOT_LOCKED)["exact"]
    if exact and not fresh:
        pythonpath = [str(clone / "src"), os.environ.get("PYTHONPATH", "")]
        return {**here, "PYTHONPATH": os.pathsep.join(filter(None, pythonpath))}
    return _fresh_venv(clone, lock, (venv or clone / ".venv").absolute())


def _fresh_venv(clone: Path, lock: str, venv: Path) -> dict[str, str]:
    """The clone's own ``make venv`` (its Makefile, its lock), with this Python's base."""
    print(f"reprotrain: installing the clone's {lock} and package into {venv}", flush=True)
    python = getattr(sys, "_base_executable", sys.executable)
    made = run_child(
        ["make", "-C", str(clone), "venv", f"PYTHON={python}", f"LOCK={lock}", f"VENV={venv}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")},
    )
    if made.returncode != 0:
        said = (made.stdout + made.stderr).strip().splitlines()[-3:]
        raise DataError(f"make venv in {clone} failed: {' / '.join(said)}")
    bin_dir = venv / "bin"
    variables = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return {**variables, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def python_of(variables: dict[str, str]) -> str:
    """The interpreter the first ``python`` on ``variables``' PATH is (a venv's, or this one)."""
    first = variables["PATH"].split(os.pathsep)[0]
    candidate = Path(first) / "python"
    return str(candidate) if candidate.exists() else sys.executable
