"""Stage ``env``: the environment record that makes DVC retrain when the machine changes.

``dvc.yaml`` marks this stage ``always_changed``, so it runs on every
``dvc repro``; its output is a dependency of ``train``. The record's bytes
change exactly when the environment does (see :mod:`reprotrain.provenance.environment`),
so DVC retrains after a GPU, driver, torch or lock change and keeps its cache
otherwise. ``--host-out`` writes the informational ``host`` section beside it
(``reports/host.json``: CPU model, kernel, Python patch level, glibc...).
Without ``--out`` the record is printed, with the git state added;
``--diff A B`` explains how two records differ, with the fields of a
``host.json`` beside each (shown, never deciding). With ``--out`` (as
``dvc.yaml`` runs it) it first checks the CPU and, for a recipe that calls
``torch.compile``, the C++ compiler, then params.yaml, with the model and data
module it names imported, type-checked and held to the contract
(:mod:`reprotrain.pipeline.contract`), and with ``--raw-dir`` the raw data
for the prepare stage (:mod:`reprotrain.pipeline.preflight`), so bad input
stops ``dvc repro`` here, before DVC deletes any later stage's outputs. Once
they pass, under ``dvc repro`` it keeps the train and evaluate stages' current
outputs aside, for either stage to put back if it still fails
(:mod:`reprotrain.pipeline.kept`).

The lock the installed packages must match is ``--lock``, else the file named
by ``REPROTRAIN_LOCK``, else ``requirements-cpu.lock`` (relative to the working
directory, the repository root under DVC). The container image sets
``REPROTRAIN_LOCK=requirements.lock``: the same ``dvc.yaml`` then checks each
install against its own lock, and ``train`` refuses drift from that one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reprotrain.atomic import atomic_write_text
from reprotrain.determinism import CUBLAS_DETERMINISTIC_CONFIGS
from reprotrain.hashing import canonical_json
from reprotrain.pipeline.command import (
    DEFAULT_LOCK,
    DVC_YAML,
    LOCK_VARIABLE,
    STAGES,
    Command,
    stage_arguments,
)
from reprotrain.pipeline.config import Params
from reprotrain.pipeline.errors import DataError
from reprotrain.pipeline.params_file import load_params
from reprotrain.pipeline.recipe_code import compiling_code
from reprotrain.provenance.environment import (
    HOST_KEY,
    bit_deciding,
    capture_environment,
    editable_packages,
    git_state,
)
from reprotrain.provenance.toolchain import compile_record, missing_compiler

if TYPE_CHECKING:  # numpy, for the raw data: only when the stage checks it
    from reprotrain.pipeline.preflight import PlannedOutputs
    from reprotrain.pipeline.recipe import Recipe

#: The params.yaml keys this stage reads: none.
PARAMS: tuple[str, ...] = ()
#: Installed but never in a lock: this project itself (an editable install).
NOT_LOCKED = ("reprotrain",)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    what = parser.add_mutually_exclusive_group()
    what.add_argument(
        "--lock",
        type=Path,
        help=f"requirements lock the install should match (default: ${LOCK_VARIABLE}, "
        f"else {DEFAULT_LOCK})",
    )
    what.add_argument(
        "--diff",
        nargs=2,
        type=Path,
        metavar=("A", "B"),
        help="explain how two environment records differ and which changes void the guarantee",
    )
    parser.add_argument(
        "--out", type=Path, help="write the part that decides the bits here (default: print all)"
    )
    parser.add_argument(
        "--host-out", type=Path, help="with --out: write the informational host facts here"
    )
    parser.add_argument(
        "--raw-dir",
        type=Path,
        help="check params.yaml and the raw data in this folder first (what dvc.yaml does), "
        "so bad input stops `dvc repro` before any output is deleted",
    )
    parser.add_argument(
        "--params",
        type=Path,
        help="params file (its CPU profile is part of the record; checked with --raw-dir); "
        "default params.yaml, or when printing outside a repository, the default params",
    )


#: Restarts: the variables it records must be the ones the stages run with.
COMMAND = Command("record the environment that decides the bits", add_arguments, restarts=True)


def selected_lock(lock: Path | None = None) -> Path:
    """``lock`` if given, else ``$REPROTRAIN_LOCK``, else ``requirements-cpu.lock``."""
    if lock is not None:
        return lock
    return Path(os.environ.get(LOCK_VARIABLE) or DEFAULT_LOCK)


def record_environment(lock: Path | None = None, params: Params | None = None) -> dict[str, Any]:
    """The part of the record that decides the bits, as the stages see it (a cache key)."""
    return bit_deciding(whole_environment(lock, params))


def whole_environment(lock: Path | None = None, params: Params | None = None) -> dict[str, Any]:
    """The record with its informational ``host`` section, under params' CPU profile.

    Without ``params``, the ones in ``params.yaml`` (the CPU profile is part of the record).
    """
    given = lock is not None
    lock = selected_lock(lock)
    if not lock.is_file():
        origin = "--lock" if given else f"${LOCK_VARIABLE} or the default"
        raise DataError(
            f"{lock}: lock file not found (from {origin}); run from the repository root, or "
            f"pass --lock / set {LOCK_VARIABLE} to the lock this install was built from"
        )
    # configure_determinism sets this default in the training process; record it as in force.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DETERMINISTIC_CONFIGS[0])
    params = params if params is not None else load_params(Path("params.yaml"))
    own = (*NOT_LOCKED, *editable_packages(Path.cwd()))  # the project's own package, if any
    record = capture_environment(lock, own, params.cpu.to_profile())
    # The world size decides the bits unless train.world_size_invariant; dvc.yaml's train
    # stage lists none of these keys, so they reach its cache key here, or do not.
    record["processes"] = params.train.process_layout()
    if compiling_code(params):  # torch.compile: the C++ compiler and Inductor's settings
        record["compile"] = compile_record()
    return record


def stage_params(path: Path | None, printing: bool = False) -> tuple[Params, str]:
    """The params whose CPU profile the record is taken under, and a note on where from.

    ``path`` if given, else ``params.yaml``; only a printed record (``reprotrain
    env`` outside a repository, e.g. in a bare container) falls back to the
    default params when there is no ``params.yaml``, and says so.
    """
    if path is None and printing and not Path("params.yaml").is_file():
        return Params(), "no params.yaml here: recorded under the default params' CPU profile\n"
    return load_params(path or Path("params.yaml")), ""


def check_cpu(params: Params) -> None:
    """Refuse, in one line, a CPU the profile's kernels cannot run on (AVX2 and FMA under
    ``portable``): the first check, before any stage's output is touched."""
    if problem := params.cpu.to_profile().unsupported_here(way_out="set cpu.profile: native"):
        raise DataError(problem)


