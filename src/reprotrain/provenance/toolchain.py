"""What decides a ``torch.compile``'d program's bits on a CPU, and whether a recipe compiles.

Inductor, ``torch.compile``'s default backend, turns a graph into C++ that the
host's C++ compiler builds (``g++`` unless ``CXX`` names another). Its bits follow:

* torch itself (the code Inductor writes; already in the record);
* the vector instruction set it writes for (``cpu_vec_isa``): it follows
  ``ATEN_CPU_CAPABILITY``, so the portable profile's AVX2 pin holds it too, and
  under ``native`` the CPU's flags, which the record then holds;
* the ``-march`` it compiles with (``TORCHINDUCTOR_CPP_MARCH``, else ``native``,
  which enables whatever the host has): the portable profile pins ``x86-64-v3``;
* the C++ compiler's identity and version (:func:`cxx_identity`): Inductor
  builds with ``-ffp-contract=off`` and without unsafe math, so a compiler should
  not reorder float arithmetic, but no test here has shown two compilers agree,
  so a compiling recipe's record holds it;
* Inductor's settings that change numerics, set in code (the run ID hashes the
  code) or through ``TORCHINDUCTOR_*`` variables (:func:`inductor_variables`).

Inductor's caches (``TORCHINDUCTOR_CACHE_DIR``) are left out of the record: a warm
cache gives a cold one's bits (tests/test_compiled.py), once :func:`keyed_cache_dir`
gives each torch build and compiler a folder of its own. Inductor's own key for a
kernel's shared library is its C++ source and compile command: neither the headers
of the torch that wrote it nor the compiler's version. A torch replaced at the same
path (a rebuilt venv or image) loaded 18 of 24 kernels another torch had built
(``benchmarks/cpu/inductor_cache_reuse.py``). Nothing here imports torch: the
environment stage runs in a second without it.
"""

from __future__ import annotations

import ast
import getpass
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

#: Inductor's variables that name places or switch on logging, not what the code computes.
NOT_DECIDING = frozenset(
    {"TORCHINDUCTOR_CACHE_DIR", "TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_AUTOGRAD_CACHE"}
    | {"TORCHINDUCTOR_COMPILE_THREADS", "TORCHINDUCTOR_TRACE", "TORCHINDUCTOR_DEBUG"}
)
INDUCTOR_PREFIX = "TORCHINDUCTOR_"
#: The Debian package that gives Inductor its default compiler.
CXX_PACKAGE = "g++"


def cxx_name(environ: Mapping[str, str] = os.environ) -> str:
    """The C++ compiler Inductor calls: ``CXX``, else ``g++`` (Inductor's default on Linux)."""
    return environ.get("CXX") or "g++"


def cxx_identity(environ: Mapping[str, str] = os.environ) -> str:
    """The compiler's first ``--version`` line (``g++ (Debian 12.2.0-14+deb12u1) 12.2.0``),
    or ``missing: NAME``."""
    name = cxx_name(environ)
    if shutil.which(name) is None:
        return f"missing: {name}"
    try:
        done = subprocess.run(
            [name, "--version"], capture_output=True, text=True, timeout=30, check=True
        )
    except (OSError, subprocess.SubprocessError) as err:
        return f"unusable: {name} ({err})"
    return done.stdout.splitlines()[0].strip() if done.stdout.strip() else f"unknown: {name}"


def inductor_variables(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The ``TORCHINDUCTOR_*`` variables set here that can change the compiled code."""
    return {
        name: value
        for name, value in sorted(environ.items())
        if name.startswith(INDUCTOR_PREFIX) and name not in NOT_DECIDING
    }


def compile_record(environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """The compile section of a compiling recipe's environment record: the compiler, the
    ``-march`` and vector level Inductor builds for, and its numerics-changing variables."""
    return {
        "cxx": cxx_identity(environ),
        "march": environ.get("TORCHINDUCTOR_CPP_MARCH") or "native",
        "vector_isa": environ.get("ATEN_CPU_CAPABILITY") or "the CPU's best (cpu.flags)",
        "inductor_variables": inductor_variables(environ),
    }


def missing_compiler(environ: Mapping[str, str] = os.environ) -> str | None:
    """One line when Inductor's C++ compiler is not on PATH, else None."""
    name = cxx_name(environ)
    if shutil.which(name) is not None:
        return None
    named = f"CXX={name}" if environ.get("CXX") else f"{name} (Inductor's default)"
    return (
        f"the model calls torch.compile, whose CPU backend (Inductor) builds C++ with {named}, "
        f"and it is not on PATH; install it (apt-get install {CXX_PACKAGE}), set CXX to a C++ "
        "compiler, or train uncompiled"
    )


#: The start of the folder :func:`keyed_cache_dir` names in Inductor's cache, and its name.
CACHE_FOLDER_PREFIX = "reprotrain-"
CACHE_FOLDER = re.compile(re.escape(CACHE_FOLDER_PREFIX) + "[0-9a-f]{16}")


def keyed_cache_dir(environ: Mapping[str, str] = os.environ) -> str:
    """Inductor's cache folder for this torch build and C++ compiler: a folder
    ``reprotrain-<key>`` in ``TORCHINDUCTOR_CACHE_DIR`` (else Inductor's default,
    ``/tmp/torchinductor_<user>``), the key over torch's ``version.py`` (its version, git
    commit and CUDA) and :func:`cxx_identity`. Idempotent: a folder this function named
    (for this build, or in a parent process for another) is replaced, not nested."""
    base = Path(environ.get("TORCHINDUCTOR_CACHE_DIR") or _inductor_default_cache_dir())
    base = Path(os.path.abspath(base))  # noqa: PTH100 - as Inductor does: no symlinks resolved
    if CACHE_FOLDER.fullmatch(base.name):
        base = base.parent
    digest = hashlib.sha256(_torch_build_id() + cxx_identity(environ).encode())
    return str(base / (CACHE_FOLDER_PREFIX + digest.hexdigest()[:16]))


def _torch_build_id() -> bytes:
    """torch's ``version.py`` (version, git commit, CUDA), read without importing torch."""
    spec = importlib.util.find_spec("torch")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / "version.py"
        if path.is_file():
            return path.read_bytes()
    return b"no torch"


def _inductor_default_cache_dir() -> str:
    """Inductor's default (``cache_dir_utils.default_cache_dir``), without importing it."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    return str(Path(tempfile.gettempdir()) / ("torchinductor_" + user))


def calls_compile(files: Iterable[Path], within: str | None = None) -> list[str]:
    """Where the code in ``files`` calls ``torch.compile(...)`` or a module's ``.compile()``,
    as ``file:line``; a file that does not parse counts as not compiling. With ``within``,
    only inside the top-level class of that name (a module holding several recipes).

    ``X.compile(...)`` with no positional argument is ``nn.Module.compile`` (in place),
    so ``re.compile(pattern)`` and ``builtins.compile(source, ...)`` do not count.
    """
    found = []
    for path in files:
        if path.suffix != ".py":
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        roots: list[ast.AST] = [tree]
        if within is not None:
            roots = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == within]
        for node in (inner for root in roots for inner in ast.walk(root)):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            if node.func.attr != "compile":
                continue
            owner = node.func.value
            if (isinstance(owner, ast.Name) and owner.id == "torch") or not node.args:
                found.append(f"{path}:{node.lineno}")
    return found
