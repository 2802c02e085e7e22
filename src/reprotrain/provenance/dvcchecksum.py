"""DVC's checksums, read back: refuse data that changed behind DVC's back.

DVC records an md5 for every stage output in ``dvc.lock`` and for every
``dvc add``-ed file in its ``.dvc`` file. For files DVC 3 hashes the raw
bytes (``hash: md5``), so :func:`md5_file` reproduces its value and
:func:`verify_dvc_checksum` can refuse data that changed behind DVC's back.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

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


def dvc_recorded_md5(path: str | Path, dvc_lock: str | Path) -> str | None:
    """The md5 DVC recorded for ``path``: a stage output in ``dvc_lock``, or a ``.dvc`` file.

    Paths in ``dvc.lock`` are relative to its folder; ``path`` may be relative
    to the working directory or absolute. None when DVC has no record.
    """
    target = Path(path).resolve()
    lock = Path(dvc_lock)
    if lock.is_file():
        stages = (yaml.safe_load(lock.read_text()) or {}).get("stages", {})
        for stage in stages.values():
            for out in stage.get("outs", []):
                if (lock.parent / out["path"]).resolve() == target and "md5" in out:
                    return out["md5"]
    sidecar = target.with_name(target.name + ".dvc")
    if sidecar.is_file():
        for out in (yaml.safe_load(sidecar.read_text()) or {}).get("outs", []):
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
    stages = (yaml.safe_load(lock.read_text()) or {}).get("stages", {})
    return any(
        (lock.parent / dep["path"]).resolve() == target
        for stage in stages.values()
        for dep in stage.get("deps", [])
    )


def verify_dvc_checksum(path: str | Path, dvc_lock: str | Path) -> tuple[str, str | None]:
    """``(actual md5, recorded md5 or None)``; raises :class:`ChecksumError` on a mismatch."""
    actual = md5_file(path)
    recorded = dvc_recorded_md5(path, dvc_lock)
    if recorded is not None and recorded != actual:
        raise ChecksumError(
            f"{path}: md5 {actual} does not match {recorded} recorded by DVC; the file "
            "changed outside the pipeline: restore it with `dvc checkout` or rerun `dvc repro`"
        )
    return actual, recorded
