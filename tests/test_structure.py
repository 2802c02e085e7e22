"""Guards for hand-kept links: layering, dvc.yaml vs the stage modules, the lock file."""

from __future__ import annotations

import importlib
import re

import pytest
import yaml

from reprotrain.provenance import source_files
from tests.helpers import ROOT

SRC = ROOT / "src"
LIBRARY = (
    "reprotrain.determinism",
    "reprotrain.hashing",
    "reprotrain.atomic",
    "reprotrain.environment",
    "reprotrain.envdiff",
    "reprotrain.provenance",
    "reprotrain.resume",
    "reprotrain.trace",
    "reprotrain.compare",
    "reprotrain.locate",
    "reprotrain.nondeterminism",
    "reprotrain.opcatalog",
)
STAGES = ("prepare", "train", "evaluate")


@pytest.mark.parametrize("module", LIBRARY)
def test_library_does_not_import_the_pipeline(module: str) -> None:
    files = [f.relative_to(SRC).as_posix() for f in source_files(module)]
    leaked = [f for f in files if f.startswith(("reprotrain/pipeline/", "reprotrain/cli.py"))]
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
    # The run ID hashes exactly these files (run_record.run_inputs), so DVC must track them.
    needed = {str(f.relative_to(ROOT)) for f in source_files(f"reprotrain.pipeline.{stage}")}
    listed = {dep for dep in spec["deps"] if dep.startswith("src/")}
    assert listed == needed, f"dvc.yaml stage {stage!r}: deps {sorted(listed ^ needed)} differ"


def test_env_stage_runs_on_every_repro_and_feeds_train() -> None:
    stages = _dvc_stages()
    assert stages["env"]["always_changed"] is True
    env_out = next(iter(stages["env"]["outs"][0]))
    assert env_out in stages["train"]["deps"]


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


def _pins(lock: str) -> dict[str, str]:
    text = (ROOT / lock).read_text()
    return {n.lower(): v for n, v in re.findall(r"^([A-Za-z0-9_.\-]+)==(\S+) \\$", text, re.M)}


def test_container_lock_is_the_cuda_build_with_every_wheel_hashed() -> None:
    text = (ROOT / "requirements.lock").read_text()
    pins = _pins("requirements.lock")
    assert pins["torch"] == "2.13.0"
    assert {"triton", "nvidia-cudnn-cu13", "nvidia-cublas", "nvidia-nccl-cu13"} <= set(pins)
    blocks = re.findall(
        r"^[A-Za-z0-9][^\n]*==[^\n]*\\\n((?:\s+--hash=sha256:[0-9a-f]{64}.*\n)+)", text, re.M
    )
    assert len(blocks) == len(pins)
    for forbidden in ("file://", "/opt/", "--find-links", "--index-url"):
        assert forbidden not in text


def test_the_two_locks_pin_the_same_versions_of_what_they_share() -> None:
    cpu, cuda = _pins("requirements-cpu.lock"), _pins("requirements.lock")
    shared = set(cpu) & set(cuda)
    assert len(shared) > 50
    differ = {n: (cpu[n], cuda[n]) for n in shared if cpu[n].split("+")[0] != cuda[n].split("+")[0]}
    assert not differ


def test_env_stage_leaves_the_lock_to_reprotrain_lock_and_every_lock_is_a_dep() -> None:
    # The container sets REPROTRAIN_LOCK=requirements.lock; a --lock in dvc.yaml would
    # override it and make `train` refuse the container's (CUDA) install as drift.
    stages = _dvc_stages()
    assert "--lock" not in stages["env"]["cmd"]
    for stage in STAGES:
        locks = {dep for dep in stages[stage]["deps"] if dep.endswith(".lock")}
        assert locks == {"requirements-cpu.lock", "requirements.lock"}, stage


def test_workflow_actions_are_pinned_by_sha_with_read_only_permissions() -> None:
    workflows = sorted((ROOT / ".github/workflows").glob("*.yml"))
    assert workflows
    for path in workflows:
        text = path.read_text()
        uses = re.findall(r"^\s*(?:-\s*)?uses:\s*(\S+)", text, re.M)
        assert uses, path
        for action in uses:
            assert re.fullmatch(r"[\w.-]+/[\w./-]+@[0-9a-f]{40}", action), f"{path}: {action}"
        spec = yaml.safe_load(text)
        assert spec["permissions"] == {"contents": "read"}, path
        for name, job in spec["jobs"].items():
            assert "write" not in str(job.get("permissions", "")), f"{path}: job {name}"


@pytest.mark.parametrize("stage", ("env", *STAGES))
def test_stage_commands_read_without_import_match_the_stage_parser(stage: str) -> None:
    import argparse

    from reprotrain.pipeline.stages import stage_arguments, stage_command

    parser = argparse.ArgumentParser(exit_on_error=False)
    importlib.import_module(f"reprotrain.pipeline.{stage}").add_arguments(parser)
    strict = parser.parse_args(stage_command(stage, ROOT / "dvc.yaml")[2:])
    light = stage_arguments(stage, ROOT / "dvc.yaml")
    for name, value in vars(strict).items():
        assert getattr(light, name) == value, f"{stage}: --{name}"
