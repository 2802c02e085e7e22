"""Run IDs and DVC checksums: the reproducibility contract, made checkable.

A run ID is the sha256 of the canonical JSON of everything that should decide
a run's bits: params, data checksums, the lock hash, the code, the
environment record, the determinism settings. The contract is "same run ID
=> same output hashes"; any single changed input gives another ID.

DVC records an md5 for every stage output in ``dvc.lock`` and for every
``dvc add``-ed file in its ``.dvc`` file. For files DVC 3 hashes the raw
bytes (``hash: md5``), so :func:`md5_file` reproduces its value and
:func:`verify_dvc_checksum` can refuse data that changed behind DVC's back.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from reprotrain.hashing import canonical_json

_CHUNK = 1 << 20


class ChecksumError(ValueError):
    """A file's bytes differ from the checksum DVC recorded for it."""


def run_id(inputs: Mapping[str, Any]) -> str:
    """sha256 of the canonical JSON of ``inputs``."""
    return hashlib.sha256(canonical_json(dict(inputs)).encode()).hexdigest()


def source_files(module: str) -> list[Path]:
    """The source files of ``module`` and of every module of its package it imports, transitively.

    Found statically (``import`` statements, including ones inside functions),
    so the answer does not depend on what happens to be loaded. This is the
    code a stage runs; ``dvc.yaml`` lists the same files as the stage's deps.
    """
    package = module.split(".")[0]
    root = Path(importlib.util.find_spec(package).origin).parent
    seen: dict[str, Path] = {}
    todo = [module]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        base = root.parent.joinpath(*name.split("."))
        path = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if not path.is_file():
            continue
        seen[name] = path
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                todo.extend(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                todo.append(node.module)
                todo.extend(f"{node.module}.{alias.name}" for alias in node.names)
        todo = [n for n in todo if n.split(".")[0] == package]
    return sorted(seen.values())


def code_hash(files: Iterable[Path], root: Path) -> str:
    """sha256 over the path (relative to ``root``) and bytes of each file, in path order."""
    digest = hashlib.sha256()
    for path in sorted(files):
        digest.update(f"{path.relative_to(root).as_posix()}\0".encode())
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


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
