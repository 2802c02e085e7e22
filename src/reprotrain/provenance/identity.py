"""Run IDs: the reproducibility contract, made checkable.

A run ID is the sha256 of the canonical JSON of everything that should decide
a run's bits: params, data checksums, the lock hash, the code, the
environment record, the determinism settings. The contract is "same run ID
=> same output hashes"; any single changed input gives another ID.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from reprotrain.hashing import canonical_json


def run_id(inputs: Mapping[str, Any]) -> str:
    """sha256 of the canonical JSON of ``inputs``."""
    return hashlib.sha256(canonical_json(dict(inputs)).encode()).hexdigest()


def source_files(module: str) -> list[Path]:
    """The source files of ``module`` and of every module of its package it imports, transitively.

    Found statically (``import`` statements, including ones inside functions),
    so the answer does not depend on what happens to be loaded; with each
    module its packages' ``__init__.py`` (Python runs them first). This is the
    code a stage runs; DVC sees exactly these files of the package
    (``.dvcignore`` hides the rest, tests/test_cache_key.py checks both ways).
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
        parents = [".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)]
        todo = [n for n in [*todo, *parents] if n.split(".")[0] == package]
    return sorted(seen.values())


def code_hash(files: Iterable[Path], root: Path) -> str:
    """sha256 over the path (relative to ``root``) and bytes of each file, in path order."""
    digest = hashlib.sha256()
    for path in sorted(files):
        digest.update(f"{path.relative_to(root).as_posix()}\0".encode())
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()
