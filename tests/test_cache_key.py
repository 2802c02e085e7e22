"""Only code that decides the bits is in the cache key: DVC's deps and the run ID's code hash.

The stages depend on ``src/reprotrain``; ``.dvcignore`` hides what no stage
runs (commands, the CLI, the op recorder, the comparisons), and the run ID
hashes the files each stage imports (provenance.identity.source_files) and
those of the built-in recipe params.yaml names (pipeline.recipe_code.code_files).
The two must agree, so an edit to a debugging tool neither reruns ``dvc repro``
nor moves the run ID, and an edit to the model does both.
"""

from __future__ import annotations

import json
from pathlib import Path

import pathspec
import yaml

from reprotrain.provenance.identity import source_files
from tests.helpers import ROOT, run_checked, run_cli

PACKAGE = ROOT / "src" / "reprotrain"
STAGES = ("env", "prepare", "train", "evaluate")


def _dvc_sees(path: Path) -> bool:
    """A package file inside some stage's deps and not hidden by .dvcignore."""
    ignore = pathspec.PathSpec.from_lines(
        "gitignore", (ROOT / ".dvcignore").read_text().splitlines()
    )
    relative = path.relative_to(ROOT).as_posix()
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    deps = {dep for spec in stages.values() for dep in spec.get("deps", [])}
    inside = any(relative == dep or relative.startswith(f"{dep}/") for dep in deps)
    return inside and not ignore.match_file(relative)


#: The params files of the repository's pipelines: the recipes they name are run too.
PARAMS_FILES = (ROOT / "params.yaml", ROOT / "pipelines" / "lm" / "params.yaml")


def _run_by_a_stage() -> set[Path]:
    from reprotrain.pipeline.params_file import load_params
    from reprotrain.pipeline.recipe import resolve_recipe
    from reprotrain.pipeline.recipe_code import code_files

    stages = {
        path for stage in STAGES for path in source_files(f"reprotrain.pipeline.stages.{stage}")
    }
    recipes = [resolve_recipe(load_params(path)) for path in PARAMS_FILES]
    return stages | {
        path for recipe in recipes for c in (recipe.model, recipe.data) for path in code_files(c)
    }


def _seen_but_never_run(files: list[Path]) -> list[str]:
    run = _run_by_a_stage()
    return sorted(str(f.relative_to(PACKAGE)) for f in files if _dvc_sees(f) and f not in run)


def _package_files() -> list[Path]:
    return [p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts]


def test_dvc_sees_exactly_the_package_files_some_stage_runs() -> None:
    assert _seen_but_never_run(_package_files()) == []
    hidden = sorted(str(f.relative_to(PACKAGE)) for f in _run_by_a_stage() if not _dvc_sees(f))
    assert hidden == []


def test_a_module_no_stage_runs_but_dvc_sees_is_caught() -> None:
    """Negative control: a new library module outside .dvcignore would rerun training."""
    planted = PACKAGE / "trace" / "planted.py"
    assert _seen_but_never_run([*_package_files(), planted]) == ["trace/planted.py"]


def test_the_recorder_and_the_commands_are_outside_the_train_stage_code() -> None:
    train = {str(f.relative_to(PACKAGE)) for f in source_files("reprotrain.pipeline.stages.train")}
    assert "pipeline/recipe.py" in train and "trace/callback.py" in train
    assert not any(f.startswith(("ops/", "commands/", "compare/")) for f in train), train
    assert "distributed/__init__.py" in train  # a package's __init__ runs before its modules


def _run_id(repo: Path) -> str:
    result = run_cli("run-id", cwd=repo, PYTHONPATH=str(repo / "src"))
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.strip().splitlines()[-1]


def _train_is_stale(repo: Path) -> bool:
    out = run_checked("dvc", "status", "--json", "train", cwd=repo)
    return "train" in json.loads(out or "{}")


def test_an_edit_reruns_training_and_moves_the_run_id_only_where_it_decides_the_bits(
    repo_copy: Path,
) -> None:
    before = _run_id(repo_copy)
    assert not _train_is_stale(repo_copy)
    tools = [
        "src/reprotrain/commands/compare.py",
        "src/reprotrain/ops/recorder.py",
        "src/reprotrain/trace/diff.py",
        "benchmarks/overhead/trace_overhead.py",
    ]
    for name in tools:
        with (repo_copy / name).open("a") as f:
            f.write("\n# an edit to a tool that observes the bits\n")
    assert not _train_is_stale(repo_copy)
    assert _run_id(repo_copy) == before
    model = repo_copy / "src" / "reprotrain" / "recipes" / "digits.py"
    original = model.read_text()
    model.write_text(original + "\n# an edit to code that decides the bits\n")
    assert _train_is_stale(repo_copy)
    assert _run_id(repo_copy) != before
    model.write_text(original)
    assert not _train_is_stale(repo_copy)
    assert _run_id(repo_copy) == before