def check_compiler(params: Params) -> None:
    """Refuse, in one line, a recipe that calls ``torch.compile`` where Inductor's C++
    compiler is missing (else its first training step fails deep in a traceback)."""
    if (sites := compiling_code(params)) and (problem := missing_compiler()):
        raise DataError(f"{sites[0]}: {problem}")


def run(_: Params | None, args: argparse.Namespace) -> str:
    if args.diff:
        return explain_difference(*args.diff)
    check_stage_params()
    params, note = stage_params(args.params, printing=args.out is None and args.raw_dir is None)
    if args.out is not None:
        check_cpu(params)
        check_compiler(params)
    record = whole_environment(args.lock, params)
    train = pipeline_stage("train")
    checked = ""
    if args.out is not None or args.raw_dir is not None:
        from reprotrain.pipeline.preflight import Sizes, check_raw_data, preflight

        # the raw data first: a bad file's line comes before the recipe's imports (Lightning)
        raw = None if args.raw_dir is None else check_raw_data(params, args.raw_dir)
        from reprotrain.pipeline.contract import (
            check_loaders,
            check_prepare_data,
            check_recipe,
            check_world_size_invariance,
        )
        from reprotrain.pipeline.recipe import resolve_recipe

        recipe = resolve_recipe(params)
        check_recipe(params, recipe, scores=scores_in_pipeline())
        check_train_deps(recipe)
        if train is not None:  # else the train stage checks it, with its --data
            check_prepare_data(recipe, train.data)
        check_world_size_invariance(params, recipe)
        check_loaders(params, recipe)
        checked = f"; checked {' and '.join(c.class_path for c in reversed(recipe.components))}"
        checked += unread_data_note(recipe, train)
        if raw is not None:
            checks = preflight(params, Sizes.of(recipe), raw, record["gpu"], planned_outputs())
            checked += f"; {checks}"
    if args.out is None:
        shown = {**record, "git": git_state(Path.cwd())}
        return f"environment\n{note}" + json.dumps(shown, indent=2, sort_keys=True)
    atomic_write_text(args.out, canonical_json(bit_deciding(record)))
    keep_earlier_outputs(train, pipeline_stage("evaluate"))
    if args.host_out is not None:
        atomic_write_text(args.host_out, canonical_json(record[HOST_KEY]))
    drift = "" if record["lock"]["exact"] else f"; {len(record['lock']['drift'])} packages drift"
    return f"recorded environment -> {args.out}{drift}{checked}"


def check_stage_params() -> None:
    """Under ``dvc repro``, refuse a param a stage lists that its params file lacks (``data``
    left out with no data module, a section removed), before DVC deletes that stage's
    outputs and then stops at it."""
    from reprotrain.pipeline.command import missing_params
    from reprotrain.pipeline.config import ConfigError
    from reprotrain.pipeline.kept import pipeline_file

    if (dvc_yaml := pipeline_file()) is None or not (missing := missing_params(dvc_yaml)):
        return
    stage, file, key = missing[0]
    raise ConfigError(
        f"{dvc_yaml}: stage {stage!r} lists the param {key!r}, which {file} does not have, so "
        f"DVC would stop at that stage after deleting its outputs; add {key} to {file} "
        f"({key}: null for a section left out, as data is with no data module), or drop it "
        "from the stage's params"
    )


