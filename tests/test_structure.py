"""Guards for hand-kept links: layering, dvc.yaml vs the stage modules, the lock file."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest
import yaml

from tests.helpers import ROOT

SRC = ROOT / "src"
LIBRARY = ("reprotrain.determinism", "reprotrain.hashing", "reprotrain.atomic")
STAGES = ("prepare", "train", "evaluate")


def _module_path(name: str) -> Path:
    base = SRC.joinpath(*name.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def _direct_imports(name: str) -> set[str]:
    tree = ast.parse(_module_path(name).read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return {n for n in found if n.split(".")[0] == "reprotrain"}


def _closure(name: str) -> set[str]:
    seen, todo = set(), [name]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        todo.extend(_direct_imports(current))
    return seen


@pytest.mark.parametrize("module", LIBRARY)
def test_library_does_not_import_the_pipeline(module: str) -> None:
    leaked = {
        m for m in _closure(module) if m.startswith(("reprotrain.pipeline", "reprotrain.cli"))
    }
    assert not leaked, f"{module} imports {leaked}"


def _dvc_stages() -> dict:
    return yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]


@pytest.mark.parametrize("stage", STAGES)
def test_dvc_yaml_params_are_exactly_what_the_stage_reads(stage: str) -> None:
    declared = tuple(_dvc_stages()[stage].get("params", ()))
    module = importlib.import_module(f"reprotrain.pipeline.{stage}")
    assert declared == module.PARAMS


@pytest.mark.parametrize("stage", STAGES)
def test_dvc_yaml_deps_cover_every_module_the_stage_imports(stage: str) -> None:
    spec = _dvc_stages()[stage]
    assert spec["cmd"].startswith(f"reprotrain {stage} ")
    needed = {
        str(_module_path(m).relative_to(ROOT))
        for m in _closure(f"reprotrain.pipeline.{stage}")
        if _module_path(m).name != "__init__.py"
    }
    missing = needed - set(spec["deps"])
    assert not missing, f"dvc.yaml stage {stage!r} lacks deps {sorted(missing)}"


def test_cpu_lock_pins_every_package_with_a_hash_and_no_local_paths() -> None:
    text = (ROOT / "requirements-cpu.lock").read_text()
    pins = re.findall(
        r"^([A-Za-z0-9_.\-]+)==(\S+) \\\n((?:\s+--hash=sha256:[0-9a-f]{64}.*\n)+)", text, re.M
    )
    requirement_lines = [line for line in text.splitlines() if re.match(r"^[A-Za-z0-9]", line)]
    assert len(pins) == len(requirement_lines) > 50
    assert dict((n.lower(), v) for n, v, _ in pins)["torch"] == "2.13.0+cpu"
    for forbidden in ("file://", "/opt/", "--find-links", "--index-url", "--extra-index-url"):
        assert forbidden not in text


def test_requirements_in_direct_dependencies_are_in_the_lock() -> None:
    lock = (ROOT / "requirements-cpu.lock").read_text().lower()
    for line in (ROOT / "requirements.in").read_text().splitlines():
        name = re.split(r"[<>=!~\[ ]", line.strip(), maxsplit=1)[0].lower()
        if name and not name.startswith("#"):
            assert f"\n{name}==" in f"\n{lock}", name
