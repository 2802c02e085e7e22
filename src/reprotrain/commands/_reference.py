"""One verdict for a rerun of a committed reference: same outputs, same record, or neither.

``reprotrain verify --reference`` runs the pipeline once in a clone of a
revision and then asks git what changed. A change is one of two kinds:

* an *output*: the trained weights, trace, data, metrics or plots, i.e. any
  ``outs`` md5 in ``dvc.lock``, the output hashes in ``run.json``, or any
  other file git tracks;
* the *deciding record* only: the environment record (the cache key), the
  run ID and its inputs in ``run.json``, and what ``dvc.lock`` records of the
  inputs (each stage's command, params and deps' md5: e.g. a lock or the code
  changed since the reference was made).

Both kinds are read in every pipeline git holds (the root's ``dvc.yaml`` and those
in subfolders, as ``--all-pipelines`` runs them): each one's ``dvc.lock``, environment
record and run record, their paths resolved against each stage's ``wdir``.
:func:`classify_changes` splits ``git status`` into those two, so the verdict
is exactly one of: as committed (exit 0), the same outputs under a different
deciding record (exit 6, :data:`~reprotrain.commands._exit_codes.EXIT_RECORD_DIFFERS`,
naming the fields), or other
outputs (exit 1, naming them). No torch import.
"""

from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from reprotrain.commands._git import git, git_show
from reprotrain.pipeline.command import pipeline_stages, stage_arguments
from reprotrain.pipeline.errors import DataError
from reprotrain.provenance.envdiff import EnvDiff, InputDiff, compare_environments, compare_inputs


@dataclass
class ReferenceChanges:
    """What one rerun in a clone changed against the revision it was cloned at."""

    #: Outputs whose bytes differ: ``path`` or ``path: what``.
    outputs: list[str] = field(default_factory=list)
    #: Fields of the environment record that differ (committed -> fresh).
    environment: list[EnvDiff] = field(default_factory=list)
    #: Run inputs (run.json) that differ; they are why the run IDs differ.
    inputs: list[InputDiff] = field(default_factory=list)
    #: Inputs dvc.lock records differently (a dep's md5, a param, a command), one line each.
    lock_inputs: list[str] = field(default_factory=list)
    #: Files whose change is the record's only (the environment record, run.json, dvc.lock).
    record_files: list[str] = field(default_factory=list)

    @property
    def outputs_identical(self) -> bool:
        return not self.outputs

    @property
    def record_identical(self) -> bool:
        return not (self.environment or self.inputs or self.lock_inputs or self.record_files)

    def record_lines(self) -> list[str]:
        lines = [f"  environment {d.to_text()}" for d in self.environment]
        lines += [f"  run input {d.to_text()}" for d in self.inputs]
        lines += [f"  dvc.lock {line}" for line in self.lock_inputs]
        if not lines and self.record_files:
            lines.append(f"  (no field named; files: {', '.join(self.record_files)})")
        return lines


def _json(data: bytes | None) -> dict[str, Any]:
    try:
        value = json.loads(data) if data is not None else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


@dataclass(frozen=True)
class _Pipeline:
    """One ``dvc.yaml`` of the clone: its lock, each stage's ``wdir`` and its record files,
    all paths relative to the clone's root."""

    lock: str
    wdirs: dict[str, str]
    #: The env stage's environment record and the train stage's run record.
    environments: frozenset[str]
    runs: frozenset[str]

    def path(self, stage: str, path: str) -> str:
        """A path the lock names for ``stage`` (relative to its ``wdir``), from the root."""
        return posixpath.normpath(posixpath.join(self.wdirs.get(stage, self.wdirs[""]), path))


def tracked_pipelines(clone: Path) -> dict[str, _Pipeline]:
    """Every pipeline git holds in ``clone`` (the root's and those in subfolders, as
    ``dvc repro --all-pipelines`` runs them), by its ``dvc.lock`` path."""
    found: dict[str, _Pipeline] = {}
    for name in sorted(git(clone, "ls-files", "--", "dvc.yaml", "*/dvc.yaml").splitlines()):
        dvc_yaml = clone / name
        folder = posixpath.dirname(name)
        wdirs = {"": folder or "."}
        for stage, spec in pipeline_stages(dvc_yaml).items():
            wdirs[stage] = posixpath.normpath(posixpath.join(folder, str(spec.get("wdir", "."))))
        records: dict[str, set[str]] = {"out": set(), "run_record": set()}
        for stage, option in (("env", "out"), ("train", "run_record")):
            try:
                written = getattr(stage_arguments(stage, dvc_yaml), option)
            except DataError:  # no such stage here: a pipeline of other commands
                continue
            if written is not None:
                where = wdirs.get(stage, wdirs[""])
                records[option].add(posixpath.normpath(posixpath.join(where, written)))
        lock = posixpath.normpath(posixpath.join(folder, "dvc.lock"))
        found[lock] = _Pipeline(
            lock, wdirs, frozenset(records["out"]), frozenset(records["run_record"])
        )
    return found


