"""``reprotrain locate``: name the module that makes the pipeline's training step differ.

After ``reprotrain compare`` blames a kernel, this runs one training step of
the model params.yaml names twice on the same batch (its data module's first
training batch in dataset order, drawn once) from the same parameters, under the params'
determinism settings, and names the first module (path and type) whose
forward output or gradient differs, using
:func:`reprotrain.compare.modules.locate_divergence`. With ``--deterministic false``
it shows what the default kernels do; with ``true`` what the run would get.

Exit codes: 0 both steps identical, 1 a module differs, 2 bad input,
3 determinism cannot be configured.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import warnings
from typing import TYPE_CHECKING, Any

from reprotrain.commands._exit_codes import EXIT_CHECK_FAILED
from reprotrain.determinism import configure_determinism
from reprotrain.pipeline.command import Command
from reprotrain.pipeline.config import Params

if TYPE_CHECKING:  # torch and Lightning load when it runs, not when the CLI reads it
    import torch


PARAMS = ("seed", "deterministic", "model", "data", "train")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


COMMAND = Command(
    "name the module whose output or gradient differs between two equal steps",
    add_arguments,
    takes_params=True,
    restarts=True,
)


def _training_step(module: Any, batch: Any) -> torch.Tensor:
    with warnings.catch_warnings():  # self.log() outside a Trainer only warns
        warnings.filterwarnings("ignore", message=r".*self\.log.*")
        return module.training_step(batch, 0)


def run(params: Params, args: argparse.Namespace) -> int:
    import torch
    from lightning.fabric.utilities.apply_func import move_data_to_device

    from reprotrain.compare.modules import locate_divergence
    from reprotrain.pipeline.data import first_batches
    from reprotrain.pipeline.recipe import build, fresh_model, resolve_recipe

    configure_determinism(params.seed, params.deterministic, params.cpu.to_profile())
    device = torch.device("cuda" if params.train.accelerator == "gpu" else "cpu")
    recipe = resolve_recipe(params)
    source, _, linked = build(recipe)
    batch = move_data_to_device(first_batches(source, 1)[0], device)

    def make_module() -> Any:
        return fresh_model(recipe, linked).to(device)

    result = locate_divergence(make_module, batch, _training_step, seed=params.seed)
    if args.json:
        print(json.dumps(dataclasses.asdict(result), sort_keys=True))
    else:
        print(f"reprotrain locate: {result}")
    return 0 if result.identical else EXIT_CHECK_FAILED
