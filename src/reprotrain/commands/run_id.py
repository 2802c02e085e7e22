"""``reprotrain run-id``: the run ID the ``train`` stage would get right now.

It configures determinism exactly as ``train`` does, captures the environment
afresh (as the ``env`` stage would) and reads the data and lock paths from
``dvc.yaml``, so after a ``dvc repro`` it prints the ``run_id`` in
``reports/run.json``; any changed input prints another.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml

from reprotrain.determinism import configure_determinism
from reprotrain.pipeline.command import (
    Command,
    add_dvc_yaml,
    pipeline_stages,
    stage_arguments,
)
from reprotrain.pipeline.config import Params, flatten
from reprotrain.pipeline.errors import DataError
from reprotrain.pipeline.stages import train
from reprotrain.pipeline.stages.env import record_environment
from reprotrain.provenance.identity import run_id

PARAMS = train.PARAMS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_dvc_yaml(parser)
    parser.add_argument("--json", action="store_true", help="print the inputs as JSON too")


COMMAND = Command(
    "print the run ID the train stage would have now",
    add_arguments,
    takes_params=True,
    restarts=True,
)


def run(params: Params, args: argparse.Namespace) -> int:
    from reprotrain.pipeline.recipe import resolve_recipe  # jsonargparse, Lightning

    train_args = stage_arguments("train", args.dvc_yaml)
    if train_args.params.resolve() != args.params.resolve():
        raise DataError(
            f"{args.dvc_yaml}: its train stage reads {train_args.params}, not {args.params}; "
            f"pass --params {train_args.params}"
        )
    if stale := stale_data(params, args.dvc_yaml, train_args.data, train_args.params):
        raise DataError(stale)
    environment = record_environment(stage_arguments("env", args.dvc_yaml).lock)
    settings = configure_determinism(params.seed, params.deterministic, params.cpu.to_profile())
    recipe = resolve_recipe(params)
    inputs = train.stage_inputs(
        params, recipe, train_args.data, environment, train_args.dvc_lock, settings
    )
    identity = run_id(inputs)
    if args.json:
        print(json.dumps({"run_id": identity, "inputs": inputs}, indent=2, sort_keys=True))
    else:
        print(identity)
    return 0


def stale_data(params: Params, dvc_yaml: Path, data: list[Path], params_file: Path) -> str | None:
    """Why the run ID would hash data that ``dvc repro`` is about to remake: a ``--data``
    file is the output of a stage (``prepare``) whose params now differ from those
    ``dvc.lock`` recorded for it (``-S seed=7``, an edited ``prepare.val_fraction``); None
    when no such stage, or nothing changed. Deps other than params are ``dvc status``'s.
    """
    try:
        lock = yaml.safe_load(dvc_yaml.with_name("dvc.lock").read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError):
        return None  # the train stage's own checks name what is wrong
    wanted = {path.resolve() for path in data}
    for name, stage in pipeline_stages(dvc_yaml).items():
        wdir = dvc_yaml.parent / str(stage.get("wdir", "."))
        outs = [
            next(iter(out)) if isinstance(out, dict) else out for out in stage.get("outs") or []
        ]
        made = [out for out in outs if (wdir / out).resolve() in wanted]
        locked = ((lock.get("stages") or {}).get(name) or {}).get("params") or {}
        for file, tree in locked.items():
            if not made or (wdir / file).resolve() != params_file.resolve():
                continue
            recorded = flatten(tree)
            now = params.select(recorded)
            changed = [key for key, value in recorded.items() if now.get(key) != value]
            if changed:
                key = changed[0]
                return (
                    f"{made[0]} is made by stage {name!r}, whose params changed since dvc.lock "
                    f"recorded it ({key}: {recorded[key]!r} -> {now.get(key)!r}), so the train "
                    "stage would read other data; run `dvc repro` (or `dvc exp run` with these "
                    "-S) first, whose run.json holds the run ID"
                )
    return None