def _lock_stages(data: bytes | None) -> dict[str, Any]:
    stages = (yaml.safe_load(data) or {}).get("stages", {}) if data else {}
    return stages if isinstance(stages, dict) else {}


def _lock_outs(data: bytes | None, pipeline: _Pipeline, skip: frozenset[str]) -> dict[str, Any]:
    """``{stage/path: md5}`` of every ``outs`` entry of a dvc.lock, but the paths in ``skip``."""
    return {
        f"{name}/{out['path']}": out.get("md5")
        for name, stage in _lock_stages(data).items()
        for out in stage.get("outs", [])
        if pipeline.path(name, out["path"]) not in skip
    }


def _lock_inputs(data: bytes | None, pipeline: _Pipeline, records: frozenset[str]) -> dict:
    """``{stage what: value}`` of a dvc.lock's commands, params and deps, but the record files.

    The record files' md5 among the deps follow from the record, compared on its own.
    """
    found: dict[str, Any] = {}
    for name, stage in _lock_stages(data).items():
        found[f"{name} cmd"] = stage.get("cmd")
        found[f"{name} params"] = stage.get("params")
        for dep in stage.get("deps", []):
            if pipeline.path(name, dep["path"]) not in records:
                found[f"{name} dep {dep['path']}"] = dep.get("md5")
    return found


def _unique(found: list[Any], more: list[Any]) -> None:
    """Extend ``found`` by what ``more`` says that it does not say yet (two pipelines'
    records differ in the same field: one line)."""
    said = {item.to_text() for item in found}
    found += [item for item in more if item.to_text() not in said]


def classify_changes(clone: Path, rev: str, changed: list[str]) -> ReferenceChanges:
    """Split the files a rerun in ``clone`` changed against ``rev`` into outputs and record,
    in every pipeline of the clone."""
    if not changed:  # nothing to split; the stages need not be the pipeline's
        return ReferenceChanges()
    pipelines = tracked_pipelines(clone)
    environments = frozenset().union(*(p.environments for p in pipelines.values()))
    runs = frozenset().union(*(p.runs for p in pipelines.values()))
    records = environments | runs
    found = ReferenceChanges()
    for path in changed:
        committed = git_show(clone, rev, path)
        fresh_file = clone / path
        fresh = fresh_file.read_bytes() if fresh_file.is_file() else None
        if path in environments:
            _unique(found.environment, compare_environments(_json(committed), _json(fresh)))
            found.record_files.append(path)
        elif path in runs:
            old, new = _json(committed), _json(fresh)
            _unique(found.inputs, compare_inputs(old.get("inputs", {}), new.get("inputs", {})))
            found.record_files.append(path)
            hashes = (old.get("outputs"), new.get("outputs"))
            if hashes[0] != hashes[1]:
                found.outputs.append(f"{path}: output hashes {hashes[0]} -> {hashes[1]}")
        elif (pipeline := pipelines.get(path)) is not None:
            found.record_files.append(path)
            old_outs = _lock_outs(committed, pipeline, records)
            new_outs = _lock_outs(fresh, pipeline, records)
            found.outputs += [
                f"{path}: {out} md5 {old_outs.get(out)} -> {new_outs.get(out)}"
                for out in sorted(set(old_outs) | set(new_outs))
                if old_outs.get(out) != new_outs.get(out)
            ]
            old_in = _lock_inputs(committed, pipeline, records)
            new_in = _lock_inputs(fresh, pipeline, records)
            where = "" if path == "dvc.lock" else f"{path} "
            found.lock_inputs += [
                f"{where}{key}: {old_in.get(key)!r} -> {new_in.get(key)!r}"
                for key in sorted(set(old_in) | set(new_in))
                if old_in.get(key) != new_in.get(key)
            ]
        elif committed is None:
            found.outputs.append(f"{path}: new, not at {rev}")
        elif committed != fresh:
            found.outputs.append(path)
    return found
