"""DVC's checksums, read back: refuse data that changed behind DVC's back.

DVC records an md5 for every stage output in ``dvc.lock`` and for every
``dvc add``-ed file in its ``.dvc`` file. For files DVC 3 hashes the raw
bytes (``hash: md5``), so :func:`md5_file` reproduces its value and
:func:`verify_dvc_checksum` can refuse data that changed behind DVC's back.

For a folder (a shard folder, docs/data.md) DVC records ``<md5>.dir``: the md5
of its listing, the JSON list of ``{"md5": <file's md5>, "relpath": <posix
path>}`` sorted by path (dvc-data's ``Tree.as_bytes``), which :func:`md5_dir`
reproduces. The listing itself is in DVC's cache (``.dvc/cache/files/md5/``),
so a folder that differs is refused naming the file that differs, when the
cache holds it (:func:`dvc_dir_listing`).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import yaml

_CHUNK = 1 << 20


class ChecksumError(ValueError):
    """A file's bytes differ from the checksum DVC recorded for it."""


def md5_file(path: str | Path) -> str:
    """Hex md5 of a file's bytes, as DVC 3 records it."""
    digest = hashlib.md5(usedforsecurity=False)
    with Path(path).open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def dir_listing(path: str | Path) -> dict[str, str]:
    """``{relative posix path: md5}`` of every file under the folder ``path``."""
    root = Path(path)
    listing = {}
    for folder, _, files in os.walk(root):
        for name in files:
            file = Path(folder) / name
            listing[file.relative_to(root).as_posix()] = md5_file(file)
    return listing


def listing_md5(listing: dict[str, str]) -> str:
    """DVC's ``<md5>.dir`` value of a folder with this listing (module doc)."""
    entries = [{"md5": md5, "relpath": relpath} for relpath, md5 in sorted(listing.items())]
    text = json.dumps(entries, sort_keys=True).encode("utf-8")
    return hashlib.md5(text, usedforsecurity=False).hexdigest() + ".dir"


def md5_dir(path: str | Path) -> str:
    """DVC's ``<md5>.dir`` checksum of the folder ``path`` (every file's bytes and path)."""
    return listing_md5(dir_listing(path))


def dvc_dir_listing(recorded: str, dvc_lock: str | Path) -> dict[str, str] | None:
    """The listing DVC cached for the folder checksum ``recorded`` (``{relpath: md5}``).

    Looked up in the default cache of the repository holding ``dvc_lock``
    (DVC 3's ``.dvc/cache/files/md5/``); None when it is not there.
    """
    digest = recorded.removesuffix(".dir")
    for parent in Path(dvc_lock).resolve().parents:
        cached = parent / ".dvc" / "cache" / "files" / "md5" / digest[:2] / f"{digest[2:]}.dir"
        if cached.is_file():
            try:
                entries = json.loads(cached.read_text(encoding="utf-8"))
                return {entry["relpath"]: entry["md5"] for entry in entries}
            except (OSError, ValueError, KeyError, TypeError):
                return None
        if (parent / ".dvc").is_dir():
            return None
    return None


def dvc_recorded_md5(path: str | Path, dvc_lock: str | Path) -> str | None:
    """The md5 DVC recorded for ``path``: a stage output in ``dvc_lock``, or a ``.dvc`` file.

    Paths in ``dvc.lock`` are relative to its folder; ``path`` may be relative
    to the working directory or absolute. None when DVC has no record.
    """
    target = Path(path).resolve()
    lock = Path(dvc_lock)
    if lock.is_file():
        for out in recorded_entries(lock):
            if (lock.parent / out["path"]).resolve() == target and "md5" in out:
                return out["md5"]
    sidecar = target.with_name(target.name + ".dvc")
    if sidecar.is_file():
        fix = "restore it from git, or `dvc add` the file again"
        for out in recorded_entries(sidecar, fix, lock=False):
            if (sidecar.parent / out["path"]).resolve() == target and "md5" in out:
                return out["md5"]
    return None


def dvc_lists_dependency(path: str | Path, dvc_lock: str | Path) -> bool:
    """Whether some stage in ``dvc_lock`` lists ``path`` among its deps.

    Such a file is a source DVC watches (it reruns the stage when the file
    changes), not an output it recorded: its md5 there is the previous run's,
    so it is not a checksum to hold the file to.
    """
    target = Path(path).resolve()
    lock = Path(dvc_lock)
    if not lock.is_file():
        return False
    return any(
        (lock.parent / dep["path"]).resolve() == target
        for dep in recorded_entries(lock, key="deps")
    )


#: What to do about a ``dvc.lock`` DVC would not have written.
LOCK_FIX = "restore it from git or rerun `dvc repro`"


