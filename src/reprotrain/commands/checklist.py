"""``reprotrain checklist``: can this run be reproduced, item by item?

Each item is pass, warn or fail, in five categories:

* code: clean tree; ``run.json`` committed (which ties the run to a commit);
* data: files match the checksums in ``dvc.lock`` and in ``.dvc`` files;
* environment: lock installed exactly, image digest known, versions recorded;
  Python's patch level and glibc, shown (informational: they do not decide the bits);
* random state: seed, worker seeding, hash seed fixed at start, deterministic
  mode, as recorded in ``run.json``;
* hardware: device model recorded; same as the reference run, i.e. the
  environment record committed at ``HEAD``.

Markdown for people, ``--json`` for CI; ``--strict`` exits 1 on any fail.
Paths come from the ``env`` and ``train`` commands in ``dvc.yaml``.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from reprotrain.commands._exit_codes import EXIT_CHECK_FAILED
from reprotrain.commands._git import git_show, tracked_dvc_files
from reprotrain.pipeline.command import Command, add_dvc_yaml, stage_arguments
from reprotrain.pipeline.config import Params
from reprotrain.pipeline.stages.env import whole_environment
from reprotrain.provenance.dvcchecksum import md5_dir, md5_file, recorded_entries
from reprotrain.provenance.envdiff import compare_environments
from reprotrain.provenance.environment import HOST_KEY, bit_deciding, git_state

PARAMS: tuple[str, ...] = ()
Status = Literal["pass", "warn", "fail"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_dvc_yaml(parser)
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--strict", action="store_true", help="exit 1 if any item fails")


#: Restarts so that the variables it records are the ones the stages run with.
COMMAND = Command(
    "reproducibility checklist: pass / warn / fail per item", add_arguments, restarts=True
)


@dataclass(frozen=True)
class Item:
    category: str
    name: str
    status: Status
    detail: str


def run(_: Params | None, args: argparse.Namespace) -> int:
    items = collect(args.dvc_yaml)
    if args.json:
        print(json.dumps([asdict(item) for item in items], indent=2))
    else:
        print(render_markdown(items), end="")
    failed = args.strict and any(item.status == "fail" for item in items)
    return EXIT_CHECK_FAILED if failed else 0


def render_markdown(items: list[Item]) -> str:
    lines = ["# Reproducibility checklist", ""]
    for category in dict.fromkeys(item.category for item in items):
        lines += [f"## {category}", ""]
        for item in (i for i in items if i.category == category):
            lines.append(f"- **{item.status.upper()}** {item.name}: {item.detail}")
        lines.append("")
    counts = {s: sum(i.status == s for i in items) for s in ("pass", "warn", "fail")}
    lines.append(", ".join(f"{n} {s}" for s, n in counts.items()))
    return "\n".join(lines) + "\n"


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _committed_json(path: Path) -> dict[str, Any] | None:
    committed = git_show(Path.cwd(), "HEAD", path.as_posix())
    try:
        value = json.loads(committed) if committed is not None else None
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def collect(dvc_yaml: Path) -> list[Item]:
    env_args = stage_arguments("env", dvc_yaml)
    train_args = stage_arguments("train", dvc_yaml)
    run_record = _read_json(train_args.run_record) or {}
    recorded_env = _read_json(train_args.env)
    current_env = whole_environment(env_args.lock)
    outputs = (train_args.metrics.parent, train_args.run_record.parent, train_args.plots)
    exclude = (*map(str, outputs), str(train_args.dvc_lock or "dvc.lock"))
    return [
        *_code_items(train_args.run_record, exclude),
        _data_item(train_args.dvc_lock or dvc_yaml.with_name("dvc.lock")),
        *_environment_items(current_env, recorded_env),
        _host_item(current_env, _read_json(env_args.host_out) if env_args.host_out else None),
        *_random_state_items(run_record, train_args.run_record),
        *_hardware_items(current_env, recorded_env, train_args.env),
    ]


def _code_items(run_record_path: Path, exclude: tuple[str, ...]) -> list[Item]:
    state = git_state(Path.cwd(), exclude=exclude)
    if state["commit"] is None:
        clean = Item("code", "clean tree", "fail", "not a git repository with a commit")
    elif state["dirty"]:
        clean = Item("code", "clean tree", "fail", "uncommitted changes: commit or stash them")
    else:
        clean = Item("code", "clean tree", "pass", f"at {state['commit'][:12]}")
    committed = _committed_json(run_record_path)
    if committed is None:
        detail = f"{run_record_path} is not committed: commit it with dvc.lock"
        recorded = Item("code", "commit recorded", "fail", detail)
    elif committed != _read_json(run_record_path):
        detail = f"{run_record_path} changed since HEAD: commit the new run"
        recorded = Item("code", "commit recorded", "warn", detail)
    else:
        recorded = Item("code", "commit recorded", "pass", f"{run_record_path} committed at HEAD")
    return [clean, recorded]


def _data_item(dvc_lock: Path) -> Item:
    if not dvc_lock.is_file():
        return Item("data", "checksums match dvc.lock", "fail", f"{dvc_lock} not found")
    root = dvc_lock.parent
    records = recorded_entries(dvc_lock)
    for sidecar in tracked_dvc_files(root):
        fix = "restore it from git or `dvc add` its data again"
        for out in recorded_entries(sidecar, fix, lock=False):
            records.append({**out, "path": str((sidecar.parent / out["path"]).relative_to(root))})
    bad, missing = [], []
    for out in records:
        path = root / out["path"]
        if "md5" not in out:
            continue
        if not path.exists():
            missing.append(out["path"])
        elif (md5_dir(path) if path.is_dir() else md5_file(path)) != out["md5"]:
            bad.append(out["path"])
    if bad:
        return Item("data", "checksums match dvc.lock", "fail", f"changed: {', '.join(bad)}")
    if missing:
        detail = f"not present (dvc pull?): {', '.join(missing)}"
        return Item("data", "checksums match dvc.lock", "warn", detail)
    return Item("data", "checksums match dvc.lock", "pass", f"{len(records)} files match")


def _environment_items(current: dict[str, Any], recorded: dict[str, Any] | None) -> list[Item]:
    lock = current["lock"]
    if lock["exact"]:
        exact = Item("environment", "lock installed exactly", "pass", lock["file"])
    else:
        drift = ", ".join(
            f"{d['package']} {d['installed']} (lock: {d['locked']})" for d in lock["drift"][:5]
        )
        exact = Item("environment", "lock installed exactly", "fail", f"drift: {drift}")
    image = current["container"]["base_image"]
    digest = (
        Item("environment", "image digest known", "pass", image)
        if image != "none"
        else Item(
            "environment", "image digest known", "warn", "not running in the reprotrain image"
        )
    )
    torch_version = ((recorded or {}).get("torch") or {}).get("version")
    versions = (
        Item("environment", "versions recorded", "pass", f"torch {torch_version}")
        if torch_version
        else Item("environment", "versions recorded", "fail", "no environment record; dvc repro")
    )
    return [exact, digest, versions]


def _host_item(current: dict[str, Any], trained: dict[str, Any] | None) -> Item:
    """Python's patch level and glibc: informational (tests/test_portability.py), still shown."""
    here = current[HOST_KEY]
    detail = f"Python {here['python']}, {here['libc']}; shown not to change the bits"
    changed = [
        f"{key} {trained.get(key)} -> {here[key]}"
        for key in ("python", "libc")
        if trained is not None and trained.get(key) != here[key]
    ]
    if changed:
        detail += "; the last run's host.json differs: " + ", ".join(changed)
    return Item("environment", "Python patch level and glibc (informational)", "pass", detail)


