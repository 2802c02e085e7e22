"""``reprotrain verify-attestation BUNDLE``: check a signed run statement, offline; rebuild it.

Checks, in order, and stops at the first that fails with one verdict line:

1. the bundle is one (:mod:`reprotrain.provenance.signing`) and its DSSE
   signature verifies with ``--key PUB`` (PEM), or with the certificate it
   carries, chained to a root in ``--cert-chain`` and valid now;
2. the payload is a complete in-toto/SLSA statement of a build type reprotrain
   knows, with exactly that build's parameters
   (:func:`~reprotrain.provenance.attestation.check_statement`);
3. it is for the commit expected: ``--commit``, else ``--root``'s HEAD where
   that is a git checkout;
4. every subject's digest matches the file under ``--root`` (default: the
   repository around the current folder), the weights folder as
   ``model_signing`` digests it.

``--rebuild`` then trains it again: a clean clone of the
attested commit from ``--repo`` (default: the repository the statement names),
the commit's package installed from its own lock into its own environment
(:func:`~reprotrain.commands._rebuild.clone_environment`), the env stage's
record compared with the attested one (another record: UNVERIFIABLE HERE,
naming the fields, exit 7: another GPU model, or another CPU under ``native``,
cannot rebuild the bits), then ``dvc repro`` of the attested pipeline and every subject compared:
REBUILT, or NOT REBUILT naming the subjects that differ and, where ``--root``
holds the attested trace, the first diverging step. A verified command is run
once in the clone's working directory under the launch pins verify used, its
``{out}`` the rebuild's ``run-0``, and its files compared the same way.

Exit codes: 0 VERIFIED or REBUILT; 1 REJECTED (a check above failed) or NOT
REBUILT; 2 bad input (a file missing, a key that is no key); 7 UNVERIFIABLE
HERE. Nothing reaches a network but ``--repo``'s clone.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from reprotrain.commands._children import run_child
from reprotrain.commands._exit_codes import EXIT_CHECK_FAILED, EXIT_UNVERIFIABLE_HERE
from reprotrain.commands._git import git
from reprotrain.commands._rebuild import python_of
from reprotrain.pipeline.command import Command, stage_arguments
from reprotrain.pipeline.errors import DataError
from reprotrain.pipeline.run_record import load_environment

PARAMS: tuple[str, ...] = ()
VERDICT = "reprotrain verify-attestation:"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("bundle", type=Path, help="the attestation bundle (reprotrain attest)")
    trust = parser.add_mutually_exclusive_group(required=True)
    trust.add_argument("--key", type=Path, help="the signer's public key, PEM")
    trust.add_argument(
        "--cert-chain", type=Path, help="the certificates to trust (PEM): roots, intermediates"
    )
    parser.add_argument(
        "--root", type=Path, help="where the attested files are (default: this repository)"
    )
    parser.add_argument("--commit", help="the commit the statement must be for")
    parser.add_argument("--rebuild", action="store_true", help="train it again and compare")
    parser.add_argument("--repo", help="with --rebuild: the repository to clone (URL or folder)")
    parser.add_argument(
        "--workdir",
        type=Path,
        help="with --rebuild: keep the clone and its environment here, to reuse (default: removed)",
    )


COMMAND = Command("check a signed run statement, offline; --rebuild trains it again", add_arguments)


def run(_: object, args: argparse.Namespace) -> int:
    from reprotrain.provenance.attestation import StatementRefused
    from reprotrain.provenance.signing import SignatureRefused

    for path in (args.bundle, args.key, args.cert_chain):
        if path is not None and not path.is_file():
            raise DataError(f"{path}: no such file")
    root = args.root or _repository_root(Path.cwd())
    trust = _trust(args)
    try:
        statement = _verified_statement(args.bundle, *trust)
        _check_commit(statement, args.commit, root)
        if not args.rebuild:
            _check_subjects(statement, root)
    except (SignatureRefused, StatementRefused) as err:
        print(f"{VERDICT} REJECTED: {err}")
        return EXIT_CHECK_FAILED
    from reprotrain.provenance.attestation import external

    facts = external(statement)
    run_id = statement["predicate"]["runDetails"]["metadata"]["invocationId"][:12]
    if not args.rebuild:
        print(
            f"{VERDICT} VERIFIED: run {run_id} at commit {facts['commit'][:12]}, signature good, "
            f"{len(statement['subject'])} subjects match under {root}"
        )
        return 0
    return _rebuild(statement, args, root)


def _trust(args: argparse.Namespace) -> tuple[Any, list[Any] | None]:
    """The public key or the trusted certificates; one that is none is bad input (exit 2)."""
    from reprotrain.provenance.signing import (
        SignatureRefused,
        load_certificates,
        load_public_key,
    )

    try:
        if args.key is not None:
            return load_public_key(args.key), None
        return None, load_certificates(args.cert_chain)
    except SignatureRefused as err:
        raise DataError(str(err)) from None


def _verified_statement(bundle_file: Path, key: Any, roots: list[Any] | None) -> dict[str, Any]:
    from reprotrain.provenance.attestation import StatementRefused, check_statement
    from reprotrain.provenance.signing import read_bundle, verify_bundle

    payload = verify_bundle(read_bundle(bundle_file), public_key=key, roots=roots)
    try:
        statement = json.loads(payload)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise StatementRefused(f"the signed payload is not JSON ({err})") from None
    return check_statement(statement)


def _repository_root(folder: Path) -> Path:
    done = subprocess.run(
        ["git", "rev-parse", "--show-toplevel"], cwd=folder, capture_output=True, text=True
    )
    return Path(done.stdout.strip()) if done.returncode == 0 else folder


def _check_commit(statement: dict[str, Any], expected: str | None, root: Path) -> None:
    from reprotrain.provenance.attestation import StatementRefused, external

    attested = external(statement)["commit"]
    where = "--commit"
    if expected is not None:  # a revision of the repository here (HEAD, a tag), or a sha
        named = subprocess.run(
            ["git", "rev-parse", "--verify", "--quiet", f"{expected}^{{commit}}"],
            capture_output=True,
            text=True,
        )
        expected = named.stdout.strip() if named.returncode == 0 else expected
    elif (root / ".git").exists():
        expected, where = git(root, "rev-parse", "HEAD").strip(), f"{root} (HEAD)"
    if expected is not None and not attested.startswith(expected) and attested != expected:
        raise StatementRefused(
            f"the statement is for commit {attested[:12]}, not {expected[:12]} ({where}): "
            "another commit's run"
        )


def _check_subjects(statement: dict[str, Any], root: Path) -> None:
    from reprotrain.provenance.attestation import StatementRefused, subject_mismatches

    if mismatches := subject_mismatches(statement, root):
        more = f" (and {len(mismatches) - 1} more)" if len(mismatches) > 1 else ""
        raise StatementRefused(f"{mismatches[0]}{more}: not the attested files")


def _rebuild(statement: dict[str, Any], args: argparse.Namespace, root: Path) -> int:
    from reprotrain.commands._rebuild import DEFAULT_LOCK, clone_at, clone_environment
    from reprotrain.provenance.attestation import PIPELINE_BUILD, external, internal

    facts, attested = external(statement), internal(statement)["environment"]
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="reprotrain-rebuild-", dir=args.workdir))
    clone = clone_at(args.repo or facts["repository"], facts["commit"], scratch / "repo")
    lock = attested["lock"] or {
        "file": DEFAULT_LOCK, "sha256": _sha256_or_none(clone / DEFAULT_LOCK)
    }  # fmt: skip
    # in --workdir, one environment per lock's bytes, kept for the next rebuild of that lock
    # (a verified command's statement names no lock: the clone's default lock's bytes decide)
    venv = args.workdir / f"venv-{lock['sha256'][:12]}" if args.workdir is not None else None
    variables = clone_environment(clone, lock["file"], fresh=True, venv=venv)
    if statement["predicate"]["buildDefinition"]["buildType"] != PIPELINE_BUILD:
        return _rebuild_command(statement, facts, clone, variables, scratch, args.workdir)
    dvc = [python_of(variables), "-m", "dvc", "repro", "--no-run-cache"]
    pipeline = facts["pipeline"]
    _run([*dvc, "--single-item", f"{pipeline}:env"], clone, variables)
    env_out = stage_arguments("env", clone / pipeline).out
    here = load_environment(clone / Path(pipeline).parent / env_out)
    if differing := _differing_fields(attested, here):
        return _unverifiable(differing, clone)
    _run([*dvc, pipeline], clone, variables)
    return _compare_rebuilt(statement, clone, root, scratch, keep=args.workdir is not None)


def _sha256_or_none(path: Path) -> str:
    from reprotrain.hashing import sha256_file

    return sha256_file(path) if path.is_file() else "none"


def _rebuild_command(
    statement: dict[str, Any],
    facts: dict[str, Any],
    clone: Path,
    variables: dict[str, str],
    scratch: Path,
    workdir: Path | None,
) -> int:
    """A verified command (``facts``, its externalParameters) run once more in the clone,
    under the pins verify used."""
    from reprotrain.provenance.attestation import internal

    probe = "import json; from reprotrain.provenance.environment import bit_deciding as b, "
    probe += "capture_environment as c; print(json.dumps(b(c(None))))"
    shown = subprocess.run(
        [python_of(variables), "-c", probe], env=variables, capture_output=True, text=True
    )
    if shown.returncode != 0:
        raise DataError(f"the clone's environment record: {shown.stderr.strip()[-300:]}")
    if differing := _differing_fields(internal(statement)["environment"], json.loads(shown.stdout)):
        return _unverifiable(differing, clone)
    out = scratch / "run-0"  # the subjects are named run-0/... as verify's first run
    out.mkdir()
    argv = [part.replace("{out}", str(out)) for part in facts["command"]]
    env = {**variables, **facts["launch"], "REPROTRAIN_OUT": str(out), "REPROTRAIN_RUN_INDEX": "0"}
    _run(argv, clone / facts["workingDirectory"], env, name=" ".join(facts["command"]))
    return _compare_rebuilt(statement, scratch, None, scratch, keep=workdir is not None)


def _unverifiable(differing: list[str], clone: Path) -> int:
    print(f"{VERDICT} UNVERIFIABLE HERE: this host's record differs in {', '.join(differing)}")
    print(f"  (the clone is kept: {clone})")
    return EXIT_UNVERIFIABLE_HERE


def _compare_rebuilt(
    statement: dict[str, Any], clone: Path, root: Path | None, scratch: Path, keep: bool
) -> int:
    from reprotrain.provenance.attestation import external, subject_mismatches

    run_id = statement["predicate"]["runDetails"]["metadata"]["invocationId"][:12]
    mismatches = subject_mismatches(statement, clone)
    if not mismatches:
        if not keep:
            shutil.rmtree(scratch, ignore_errors=True)
        print(
            f"{VERDICT} REBUILT: run {run_id} at commit {external(statement)['commit'][:12]}, "
            f"all {len(statement['subject'])} subjects the attested bytes"
        )
        return 0
    print("subjects the rebuild made differently:")
    print("\n".join(f"  {line}" for line in mismatches))
    if root is not None and (step := _first_diverging_step(statement, clone, root)):
        print(step)
    print(f"{VERDICT} NOT REBUILT: {len(mismatches)} subjects differ (clone kept: {clone})")
    return EXIT_CHECK_FAILED


def _first_diverging_step(statement: dict[str, Any], clone: Path, root: Path) -> str | None:
    """The comparison of the attested run (its files under ``root``, where they are the
    attested bytes) with the rebuilt one: first diverging step and record."""
    from reprotrain.commands._findrun import RunFiles, train_outputs
    from reprotrain.commands._rundiff import compare_runs
    from reprotrain.provenance.attestation import external, subject_mismatches

    pipeline = Path(external(statement)["pipeline"])
    layout = train_outputs(clone / pipeline)
    named = {key: pipeline.parent / path for key, path in layout.items()}
    attested = {s["name"] for s in statement["subject"]}
    if str(named["trace"]) not in attested or not (root / named["trace"]).is_file():
        return None
    trace = [s for s in statement["subject"] if s["name"] == str(named["trace"])]
    if subject_mismatches({**statement, "subject": trace}, root):
        return None  # the trace under --root is not the attested one
    mine = {key: root / path if (root / path).is_file() else None for key, path in named.items()}
    rebuilt = {key: clone / path for key, path in named.items()}
    return compare_runs(RunFiles("attested", **mine), RunFiles("rebuilt", **rebuilt)).to_text()


def _differing_fields(attested: dict[str, Any], here: dict[str, Any]) -> list[str]:
    from reprotrain.provenance.envdiff import compare_environments

    return [
        f"{d.key} ({d.a!r} attested, {d.b!r} here)" for d in compare_environments(attested, here)
    ]


def _run(argv: list[str], cwd: Path, variables: dict[str, str], name: str = "") -> None:
    try:
        done = run_child(
            argv, cwd=cwd, env=variables, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    except OSError as err:
        raise DataError(f"{argv[0]}: {err.strerror} (in {cwd})") from None
    if done.returncode != 0:
        lines = f"{done.stderr}\n{done.stdout}".strip().splitlines()
        errors = [line for line in lines if "error" in line.lower()] or lines[-3:]
        said = name or " ".join(argv[2:])
        raise DataError(f"{said} failed in {cwd}: {' / '.join(errors[:3])}")