def recorded_entries(
    file: Path, fix: str = LOCK_FIX, *, lock: bool = True, key: str = "outs"
) -> list[dict[str, Any]]:
    """The ``key`` entries (``outs`` or ``deps``) of a ``dvc.lock`` (``lock``: under each
    stage) or of a ``.dvc`` file, each ``path`` relative to the file's folder: DVC writes a
    lock's paths relative to each stage's ``wdir``, which the ``dvc.yaml`` beside it names
    (``wdir: ../..`` in a subfolder's pipeline).

    A file DVC would not have written (bad YAML, a list, a stage with no mapping, an
    entry with no path) is one :class:`ChecksumError` that names it, with ``fix``.
    """
    try:
        spec = yaml.safe_load(file.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        mark = getattr(err, "problem_mark", None)
        raise ChecksumError(
            f"{file}: not valid YAML{f' (line {mark.line + 1})' if mark else ''}; {fix}"
        ) from None
    if spec is None:
        return []
    if not isinstance(spec, dict):
        raise ChecksumError(f"{file}: expected a mapping at the top level; {fix}")
    stages = (spec.get("stages") or {}) if lock else {None: spec}
    if not isinstance(stages, dict):
        raise ChecksumError(f"{file}: `stages` is not a mapping of stage names; {fix}")
    wdirs = _stage_wdirs(file.with_name("dvc.yaml")) if lock else {}
    records: list[dict[str, Any]] = []
    for name, stage in stages.items():
        where = f"{file}: stage {name!r}" if lock else str(file)
        if not isinstance(stage, dict):
            raise ChecksumError(f"{where} is not a mapping (outs, deps, ...); {fix}")
        entries = stage.get(key) or []
        if not isinstance(entries, list) or not all(
            isinstance(entry, dict) and isinstance(entry.get("path"), str) for entry in entries
        ):
            raise ChecksumError(f"{where}: `{key}` is not a list of entries with a path; {fix}")
        wdir = wdirs.get(name, ".")
        records += [{**e, "path": os.path.normpath(Path(wdir) / e["path"])} for e in entries]
    return records


def _stage_wdirs(dvc_yaml: Path) -> dict[str, str]:
    """Each stage's ``wdir`` in ``dvc_yaml`` (none given: its folder); none for a file that
    cannot be read (DVC would refuse it before any stage runs)."""
    try:
        stages = (yaml.safe_load(dvc_yaml.read_text(encoding="utf-8")) or {}).get("stages")
    except (OSError, UnicodeDecodeError, yaml.YAMLError, AttributeError):
        return {}
    if not isinstance(stages, dict):
        return {}
    return {
        str(name): str(stage.get("wdir", "."))
        for name, stage in stages.items()
        if isinstance(stage, dict) and "${" not in str(stage.get("wdir", "."))
    }


def verify_dvc_checksum(path: str | Path, dvc_lock: str | Path) -> tuple[str, str | None]:
    """``(actual md5, recorded md5 or None)``; raises :class:`ChecksumError` on a mismatch.

    ``path`` may be a folder: its message then names the files that differ from
    DVC's cached listing (the first three), when the cache has it.
    """
    if Path(path).is_dir():
        return _verify_dir(Path(path), dvc_lock)
    actual = md5_file(path)
    recorded = dvc_recorded_md5(path, dvc_lock)
    if recorded is not None and recorded != actual:
        raise ChecksumError(
            f"{path}: md5 {actual} does not match {recorded} recorded by DVC; the file "
            "changed outside the pipeline: restore it with `dvc checkout` or rerun `dvc repro`"
        )
    return actual, recorded


def _verify_dir(path: Path, dvc_lock: str | Path) -> tuple[str, str | None]:
    listing = dir_listing(path)
    actual, recorded = listing_md5(listing), dvc_recorded_md5(path, dvc_lock)
    if recorded is None or recorded == actual:
        return actual, recorded
    cached = dvc_dir_listing(recorded, dvc_lock) or {}
    changed = sorted(n for n in set(listing) | set(cached) if listing.get(n) != cached.get(n))
    if not cached or not changed:
        where = "(DVC's cache has no listing of it to say which file)"
    else:
        state = {n: "missing" if n not in listing else "added" if n not in cached else "altered"
                 for n in changed[:3]}  # fmt: skip
        states = [f"{path / name} ({what})" for name, what in state.items()]
        more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        where = f"changed: {', '.join(states)}{more}"
    raise ChecksumError(
        f"{path}: folder md5 {actual} does not match {recorded} recorded by DVC, {where}; "
        "it changed outside the pipeline: restore it with `dvc checkout` or rerun `dvc repro`"
    )
