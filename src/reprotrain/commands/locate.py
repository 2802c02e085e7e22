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
from reprotrain.pipeline.config import ConfigError, Params

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
        try:
            return module.training_step(batch, 0)
        except RuntimeError as err:
            if "not attached to a `Trainer`" not in str(err):
                raise
            raise ConfigError(
                f"model.class_path: {type(module).__qualname__}: its training_step reads "
                f"self.trainer, which locate's step (outside a Trainer) has not; {INSTEAD}"
            ) from None


#: What to use where locate cannot run a module's step.
INSTEAD = (
    "compare two runs' traces with `reprotrain compare` and their op recordings with "
    "`reprotrain opdiff` instead (docs/rerun-and-compare.md)"
)


def _check_steppable(module: Any, class_path: str) -> None:
    """Refuse manual optimization: locate compares the gradients of the loss a step returns."""
    if getattr(module, "automatic_optimization", True) is False:
        raise ConfigError(
            f"model.class_path: {class_path} sets automatic_optimization = False: its "
            f"training_step runs its own backward, and locate differentiates the loss a step "
            f"returns; {INSTEAD}"
        )


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
        module = fresh_model(recipe, linked).to(device)
        _check_steppable(module, recipe.model.class_path)
        return module

    result = locate_divergence(make_module, batch, _training_step, seed=params.seed)
    if args.json:
        print(json.dumps(dataclasses.asdict(result), sort_keys=True))
    else:
        print(f"reprotrain locate: {result}")
    return 0 if result.identical else EXIT_CHECK_FAILED
