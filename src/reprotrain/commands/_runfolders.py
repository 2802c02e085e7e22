"""The run folders of ``verify -- CMD``: what may be compared, and what is left after.

A run's folder holds its output; a compared file must be inside it (an
``--output`` relative and never above ``{out}``; no link out of the folder, whose
target would be judged instead of what the run wrote). A verify never replaces
an earlier one's runs, nor starts beside them whatever their number
(:func:`refuse_earlier_runs` names all of them and the ``rm`` that deletes them), and
one that ends with no verdict removes what it made (:func:`discard`) unless a
failed run left something to read (:class:`RunFailed`'s ``evidence``). Names
are printed as stdout can encode them (:func:`printable`).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import sys
from pathlib import Path, PurePath
from typing import Any

from reprotrain.pipeline.errors import DataError

#: Written into ``--workdir`` when the runs proved identical: the command, where it ran and
#: at which commit, for ``reprotrain attest --verified``.
VERIFIED_FILE = "verified.json"


class RunFailed(DataError):
    """A run (or an ops rerun) that could not start or exited non-zero.

    ``evidence`` is what it left to look at: its log if it printed anything, else its
    folder if it wrote anything there, else None (nothing worth keeping); the message
    points to it.
    """

    def __init__(self, reason: str, log: Path, folder: Path, hint: str = "") -> None:
        self.reason, self.log, self.folder = reason, log, folder
        if holds_anything(log):
            self.evidence: Path | None = log
            where = f"; see {log}"
        elif holds_anything(folder):
            self.evidence = folder
            where = f"; what it wrote is in {folder}"
        else:
            self.evidence = None
            where = ""
        super().__init__(f"{reason}{where}{hint}")


def holds_anything(path: Path) -> bool:
    """A file that is not empty, or a folder with a file in it (at any depth)."""
    if path.is_file():
        return path.stat().st_size > 0
    return path.is_dir() and any(p.is_file() for p in path.rglob("*"))


def written_paths(workdir: Path, runs: int) -> list[Path]:
    """Every path verify writes in ``workdir``: runs, the two ops reruns, their logs."""
    names = [f"run-{i}" for i in range(runs)] + [f"run-{i}-ops" for i in range(2)]
    return [workdir / n for name in names for n in (name, f"{name}.log")] + [
        workdir / VERIFIED_FILE
    ]


def earlier_runs(workdir: Path) -> list[Path]:
    """What any earlier verify wrote in ``workdir``, whatever its ``--runs``: every ``run-N``
    and ``run-N.log``, the ops reruns and their logs, the verified record; in run order."""
    if not workdir.is_dir():
        return []
    found = [p for p in workdir.iterdir() if p.name == VERIFIED_FILE or _RUN_PATH.fullmatch(p.name)]
    return sorted(found, key=_run_order)


#: The names verify gives a run's folder and log (:func:`written_paths`), and the two ops reruns'.
_RUN_PATH = re.compile(r"run-(0|[1-9]\d*)(?:\.log)?|run-([01])-ops(?:\.log)?")


def _run_order(path: Path) -> tuple[int, bool, str]:
    """run-2 before run-10, a run's ops rerun after it; the verified record last."""
    if found := _RUN_PATH.fullmatch(path.name):
        return int(found.group(1) or found.group(2)), found.group(2) is not None, path.name
    return sys.maxsize, False, path.name


def refuse_earlier_runs(given: Path, workdir: Path) -> None:
    """Nothing of an earlier verify is replaced, nor left beside new runs (an earlier
    ``--runs 3``'s run-2): refused, naming every such path, so its ``rm`` clears the way."""
    if taken := earlier_runs(workdir):
        more = f" (and {', '.join(p.name for p in taken[1:])})" if taken[1:] else ""
        rm = shlex.join(["rm", "-r", *map(str, taken)])
        raise DataError(
            f"--workdir {given}: {taken[0].name} is already there from an earlier verify{more}; "
            f"verify never deletes earlier runs: delete them (`{rm}`) or name an empty or new "
            "folder"
        )


def missing_folders(folder: Path) -> list[Path]:
    """``folder`` and those of its parents not there yet, deepest first: what mkdir makes."""
    missing = []
    for path in (folder, *folder.parents):
        if path.exists() or path.is_symlink():
            break
        missing.append(path)
    return missing


def discard(workdir: Path, runs: int, made: list[Path], temporary: bool) -> None:
    """Remove what this verify made (it refused to start where any of it was there):
    a temporary folder whole; in ``--workdir`` the runs' paths, then the folders it made."""
    if temporary:
        shutil.rmtree(workdir, ignore_errors=True)
        return
    for path in written_paths(workdir, runs):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        elif path.exists() or path.is_symlink():
            path.unlink()
    for folder in made:  # deepest first; one the command wrote into stays
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()


def printable(value: Any, encoding: str | None = None) -> Any:
    """``value`` with every string printable in ``encoding`` (default: stdout's): a file
    name's bytes that are not UTF-8 (``os.fsdecode`` keeps them as surrogates) become
    ``\\xNN``, other characters it cannot encode backslash escapes; lists and dicts are
    walked (for --json, whose strings then stay valid JSON)."""
    encoding = encoding or getattr(sys.stdout, "encoding", None) or "utf-8"
    if isinstance(value, dict):
        return {printable(k, encoding): printable(v, encoding) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [printable(v, encoding) for v in value]
    if not isinstance(value, str):
        return value
    text = _UNDECODED.sub(lambda m: f"\\x{ord(m.group()) - 0xDC00:02x}", value)
    return text.encode(encoding, "backslashreplace").decode(encoding)


#: The surrogates ``os.fsdecode`` (surrogateescape) stands a byte that is not UTF-8 in for.
_UNDECODED = re.compile("[\udc80-\udcff]")


def refuse_outside_output(name: str) -> None:
    """An ``--output`` names a file under ``{out}``: relative, and never above it."""
    path = PurePath(name)
    if not path.parts or path.is_absolute() or ".." in path.parts:
        raise DataError(
            f"--output {name!r}: name a file the command writes under {{out}}, relative to "
            "that folder and inside it (no leading /, no ..), e.g. --output model.safetensors"
        )


def leads_outside(path: Path, folder: Path) -> Path | None:
    """Where ``path`` really is (links and ``..`` followed) when that is outside ``folder``."""
    # realpath, not Path.resolve: it returns a link loop as is instead of raising (Python 3.11)
    target = Path(os.path.realpath(path))
    return None if target.is_relative_to(os.path.realpath(folder)) else target


def refuse_links_out(name: str, paths: list[Path], folders: list[Path]) -> None:
    """A link out of its run's folder is not that run's output: comparing what it points at
    could call runs identical that wrote different bytes."""
    for index, (path, folder) in enumerate(zip(paths, folders, strict=True)):
        if (target := leads_outside(path, folder)) is not None:
            raise DataError(
                f"{path}: a link to {target}, outside run {index}'s folder, so not that run's "
                f"output; have the command write {name} itself under {{out}}, or name only "
                "the files it writes with --output"
            )