def check_train_deps(recipe: Recipe) -> None:
    """Under ``dvc repro``, refuse a recipe whose code the train or evaluate stage does not
    depend on (:func:`~reprotrain.pipeline.contract.check_code_tracked`)."""
    from reprotrain.pipeline.command import stage_deps
    from reprotrain.pipeline.contract import check_code_tracked
    from reprotrain.pipeline.kept import pipeline_file

    if (dvc_yaml := pipeline_file()) is None:
        return
    for stage in ("train", "evaluate"):  # each builds the classes; a missing stage: None
        if (deps := stage_deps(stage, dvc_yaml)) is not None:
            check_code_tracked(recipe, deps, dvc_yaml, stage)


def scores_in_pipeline() -> bool:
    """Whether the pipeline ``dvc repro`` runs has a stage that runs ``reprotrain evaluate``
    (so the model needs ``test_step`` and a test split); False outside ``dvc repro``, where
    the evaluate stage checks them when it runs."""
    from reprotrain.pipeline.command import pipeline_runs
    from reprotrain.pipeline.kept import pipeline_file

    dvc_yaml = pipeline_file()
    return dvc_yaml is not None and pipeline_runs("evaluate", dvc_yaml)


def pipeline_stage(stage: str) -> argparse.Namespace | None:
    """Under ``dvc repro``, ``stage``'s options as this pipeline's ``dvc.yaml`` writes them;
    None outside ``dvc repro`` or in a pipeline without that stage."""
    from reprotrain.pipeline.kept import pipeline_file

    if (dvc_yaml := pipeline_file()) is None:
        return None
    try:
        return stage_arguments(stage, dvc_yaml)
    except DataError:
        return None


def unread_data_note(recipe: Recipe, train: argparse.Namespace | None) -> str:
    """``; note: ...`` when the ``train`` stage's ``--data`` files are named by no data
    argument (:func:`~reprotrain.pipeline.contract.unread_data_files`)."""
    from reprotrain.pipeline.contract import unread_data_files

    if train is None or not (unread := unread_data_files(recipe, train.data)):
        return ""
    files = " ".join(f"--data {path}" for path in unread)
    return (
        f"; note: no init_args of {' or '.join(c.class_path for c in recipe.components)} names "
        f"{files}, which stays in the run ID; if neither reads it, remove it from the train "
        "and evaluate stages' cmd and deps in dvc.yaml (docs/your-model.md)"
    )


def keep_earlier_outputs(
    train: argparse.Namespace | None, evaluate: argparse.Namespace | None
) -> None:
    """Keep the ``train`` and ``evaluate`` stages' outputs aside, in one go (each keep drops
    what was kept before) (:mod:`reprotrain.pipeline.kept`)."""
    from reprotrain.pipeline.kept import evaluate_outputs, keep, train_outputs

    outputs = [
        *(train_outputs(train) if train is not None else []),
        *(evaluate_outputs(evaluate) if evaluate is not None else []),
    ]
    if not outputs:
        return
    try:
        keep(outputs)
    except OSError as err:  # no room or no rights under .dvc/tmp: the stages still run
        print(
            f"reprotrain env: warning: the train and evaluate stages' outputs not kept aside "
            f"({err}); a refusal by either stage would leave them deleted",
            file=sys.stderr,
        )


def planned_outputs(dvc_yaml: Path = DVC_YAML) -> PlannedOutputs | None:
    """The later stages' outputs as ``dvc_yaml`` names them; None outside a pipeline."""
    from reprotrain.pipeline.preflight import PlannedOutputs

    if not dvc_yaml.is_file():
        return None
    prepare, train, evaluate = (stage_arguments(s, dvc_yaml) for s in STAGES[1:])
    reports = (train.metrics, train.plots, train.run_record, evaluate.metrics)
    return PlannedOutputs(prepare.out, train.model, train.trace, train.checkpoints, reports)


def explain_difference(a: Path, b: Path) -> str:
    """Which fields of two environment records differ, and which void bitwise equality."""
    from reprotrain.pipeline.run_record import load_environment_with_host
    from reprotrain.provenance.envdiff import compare_environments

    diffs = compare_environments(load_environment_with_host(a), load_environment_with_host(b))
    if not diffs:
        return f"{a} and {b}: identical environments; the bitwise guarantee applies"
    voiding = [d for d in diffs if d.voids]
    verdict = (
        f"{len(voiding)} of {len(diffs)} differences void the bitwise guarantee"
        if voiding
        else f"{len(diffs)} differences, none voids the bitwise guarantee"
    )
    return "\n".join([f"{a} vs {b}: {verdict}", *(f"  {d.to_text()}" for d in diffs)])
