"""The ``reprotrain`` command: the pipeline stages and the tools around them.

Every sub-command is a stage (:mod:`reprotrain.pipeline.stages`) or a command
(:mod:`reprotrain.commands`), one module each, listed once in :data:`VERB_GROUPS`
(by what it is for, as ``--help`` lists them; :data:`VERBS` is the same as one list).
A verb module holds ``PARAMS``, ``add_arguments(parser)`` (its options),
``COMMAND`` (a :class:`~reprotrain.pipeline.command.Command`: summary, options,
whether it reads params.yaml and whether it restarts) and ``run``; it imports
no torch at module level, so ``--help`` and argument errors answer at once
(torch loads inside ``run``). ``run`` returns a one-line summary to print, or
an exit code when it printed its own output. Commands that train or
configure determinism (``restarts``) first restart the interpreter with
``PYTHONHASHSEED`` fixed, before torch is imported. Commands that read
``params.yaml`` load it once and apply overrides (``--seed 7``,
``--deterministic warn``, ``-S model.init_args.lr=0.01``).

Exit codes, each with its meaning in :mod:`reprotrain.commands._exit_codes`:
0 done; 1 a check failed; 2 bad input, nothing written; 3 the determinism
guarantee cannot be honoured in this process; 4 and 5 ``verify -- CMD``'s
other verdicts; 6 ``verify --reference``: same outputs, the record differs;
7 ``verify-attestation --rebuild``: unverifiable on this host; 130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import json
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import NoReturn

from reprotrain.commands._children import stop_on_sigterm, survive_closed_output
from reprotrain.commands._exit_codes import (
    ERROR_PREFIX,
    EXIT_BAD_INPUT,
    EXIT_INTERRUPTED,
    EXIT_NOT_DETERMINISTIC,
)
from reprotrain.pipeline.command import Command, add_param_options

#: The package of the pipeline's stages (the first verbs of VERBS).
STAGES = "reprotrain.pipeline.stages."
#: Every verb -> the module that declares and runs it, in the groups and the order
#: ``--help`` lists them: exactly the dvc.yaml stages first, then the other commands by
#: what they are for. ``params`` is the CLI's own (listed with the stages).
VERB_GROUPS = {
    "the pipeline's stages (dvc.yaml runs them) and its params": {
        "env": "reprotrain.pipeline.stages.env",
        "prepare": "reprotrain.pipeline.stages.prepare",
        "train": "reprotrain.pipeline.stages.train",
        "evaluate": "reprotrain.pipeline.stages.evaluate",
    },
    "rerun and compare (the pipeline's runs or any script's)": {
        "run": "reprotrain.commands.run",
        "verify": "reprotrain.commands.verify",
        "compare": "reprotrain.commands.compare",
        "locate": "reprotrain.commands.locate",
        "opdiff": "reprotrain.commands.opdiff",
    },
    "CI and provenance": {
        "status": "reprotrain.commands.status",
        "checklist": "reprotrain.commands.checklist",
        "run-id": "reprotrain.commands.run_id",
        "reference-note": "reprotrain.commands.reference_note",
        "attest": "reprotrain.commands.attest",
        "verify-attestation": "reprotrain.commands.verify_attestation",
    },
    "determinism lab (measured on this machine)": {
        "noise-floor": "reprotrain.commands.noise_floor",
        "bench": "reprotrain.commands.bench",
        "ops": "reprotrain.commands.ops",
    },
}
#: Every verb -> its module: the groups above, as one list.
VERBS = {verb: module for group in VERB_GROUPS.values() for verb, module in group.items()}
#: The CLI's own verb, listed with the stages.
PARAMS_SUMMARY = "print the resolved params, or the defaults"


def verb_module(verb: str) -> ModuleType:
    """The module of ``verb``: light to import (its ``run`` loads torch when it needs it)."""
    return importlib.import_module(VERBS[verb])


def verb_command(verb: str) -> Command:
    return verb_module(verb).COMMAND


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every sub-command, from each verb module's ``COMMAND``."""
    parser = OneLineParser(
        prog="reprotrain",
        description="Bitwise-reproducible Lightning training with DVC.",
        epilog=verb_listing(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # The verbs are listed by group in the epilog, one line each, not in argparse's one list.
    commands = parser.add_subparsers(
        dest="command",
        required=True,
        metavar="COMMAND",
        help="one of the commands below; `reprotrain COMMAND --help` gives its options",
    )
    for name in VERBS:
        command = verb_command(name)
        sub = commands.add_parser(name, description=command.summary)
        if command.takes_params:
            add_param_options(sub)
        command.add_arguments(sub)
    params = commands.add_parser("params", description=PARAMS_SUMMARY)
    add_param_options(params)
    params.add_argument("--defaults", action="store_true", help="print a default params.yaml")
    return parser


def verb_listing() -> str:
    """Every verb under its group's title, one line each: what ``reprotrain --help`` ends with."""
    width = max(len(verb) for verb in [*VERBS, "params"]) + 2
    blocks = []
    for title, verbs in VERB_GROUPS.items():
        lines = [f"  {verb:<{width}}{verb_command(verb).summary}" for verb in verbs]
        if title == next(iter(VERB_GROUPS)):
            lines.append(f"  {'params':<{width}}{PARAMS_SUMMARY}")
        blocks.append("\n".join([f"{title}:", *lines]))
    return "\n\n".join(blocks)


def overrides(args: argparse.Namespace) -> list[str]:
    """The ``key=value`` overrides given on the command line, in order."""
    extra = [] if args.seed is None else [f"seed={args.seed}"]
    if args.deterministic is not None:
        extra.append(f"deterministic={args.deterministic}")
    return [*args.overrides, *extra]


def main(argv: list[str] | None = None) -> int:
    """Entry point. ``argv=None`` means a real process start (may re-exec itself)."""
    started = argv is None
    if started and os.environ.get("REPROTRAIN_ZYGOTE"):  # the test suite's warm interpreter:
        importlib.import_module("reprotrain._zygote").hand_over_rank()  # a launched rank too
    parser = build_parser()
    args, unknown = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if unknown:
        parser.prog = f"reprotrain {args.command}"
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")

    _warnings_as_one_line()
    stage = VERBS.get(args.command, "").startswith(STAGES)  # a stage's SIGTERM is Lightning's
    with contextlib.nullcontext() if stage else stop_on_sigterm(), survive_closed_output():
        return _run(args, started)


def _bad_input() -> tuple[type[Exception], ...]:
    """The exceptions that mean bad input: one line, exit 2."""
    from reprotrain.pipeline.config import ConfigError
    from reprotrain.pipeline.errors import DataError
    from reprotrain.provenance.dvcchecksum import ChecksumError

    # reprotrain.resume imports Lightning (seconds); a CheckpointError can only come
    # from a command that imported it.
    resume = sys.modules.get("reprotrain.resume")
    extra = (resume.CheckpointError,) if resume is not None else ()
    return (ConfigError, DataError, ChecksumError, *extra)


def _run(args: argparse.Namespace, started: bool) -> int:
    """Run the parsed command; the errors it raises become one line and an exit code."""
    from reprotrain.determinism import DeterminismError
    from reprotrain.pipeline.errors import Interrupted
    from reprotrain.pipeline.params_file import load_params, render_defaults

    try:
        if started and args.command != "params" and verb_command(args.command).restarts:
            _restart_for_determinism(args)
        if args.command == "params":
            text = (
                render_defaults()
                if args.defaults
                else f"{load_params(args.params, overrides(args))}\n"
            )
            print(text, end="")
            return 0
        module = verb_module(args.command)
        params = load_params(args.params, overrides(args)) if module.PARAMS else None
        result = module.run(params, args)
        if isinstance(result, int):
            return result
        print(f"reprotrain {args.command}: {result}")
        return 0
    except _bad_input() as err:
        return _fail(f"{err}", EXIT_BAD_INPUT, args)
    except DeterminismError as err:
        return _fail(f"{err}", EXIT_NOT_DETERMINISTIC, args)
    except OSError as err:
        if err.errno not in STORAGE_ERRORS:
            raise
        return _fail(
            f"{err.filename or 'a file'}: {err.strerror}; {STORAGE_ERRORS[err.errno]}",
            EXIT_BAD_INPUT,
            args,
        )
    except Interrupted as err:
        if os.environ.get("LOCAL_RANK", "0") != "0":  # every rank stops; local rank 0 says so
            return EXIT_INTERRUPTED
        return _fail(f"{err}", EXIT_INTERRUPTED, args)
    except KeyboardInterrupt:
        return _fail("interrupted; rerun the same command to start again", EXIT_INTERRUPTED, args)


def _restart_for_determinism(args: argparse.Namespace) -> None:
    """Restart with PYTHONHASHSEED and params' CPU profile variables fixed, before torch.

    The profile comes from the params file the command reads (``--params``, with
    its overrides), else ``params.yaml`` in the working directory if there is
    one; ``evaluate`` takes the params its weights file was trained with. An
    exported variable that contradicts the profile is refused under
    ``deterministic: true`` and overridden with a warning otherwise; so is an exported
    ``CUBLAS_WORKSPACE_CONFIG`` that is not deterministic (warned of under ``warn``),
    here, in the first stage, before DVC deletes a later stage's outputs.
    """
    from reprotrain.determinism import (
        CUBLAS_DETERMINISTIC_CONFIGS,
        reexec_with_fixed_hash_seed,
        refuse_or_warn,
    )
    from reprotrain.hashing import read_safetensors_metadata
    from reprotrain.pipeline.params_file import load_params, parse_recorded_params

    if getattr(args, "cmd", None):  # verify -- CMD: its runs start as `run` starts them,
        return None  # never with the CPU profile of a params.yaml that happens to be here
    source = own_source()
    path = getattr(args, "params", None) or Path("params.yaml")
    if args.command == "evaluate":
        try:
            path = args.model
            params = parse_recorded_params(read_safetensors_metadata(path)["params"], str(path))
        except (OSError, ValueError, KeyError):
            return reexec_with_fixed_hash_seed(source)  # evaluate itself says what is wrong
    elif path.is_file():
        extra = overrides(args) if hasattr(args, "seed") else getattr(args, "overrides", [])
        params = load_params(path, extra)
    else:
        return reexec_with_fixed_hash_seed(source)
    profile = params.cpu.to_profile()
    if clashes := profile.contradictions():
        message = (
            f"{'; '.join(clashes)}: exported against cpu.profile: {profile.name}, cpu.threads: "
            f"{profile.threads} ({path}); unset it, or change cpu.profile / cpu.threads"
        )
        refuse_or_warn(params.deterministic, f"{message} (overriding them)")
    cublas = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if cublas is not None and cublas not in CUBLAS_DETERMINISTIC_CONFIGS:
        refuse_or_warn(
            params.deterministic,
            f"CUBLAS_WORKSPACE_CONFIG={cublas} is exported, which is not deterministic "
            f"(deterministic: {params.deterministic} in {path}); unset it, or export one of "
            f"{', '.join(CUBLAS_DETERMINISTIC_CONFIGS)}",
        )
    reexec_with_fixed_hash_seed({**profile.variables(), **source})


def own_source() -> dict[str, str]:
    """``{"PYTHONPATH": ...}`` that makes the restart import this repository's own
    ``src/reprotrain``, where the working folder has one and the reprotrain imported now is
    another (an editable install of the workspace, run from a copy of it: DVC runs queued
    and ``--temp`` experiments in copies under ``.dvc/tmp/exps``). Otherwise the copy's
    stages would run, and hash into the run ID, the workspace's current code, not the
    code DVC recorded for them. Empty where nothing is to change, or where the restart
    already asked for it (an interpreter that had imported reprotrain before: no loop).
    """
    import reprotrain

    local = Path.cwd() / "src"
    if not (local / "reprotrain" / "__init__.py").is_file():
        return {}
    if Path(reprotrain.__file__).parent.resolve() == (local / "reprotrain").resolve():
        return {}
    before = os.environ.get("PYTHONPATH", "")
    if before.split(os.pathsep)[0] == str(local):
        return {}
    return {"PYTHONPATH": os.pathsep.join(filter(None, (str(local), before)))}


def _warnings_as_one_line() -> None:
    """Print a DeterminismWarning as ``reprotrain: warning: ...`` (no file, line or source)."""
    import warnings

    from reprotrain.determinism import DeterminismWarning

    default = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        if issubclass(category, DeterminismWarning):
            print(f"reprotrain: warning: {message}", file=sys.stderr)
        else:
            default(message, category, filename, lineno, file, line)

    warnings.showwarning = show


#: errno -> what to do, for the storage errors that end a command with one line.
STORAGE_ERRORS = {
    errno.ENOSPC: "free disk space there and rerun",
    errno.EDQUOT: "free space in your quota and rerun",
    errno.EACCES: "make the folder writable (or point the stage elsewhere) and rerun",
    errno.EPERM: "make the folder writable (or point the stage elsewhere) and rerun",
    errno.EROFS: "the file system is read-only; point the stage at a writable folder",
}


def _fail(message: str, code: int, args: argparse.Namespace | None = None) -> int:
    """Print one error line; under ``dvc repro``, say where the stage's old outputs are.

    Called while the error is handled: its notes (PEP 678) end the line, among them the
    stage's own when it put the earlier outputs back (:mod:`reprotrain.pipeline.kept`),
    which then is the one note on where they are. A command asked for ``--json`` also
    prints ``{"error": line, "exit_code": code}`` on standard output, so a tool that
    parses it gets a report with no verdict, not nothing.
    """
    from reprotrain.pipeline.kept import PUT_BACK

    notes = [" ".join(str(note).split()) for note in getattr(sys.exception(), "__notes__", ())]
    message += "".join(f" ({note})" for note in notes)
    stage = os.environ.get("DVC_STAGE")
    env = stage.rpartition(":")[2] == "env" if stage else False  # pipelines/lm/dvc.yaml:env
    if stage and not env and not any(note.startswith(PUT_BACK) for note in notes):
        message += (
            f" (dvc repro removed stage {stage}'s previous outputs before running it; "
            f"`dvc checkout {stage}` restores them from the DVC cache, except those dvc.yaml "
            "marks cache: false: `git checkout` those, if committed)"
        )
    print(f"{ERROR_PREFIX}{message}", file=sys.stderr)
    wants_json = getattr(args, "json", False) is True  # --json, a flag (not a path)
    if wants_json:
        print(json.dumps({"error": message, "exit_code": code}, sort_keys=True))
    return code


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line with where to look, exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"{ERROR_PREFIX}{message}; see `{self.prog} --help`\n")
