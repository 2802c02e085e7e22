"""``reprotrain verify``: rerun the train stage and prove the bits repeat.

Runs the train stage's own command (from ``dvc.yaml``) ``--runs`` times, each
in a fresh process writing to its own folder, against the same prepared data
and a freshly captured environment record, then compares every run with the
first: weights and per-step trace byte for byte. Exit 0 only if all are
identical; otherwise 1 with ``reprotrain compare``'s explanation (first
diverging step, record and diagnosis; weights table) and the run folders
kept for a closer look. The prepared data comes from ``dvc repro prepare``
(run first if it is missing).

When the traces blame a kernel (the loss or the gradients differ first, with
the same batch, RNG state and parameters), verify trains the two runs once
more with the op recorder on for that step (``REPROTRAIN_RECORD_OPS``, read
by the train stage's :class:`~reprotrain.ops.recorder.OpRecorder`) and adds what
``reprotrain opdiff`` says: the first differing aten op, its module and source
line. Each recording writes ``<run>-ops/ops/`` beside the run folders.

``--world-sizes 1 2 4`` trains once per world size instead (``train.devices``,
``ddp`` above 1): under ``train.world_size_invariant`` the runs must be
identical (docs/world-size-invariance.md); outside it they are expected to
differ, and the comparison says from which step.

``--against REV`` compares a fresh run with the outputs committed at a git
revision (read through DVC). That is only meaningful on the environment the
revision was trained on: when the fresh environment record differs from the
committed one in a field that voids the bitwise guarantee (GPU, torch,
CUDA, CPU kernels...), verify says so and compares fresh reruns instead.

``--reference [REV]`` (default ``HEAD``) needs no DVC cache, only git: one
``dvc repro`` of the whole pipeline in a fresh clone of REV, running REV's own
code (:func:`~reprotrain.commands._rebuild.clone_environment`: the clone's
``src/`` on this environment where it matches REV's lock, else REV's own
``make venv``), then every file
git tracks there (``dvc.lock`` with every output's md5, ``reports/``) must be
byte-identical to REV's. One verdict (:mod:`reprotrain.commands._reference`):
exit 0, REPRODUCED, if so; exit 6 (``EXIT_RECORD_DIFFERS``), SAME OUTPUTS,
RECORD DIFFERS, when every output is REV's bytes but the deciding record
(environment record, run ID) is not, naming its fields; otherwise exit 1,
NOT REPRODUCED, with the outputs that differ, the record's fields that differ
as the likely cause, and, where REV's trace is in this repository's DVC cache,
the first diverging step. It costs one pipeline run; ``make check-reference``
runs it.

``--workdir DIR`` keeps the runs there; it must be new or empty (a file, or a folder
holding anything, is refused before any run), so verify never deletes or replaces
earlier runs.

Runs train one after another (``--jobs N``: N side by side, see
:mod:`reprotrain.commands._rerun`); cost against one training run:
``benchmarks/overhead/verify_cost.py``.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from reprotrain.commands._children import run_child
from reprotrain.commands._exit_codes import (
    ERROR_PREFIX,
    EXIT_CHECK_FAILED,
    EXIT_RECORD_DIFFERS,
)
from reprotrain.commands._findrun import OPS_FOLDER, RunFiles, find_run, run_in_folder
from reprotrain.commands._git import changed_paths, git, share_dvc_cache
from reprotrain.commands._rebuild import clone_environment, python_of
from reprotrain.commands._reference import classify_changes
from reprotrain.commands._rerun import Workspace, ready_workdir, rerun_workspace, train_fresh
from reprotrain.commands._rundiff import RunComparison, compare_runs, with_op_diff
from reprotrain.commands.run import add_launch_arguments, at_least
from reprotrain.hashing import canonical_json
from reprotrain.pipeline.command import Command, add_dvc_yaml, add_override_option
from reprotrain.pipeline.errors import DataError
from reprotrain.pipeline.run_record import load_environment
from reprotrain.provenance.envdiff import compare_environments

PARAMS: tuple[str, ...] = ()
#: Trace records whose difference, with the same batch, RNG and weights, blames a kernel.
KERNEL_RECORDS = ("loss", "grads")
#: Options of ``verify -- CMD`` that the pipeline's own runs refuse (default: not given).
_SCRIPT_ONLY = {
    "--output": lambda args: bool(args.outputs),
    "--ops-step": lambda args: args.ops_step is not None,
    "--cpu-profile": lambda args: args.cpu_profile is not None,
    "--threads": lambda args: args.threads is not None,
}


def world_sizes(text: str) -> list[int]:
    """``2`` or ``1,2,4``: the world sizes one ``--world-sizes`` word names."""
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: world sizes are whole numbers, as `--world-sizes 1 2` or `1,2`"
        ) from None


class Flattened(argparse.Action):
    """Stores the lists of every word of an option as one list."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
        setattr(namespace, self.dest, [n for part in values for n in part])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runs", type=int, default=2, help="fresh training runs (>= 2)")
    parser.add_argument(
        "--world-sizes",
        metavar="N",
        type=world_sizes,
        nargs="+",
        action=Flattened,
        help="one run per world size N (train.devices=N, ddp above 1), instead of --runs: "
        "with train.world_size_invariant they must be identical; `1 2 4` or `1,2,4`",
    )
    parser.add_argument("--against", metavar="REV", help="compare a fresh run with REV's outputs")
    parser.add_argument(
        "--reference",
        metavar="REV",
        nargs="?",
        const="HEAD",
        help="one `dvc repro` in a clone of REV (default HEAD): are dvc.lock and reports/ as "
        "git holds them? Needs no DVC cache",
    )
    add_dvc_yaml(parser)
    parser.add_argument(
        "--workdir", type=Path, help="keep the run folders here (default: a temporary folder)"
    )
    parser.add_argument("--json", action="store_true", help="print the comparisons as JSON")
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="runs trained side by side (default 1: on a small machine they compete for cores)",
    )
    add_override_option(parser, "params override for every run, e.g. -S train.accelerator=gpu")
    add_launch_arguments(parser, "verify")
    parser.add_argument(
        "--output",
        dest="outputs",
        action="append",
        default=[],
        metavar="PATH",
        help="with `-- CMD`: a file the command writes under {out} to compare (default: all)",
    )
    parser.add_argument(
        "--ops-step",
        type=at_least(0, "--ops-step 0 (steps count from 0)", "a step number"),
        default=None,
        help="with `-- CMD`: the step to record ops of (default: where the traces first "
        "differ, else 0)",
    )


