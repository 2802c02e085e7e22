"""The train stage's run record: its inputs, its run ID and its output hashes.

``reports/run.json`` states the contract "same run ID => same output hashes".
The run ID covers the stage's params, the model and data module fully
resolved (every init argument, defaults included: ``recipe``), the md5 of
each data file (checked against what DVC recorded), the lock's sha256, the
sha256 of the stage's source files (its module and every ``reprotrain``
module it imports, with the built-in recipe's modules: files ``dvc.yaml``
lists as deps), the sha256 of a user recipe's own code (``user_code_sha256``:
the package its classes live in and its ``code:`` entries, relative to the
repository root), the environment record's fingerprint, the
determinism settings in force, torch's runtime switches (threads, TF32) and
the distributed layout (world size, backend, DDP options, ``NCCL_*`` settings).
The git commit is deliberately absent: the code itself is hashed, and the
commit that holds ``run.json`` is its provenance. Were it inside, a commit
that only touches the README would change ``run.json`` and so ``dvc.lock``,
and CI could no longer compare reruns by their bits.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import reprotrain
from reprotrain.atomic import atomic_write_text
from reprotrain.determinism import DeterminismSettings
from reprotrain.hashing import canonical_json, sha256_file
from reprotrain.pipeline.config import Params
from reprotrain.pipeline.errors import DataError
from reprotrain.provenance.dvcchecksum import (
    dvc_lists_dependency,
    md5_dir,
    verify_dvc_checksum,
)
from reprotrain.provenance.environment import (
    HOST_FILE,
    HOST_KEY,
    environment_sha256,
    torch_runtime,
)
from reprotrain.provenance.identity import code_hash, run_id, source_files

if TYPE_CHECKING:  # jsonargparse and Lightning load when a stage resolves its recipe
    from reprotrain.pipeline.recipe import Recipe


def load_environment(path: Path) -> dict[str, Any]:
    """The environment record written by the ``env`` stage."""
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        raise DataError(f"{path}: environment record not found; run `dvc repro env`") from None
    except (OSError, ValueError) as err:
        raise DataError(
            f"{path}: unreadable environment record ({err}); rerun `dvc repro env`"
        ) from None
    if not isinstance(record, dict) or "lock" not in record:
        raise DataError(f"{path}: not a reprotrain environment record; rerun `dvc repro env`")
    return record


def load_environment_with_host(path: Path) -> dict[str, Any]:
    """The record at ``path`` with the host facts the env stage wrote beside it, if any.

    For showing differences (``env --diff``, ``compare``): the ``host`` section is
    informational, so its fields are shown, classified "no", and never decide.
    """
    record = load_environment(path)
    host = path.with_name(HOST_FILE)
    if HOST_KEY not in record and host.is_file():
        try:
            record[HOST_KEY] = json.loads(host.read_text())
        except (OSError, ValueError) as err:
            print(f"reprotrain: warning: {host}: unreadable host facts ({err})", file=sys.stderr)
    return record


def run_inputs(
    stage_module: str,
    params: Params,
    param_keys: tuple[str, ...],
    recipe: Recipe,
    data: list[Path],
    environment: Mapping[str, Any],
    dvc_lock: Path | None,
    settings: DeterminismSettings,
    distributed: Mapping[str, Any],
) -> dict[str, Any]:
    """Everything that decides the stage's bits; refuses data DVC recorded differently."""
    from reprotrain.pipeline.recipe_code import code_files  # jsonargparse: only when a stage runs

    package = Path(reprotrain.__file__).parent.resolve()
    recipe_files = [f.resolve() for c in recipe.components for f in code_files(c)]
    ours = {f for f in recipe_files if f.is_relative_to(package)}
    theirs = sorted(set(recipe_files) - ours)
    stage_files = {f.resolve() for f in source_files(stage_module)} | ours
    return {
        # model and data as resolved (defaults filled in, values typed), not as written:
        # `lr: 1e-3` and `lr: 0.001`, or a default left out and spelt out, are one run.
        "params": params.select(k for k in param_keys if k not in ("model", "data")),
        "recipe": recipe_record(recipe, params),
        "data_md5": {path.as_posix(): data_checksum(path, dvc_lock) for path in data},
        "lock_sha256": (environment.get("lock") or {}).get("sha256"),
        "code_sha256": code_hash(stage_files, package),
        "user_code_sha256": code_hash(theirs, Path.cwd().resolve()) if theirs else None,
        "environment_sha256": environment_sha256(environment),
        "determinism": settings.as_dict(),
        "torch_runtime": torch_runtime(),
        "distributed": dict(distributed),
    }


def recipe_record(recipe: Recipe, params: Params) -> dict[str, Any]:
    """The recipe as the run ID sees it.

    Under ``train.world_size_invariant`` every random draw of the data is keyed by
    the sample (:class:`~reprotrain.distributed.microbatches.MicroBatchSampler`), so the
    data module's ``num_workers`` cannot change the bits: it is left out, and a run
    resumes with another worker count. Otherwise each worker draws from its own
    seeded stream and the count stays in.
    """
    record = recipe.record()
    return without_num_workers(record) if params.train.world_size_invariant else record


def without_num_workers(record: Mapping[str, Any]) -> dict[str, Any]:
    """A recipe record (:func:`recipe_record`) with ``data.init_args.num_workers`` left out."""
    data = record["data"]
    if data is None:  # the model's own loaders: their workers are in its code
        return dict(record)
    rest = {k: v for k, v in data["init_args"].items() if k != "num_workers"}
    return {**record, "data": {**data, "init_args": rest}}


def data_checksum(path: Path, dvc_lock: Path | None) -> str:
    """``path``'s md5 as DVC recorded it (checked; refused when it differs), else its sha256.

    A file that is only a stage's dependency (a user's data in git) is hashed and not
    held to ``dvc.lock``: its md5 there is from the previous run, and a change to it is
    why DVC reruns the stage. A folder is hashed as DVC hashes one (``<md5>.dir``); a
    shard folder (docs/data.md) is first checked against its own index, every byte, so
    a missing, truncated or altered shard is named before anything trains.
    """
    if path.is_dir():
        check_shard_folder(path)
    elif not path.is_file():
        raise DataError(f"{path}: data file not found; run `dvc repro` (or fix --data)")
    md5, recorded = verify_dvc_checksum(path, dvc_lock) if dvc_lock else (None, None)
    if dvc_lock and recorded is None and not dvc_lists_dependency(path, dvc_lock):
        print(f"reprotrain: warning: {dvc_lock} has no checksum for {path}", file=sys.stderr)
    if md5 is not None:
        return md5
    return md5_dir(path) if path.is_dir() else sha256_file(path)


def check_shard_folder(path: Path) -> None:
    """A folder with a shard index must match it, every byte; a DataError names the shard."""
    from reprotrain.data.shards import INDEX, ShardError, check_shards

    if (path / INDEX).is_file():
        try:
            check_shards(path, hashes=True)
        except ShardError as err:
            raise DataError(str(err)) from None


def write_run_record(path: Path, inputs: Mapping[str, Any], outputs: Mapping[str, Path]) -> str:
    """Write ``run.json`` atomically; return the run ID."""
    identity = run_id(inputs)
    record = {
        "run_id": identity,
        "inputs": dict(inputs),
        "outputs": {name: sha256_file(file) for name, file in sorted(outputs.items())},
    }
    atomic_write_text(path, canonical_json(record))
    return identity