def _random_state_items(run_record: dict[str, Any], path: Path) -> list[Item]:
    if not run_record:
        return [Item("random state", "run record", "fail", f"{path} missing; run dvc repro")]
    inputs = run_record.get("inputs", {})
    det = inputs.get("determinism", {})
    seed = inputs.get("params", {}).get("seed")

    def flag(name: str, ok: bool, good: str, bad: str) -> Item:
        return Item("random state", name, "pass" if ok else "fail", good if ok else bad)

    mode = det.get("mode")
    mode_item = Item(
        "random state",
        "deterministic mode",
        "pass" if mode is True else "warn",
        {True: "true", "warn": "warn: non-deterministic ops only warn"}.get(
            mode, "false: fast mode"
        ),
    )
    return [
        flag("seed fixed", isinstance(seed, int), f"seed {seed}", "no seed recorded"),
        flag(
            "workers seeded", det.get("seed_workers") is True, "PL_SEED_WORKERS", "workers unseeded"
        ),
        flag(
            "hash seed fixed at start",
            det.get("hash_seed_fixed_at_start") is True,
            f"PYTHONHASHSEED={det.get('python_hash_seed')}",
            "PYTHONHASHSEED was not fixed when training started",
        ),
        mode_item,
    ]


def _hardware_items(
    current: dict[str, Any], recorded: dict[str, Any] | None, path: Path
) -> list[Item]:
    devices = [g.get("name", "?") for g in current["gpu"]] or [current["host"]["cpu"]["model"]]
    model = Item("hardware", "device model recorded", "pass", ", ".join(devices))
    profile = current["cpu"]
    if profile.get("profile") == "portable":
        kernels = Item(
            "hardware",
            "CPU kernels independent of the CPU model",
            "pass",
            "cpu.profile portable: model, flags and thread count informational",
        )
    else:
        kernels = Item(
            "hardware",
            "CPU kernels independent of the CPU model",
            "warn",
            "cpu.profile native: this CPU's instruction set decides the bits "
            f"({', '.join(profile.get('dispatch_flags', []))})",
        )
    layout = current.get("processes", {})
    if layout.get("world_size_invariant"):
        detail = "train.world_size_invariant: the same bits at any power-of-two world size"
        processes = Item("hardware", "bits independent of the world size", "pass", detail)
    else:
        world = layout.get("devices", 1) * layout.get("num_nodes", 1)
        detail = (
            f"world size {world} decides the bits (so it is in the cache key); "
            "train.world_size_invariant: true lifts that"
        )
        processes = Item("hardware", "bits independent of the world size", "warn", detail)
    recorded_items = [model, processes]
    reference = _committed_json(path) or recorded
    if reference is None:
        return [
            *recorded_items,
            kernels,
            Item("hardware", "same as reference run", "warn", "no reference"),
        ]
    diffs = compare_environments(reference, bit_deciding(current))
    voiding = [d.key for d in diffs if d.voids]
    if voiding:
        detail = "bitwise equality not expected; differs in " + ", ".join(voiding[:6])
        same = Item("hardware", "same as reference run", "fail", detail)
    elif diffs:
        detail = "differs only in " + ", ".join(d.key for d in diffs[:6])
        same = Item("hardware", "same as reference run", "warn", detail)
    else:
        same = Item("hardware", "same as reference run", "pass", "identical environment record")
    return [*recorded_items, kernels, same]