COMMAND = Command(
    "rerun training in fresh processes and check the bits are identical",
    add_arguments,
    restarts=True,
)


def run(_: object, args: argparse.Namespace) -> int:
    if args.cmd:
        from reprotrain.commands._anyscript import verify_script

        return verify_script(args)
    if named := [flag for flag, on in _SCRIPT_ONLY.items() if on(args)]:
        raise DataError(
            f"{', '.join(named)}: only with `-- CMD` (a command's own runs); the pipeline's "
            "runs compare its model and trace"
        )
    if args.reference is not None:
        return check_reference(args.reference, args.workdir)
    if args.world_sizes is not None and (len(args.world_sizes) < 2 or min(args.world_sizes) < 1):
        raise DataError(
            f"--world-sizes {' '.join(map(str, args.world_sizes))}: give two or more world "
            "sizes >= 1, e.g. --world-sizes 1 2"
        )
    if args.runs < 2 and not args.against:
        raise DataError(
            f"--runs {args.runs}: verify needs at least 2 runs to compare; pass --runs 2 or more"
        )
    if args.workdir is not None:  # before any run: train_fresh replaces a run folder it finds
        ready_workdir(args.workdir, fresh=True)
    with rerun_workspace(args.dvc_yaml, args.workdir, "verify") as workspace:
        return _verify(args, workspace)


