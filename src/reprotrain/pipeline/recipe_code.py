"""The code that decides what a recipe's classes compute: the files the run ID hashes.

:func:`code_files` lists, for one resolved ``model`` or ``data`` section
(:class:`~reprotrain.pipeline.recipe.ResolvedComponent`), the source of the
package its class lives in and the files its ``code:`` list names. Code
installed in site-packages is pinned by the lock, whose hash is already a run
input, so it is not listed; code outside the repository, where DVC cannot
track it, is refused. :func:`compiling_code` finds whether that code calls
``torch.compile`` (the environment record then holds the C++ compiler). No
jsonargparse here: the run record imports it.
"""

from __future__ import annotations

import importlib.util
import site
import sysconfig
from pathlib import Path
from typing import TYPE_CHECKING

from reprotrain.pipeline.config import Component, ConfigError, Params
from reprotrain.provenance.identity import source_files
from reprotrain.provenance.toolchain import calls_compile

if TYPE_CHECKING:
    from reprotrain.pipeline.recipe import ResolvedComponent


def code_files(component: ResolvedComponent, root: Path | None = None) -> list[Path]:
    """The files whose bytes decide what ``component`` computes, sorted.

    Every ``.py`` under the top-level package its class lives in (the module
    alone when it is not in a package; for a namespace package, one without an
    ``__init__.py``, its folders inside the repository); for ``reprotrain``'s own classes, the
    module's import closure, the rule the stages' own code hash follows; none
    for a class installed in site-packages (the lock pins it). Then each entry
    of the section's ``code:`` list, relative to ``root`` (the repository root,
    where DVC runs the stages; the working directory by default): a file, or
    every file under a folder.
    """
    root = Path.cwd() if root is None else root
    top = component.cls.__module__.split(".")[0]
    files: set[Path] = set()
    if top == "reprotrain":
        files.update(source_files(component.cls.__module__))
    else:
        spec = importlib.util.find_spec(top)
        origin = Path(spec.origin) if spec and spec.origin else None
        if origin is not None and origin.is_file() and not _installed(origin):
            _refuse_outside(component, origin, root)
            if spec.submodule_search_locations:
                for folder in spec.submodule_search_locations:
                    files.update(_tree(Path(folder), "*.py"))
            else:
                files.add(origin.resolve())
        elif spec is not None and spec.submodule_search_locations:  # a namespace package:
            for folder in map(Path, spec.submodule_search_locations):  # no __init__.py
                if not _installed(folder):
                    _refuse_outside(component, folder, root)
                    files.update(_tree(folder, "*.py"))
    for index, entry in enumerate(component.code):
        path = root / entry
        if path.is_file():
            files.add(path.resolve())
        elif path.is_dir():
            files.update(_tree(path, "*"))
        else:
            raise ConfigError(
                f"{component.key}.code[{index}]: {entry!r} not found under {root}; list paths "
                "relative to the repository root"
            )
    return sorted(files)


def _tree(folder: Path, pattern: str) -> list[Path]:
    """Files under ``folder`` matching ``pattern``, less bytecode caches."""
    return [
        path.resolve()
        for path in folder.rglob(pattern)
        if path.is_file() and "__pycache__" not in path.parts
    ]


def _refuse_outside(component: ResolvedComponent, source: Path, root: Path) -> None:
    """Refuse code of ``component`` that is not installed and lies outside the repository."""
    if not source.resolve().is_relative_to(root.resolve()):
        raise ConfigError(
            f"{component.key}.class_path: {component.class_path} comes from {source}, "
            f"outside the repository ({root}), where DVC cannot track it; move its "
            "package into the repository, or install it from the lock"
        )


def _installed(path: Path) -> bool:
    """Whether ``path`` lies in a site-packages folder (so the lock pins it)."""
    folders = {sysconfig.get_paths()[name] for name in ("purelib", "platlib")}
    folders.update(site.getsitepackages())
    folders.add(site.getusersitepackages())
    resolved = path.resolve()
    return any(resolved.is_relative_to(Path(folder).resolve()) for folder in folders)


def compiling_code(params: Params, root: Path | None = None) -> list[str]:
    """Where the recipe's model or data code calls ``torch.compile`` (``file:line``), or [].

    Found without importing anything (the environment stage runs in a second): the
    module ``class_path`` names, every ``.py`` of its top-level package when that is
    the user's own (for ``reprotrain``'s recipes, the class alone: its module holds
    the recipe's other class, and the library calls no compile), and the ``code:``
    entries. A component whose ``init_args`` sets ``compile: false`` says itself that
    it does not compile (the LM recipe's option), so its calls do not count.
    """
    root = Path.cwd() if root is None else root
    found: list[str] = []
    for component in (params.model, params.data):
        if component is None or component.init_args.get("compile") is False:
            continue
        own = component.class_path.split(".")[0] == "reprotrain"
        within = component.class_path.rpartition(".")[2] if own else None
        found.extend(calls_compile(_scanned(component), within))
        found.extend(calls_compile(_listed(component, root)))
    return found


def _scanned(component: Component) -> list[Path]:
    """The ``.py`` files of the module or package :func:`compiling_code` reads."""
    module = component.class_path.rpartition(".")[0]
    top = module.split(".")[0]
    files: list[Path] = []
    try:
        spec = importlib.util.find_spec(module if top == "reprotrain" else top)
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        if top == "reprotrain" and spec.origin:
            files.append(Path(spec.origin))
        elif spec.submodule_search_locations:
            for folder in map(Path, spec.submodule_search_locations):
                if not _installed(folder):
                    files.extend(_tree(folder, "*.py"))
        elif spec.origin and Path(spec.origin).is_file() and not _installed(Path(spec.origin)):
            files.append(Path(spec.origin))
    return sorted(set(files))


def _listed(component: Component, root: Path) -> list[Path]:
    """The ``.py`` files of the component's ``code:`` entries (a missing one: none here)."""
    files: list[Path] = []
    for entry in component.code:
        path = root / entry
        files.extend([path] if path.is_file() else _tree(path, "*.py") if path.is_dir() else [])
    return sorted(set(files))
