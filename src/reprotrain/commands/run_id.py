"""``reprotrain run-id``: the run ID the ``train`` stage would get right now.

It configures determinism exactly as ``train`` does, captures the environment
afresh (as the ``env`` stage would) and reads the data and lock paths from
``dvc.yaml``, so after a ``dvc repro`` it prints the ``run_id`` in
``reports/run.json``; any changed input prints another.
"""

from __future__ import annotations

import argparse
import json

from reprotrain.determinism import configure_determinism
from reprotrain.pipeline.command import Command, add_dvc_yaml, stage_arguments
from reprotrain.pipeline.config import Params
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