def _verify(args: argparse.Namespace, workspace: Workspace) -> int:
    train_args, workdir, environment, record = workspace
    runs = args.runs
    reference = None
    if args.against:
        reference = _committed_run(args.against, workdir, record)
        runs = 1 if reference is not None else max(runs, 2)
    if args.world_sizes:
        folders = [workdir / f"world-size-{n}" for n in args.world_sizes]
        for folder, n in zip(folders, args.world_sizes, strict=True):
            layout = [f"train.devices={n}", f"train.strategy={'ddp' if n > 1 else 'single_device'}"]
            train_fresh(train_args, [folder], environment, [*args.overrides, *layout], "verify")
    else:
        folders = [workdir / f"run-{i + 1}" for i in range(runs)]
        train_fresh(train_args, folders, environment, args.overrides, "verify", args.jobs)
    fresh = [run_in_folder(folder, folder.name) for folder in folders]
    first = reference or fresh[0]
    results = [compare_runs(first, other) for other in (fresh[1:] if reference is None else fresh)]
    if reference is None and not args.world_sizes:
        results = [_name_the_op(result, args.overrides, workspace) for result in results]
    for result in results:
        if not result.identical and result.a.trace and result.b.trace:
            from reprotrain.trace.diff import plot_losses  # torch: only when runs differ
            from reprotrain.trace.tracefile import load_trace

            plot = workdir / f"loss-{result.b.label}.png"
            plot_losses(load_trace(result.a.trace), load_trace(result.b.trace), plot)
            result.notes.append(f"loss plot: {plot}")
    return _report(results, workdir, keep=args.workdir is not None, as_json=args.json)


def _name_the_op(
    result: RunComparison, overrides: list[str], workspace: Workspace
) -> RunComparison:
    """Record the ops of the step a kernel is blamed at, in both runs again, and align them."""
    trace = result.report.trace if result.report is not None else None
    if trace is None or trace.record not in KERNEL_RECORDS or trace.first_step is None:
        return result
    from reprotrain.ops.opfile import DIR_VARIABLE, WINDOW_VARIABLE  # torch: a kernel is blamed

    train_args, workdir, environment, _ = workspace
    ops = []
    for label in (result.a.label, result.b.label):
        folder = workdir / f"{label}-ops"
        env = {WINDOW_VARIABLE: str(trace.first_step), DIR_VARIABLE: str(folder / OPS_FOLDER)}
        train_fresh(train_args, [folder], environment, overrides, "verify", env=env)
        ops.append(folder / OPS_FOLDER)
    # a racing kernel can differ in one pair of runs and not in the next
    return with_op_diff(result, *ops, f" (step {trace.first_step} matched in these two reruns)")


def _committed_run(rev: str, workdir: Path, record: dict[str, Any]) -> RunFiles | None:
    """REV's run if its environment matches this one; else None, saying why."""
    committed = find_run(rev, Path(), workdir / "against")
    if committed.environment is None:
        print(f"reprotrain verify: {rev} has no environment record; comparing fresh reruns")
        return None
    voiding = [
        d for d in compare_environments(load_environment(committed.environment), record) if d.voids
    ]
    if voiding:
        listed = "; ".join(d.to_text() for d in voiding)
        print(
            f"reprotrain verify: this environment differs from {rev}'s ({listed}): the bitwise "
            "guarantee does not apply there, so comparing fresh reruns instead"
        )
        return None
    return committed


def _report(results: list[RunComparison], workdir: Path, keep: bool, as_json: bool) -> int:
    identical = all(r.identical for r in results)
    if as_json:
        print(
            canonical_json(
                {
                    "identical": identical,
                    "workdir": str(workdir),
                    "comparisons": [r.to_dict() for r in results],
                }
            ),
            end="",
        )
    else:
        for result in results:
            print(result.to_text())
    if identical and not keep:
        shutil.rmtree(workdir, ignore_errors=True)
    elif not as_json:
        print(f"run folders kept in {workdir} (reprotrain compare A B explains any pair)")
    if not as_json:
        print(f"reprotrain verify: {_verdict(results)}")
    return 0 if identical else EXIT_CHECK_FAILED


def _verdict(results: list[RunComparison]) -> str:
    """One line; with three runs or more, which pairs differ (each is compared with the first)."""
    runs = f"{len(results) + 1} runs"
    differing = [f"{r.a.label} vs {r.b.label}" for r in results if not r.identical]
    if not differing:
        return f"IDENTICAL ({runs})"
    return f"NOT REPRODUCIBLE ({runs}; differ: {', '.join(differing)})"


def check_reference(rev: str, workdir: Path | None) -> int:
    """Every pipeline run once in a clone of ``rev``: does it rewrite anything git holds?"""
    repo = Path.cwd()
    if workdir is not None:  # the clone goes in a new folder of its own inside it
        ready_workdir(workdir)
    scratch = Path(tempfile.mkdtemp(prefix="reprotrain-reference-", dir=workdir))
    clone = scratch / "repo"
    try:
        git(repo, "clone", "-q", "--no-checkout", str(repo), str(clone))
        git(clone, "checkout", "-q", rev)
    except DataError:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    share_dvc_cache(repo, clone)
    # The clone's own code (its src/, which DVC hashes), not the package installed here.
    variables = clone_environment(clone)
    print(f"reprotrain verify: dvc repro in a clone of {rev} ({clone})", flush=True)
    repro = run_child(
        [python_of(variables), "-m", "dvc", "repro", "--all-pipelines", "--no-run-cache"],
        cwd=clone,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=variables,
    )
    if repro.returncode != 0:
        raise DataError(f"dvc repro failed in {clone}: {_repro_failure(repro, repo)}")
    changes = classify_changes(clone, rev, changed_paths(clone))
    if changes.outputs_identical and changes.record_identical:
        shutil.rmtree(scratch, ignore_errors=True)
        print(
            f"reprotrain verify: REPRODUCED: {rev}'s reference, outputs and the record that "
            "decides them (dvc.lock, reports/) byte for byte"
        )
        return 0
    if changes.outputs_identical:
        shutil.rmtree(scratch, ignore_errors=True)
        print(f"the record that decides the bits differs from {rev}'s in:")
        print("\n".join(changes.record_lines()))
        print(
            f"reprotrain verify: SAME OUTPUTS, RECORD DIFFERS: every output is {rev}'s bytes, "
            f"but {', '.join(changes.record_files)} would change (exit {EXIT_RECORD_DIFFERS})"
        )
        return EXIT_RECORD_DIFFERS
    print(f"outputs this run changed against {rev}:")
    print("\n".join(f"  {line}" for line in changes.outputs))
    print(f"likely cause, the record that decides the bits vs {rev}'s:")
    print("\n".join(changes.record_lines()) or "  nothing differs there")
    try:
        result = compare_runs(find_run(rev, repo, scratch / "reference"), run_in_folder(clone))
    except DataError as err:
        print(f"first diverging step: unknown, {rev}'s trace is not reachable here ({err})")
    else:
        if result.identical:
            same = ", ".join(f"{name} {a[:12]}" for name, (a, _) in result.hashes.items())
            what = " and ".join(result.hashes)  # only what was compared: a trace alone is not
            unseen = "".join(f"; {note}" for note in result.not_compared)  # the model's bits
            print(f"{what}: the same bits ({same}){unseen}; the outputs above differ")
        else:
            print(result.to_text())
    print(f"reprotrain verify: NOT REPRODUCED: {rev}'s outputs differ here (clone kept: {clone})")
    return EXIT_CHECK_FAILED


def _repro_failure(repro: subprocess.CompletedProcess[str], repo: Path) -> str:
    """DVC's own error lines, and what to do when a DVC-tracked input is in no cache or remote."""
    lines = f"{repro.stderr}\n{repro.stdout}".strip().splitlines()
    dvcs = [line.removeprefix("ERROR:").strip() for line in lines if line.startswith("ERROR")]
    # the stage's own one line first: what failed, before DVC's "failed to reproduce"
    own = [line.removeprefix(ERROR_PREFIX) for line in lines if line.startswith(ERROR_PREFIX)]
    errors = own[-1:] + dvcs
    said = " / ".join(errors or lines[-3:]) or f"exit {repro.returncode} and no output"
    missing = sorted(set(re.findall(r"missing data '\w+': (\S+)", said)))
    if not missing:
        return said
    return (
        f"{said}; {', '.join(missing)} is tracked by DVC but neither {repo}'s DVC cache nor a "
        f"remote has it: run `dvc pull` in {repo} (set a remote first with `dvc remote add -d "
        "NAME URL`), or restore the file and `dvc add` it, then rerun"
    )
