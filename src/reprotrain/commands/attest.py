"""``reprotrain attest``: a signed statement of what a run is and how to train it again.

For the pipeline (``--dvc-yaml``, default ``dvc.yaml``) after ``dvc repro``, with
the run committed: an in-toto statement with SLSA provenance
(:mod:`reprotrain.provenance.attestation`) whose subjects are the train and
evaluate stages' outputs (weights, trace, run record, metrics, curves) and the
weights folder as ``model_signing`` digests it; its build definition is the
repository and commit, the resolved params and seed, the environment record
that decides the bits, and the code, data, locks, ``dvc.lock`` and base image
by digest; its ``invocationId`` is the run ID.

For a ``verify -- CMD --workdir W`` that proved IDENTICAL (``--verified W``):
the first run's files, the command, the commit and this host's environment
record (attest on the host that ran verify).

With a key (``--key``, or ``REPROTRAIN_SIGNING_KEY`` naming the PEM file, as
a CI job gets it from its secrets), optionally a certificate (``--cert``,
``--cert-chain``), it writes into ``--out`` (default ``attestation/`` beside
``dvc.yaml``, ignored by git): ``statement.json``, ``attestation.bundle.json``
(the DSSE envelope, :mod:`reprotrain.provenance.signing`) and ``model.sig``
(``model_signing``'s own signature of the weights folder, which
``model_signing verify`` checks alone). Without a key it writes the unsigned
statement and says so. It never runs as a stage: training needs no key, and
its code is in no stage's hash. Check with ``reprotrain verify-attestation``.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
from pathlib import Path
from typing import Any

from reprotrain import __version__
from reprotrain.atomic import atomic_write_bytes
from reprotrain.commands._git import git
from reprotrain.hashing import canonical_json, sha256_file
from reprotrain.pipeline.command import Command, add_dvc_yaml, stage_arguments
from reprotrain.pipeline.errors import DataError
from reprotrain.pipeline.run_record import load_environment
from reprotrain.provenance.identity import run_id

PARAMS: tuple[str, ...] = ()
#: The environment variable a CI job sets to the signing key's PEM file.
KEY_VARIABLE = "REPROTRAIN_SIGNING_KEY"
STATEMENT_FILE = "statement.json"
BUNDLE_FILE = "attestation.bundle.json"
MODEL_SIGNATURE_FILE = "model.sig"
BUILDER = f"https://pypi.org/project/reprotrain/{__version__}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_dvc_yaml(parser)
    parser.add_argument(
        "--verified",
        type=Path,
        metavar="WORKDIR",
        help="attest a `verify -- CMD --workdir WORKDIR` that proved IDENTICAL instead",
    )
    parser.add_argument("--out", type=Path, help="folder for the files (default: attestation/)")
    parser.add_argument(
        "--key", type=Path, help=f"ECDSA P-256/P-384 private key, PEM (default: ${KEY_VARIABLE})"
    )
    parser.add_argument("--cert", type=Path, help="the key's certificate, PEM")
    parser.add_argument(
        "--cert-chain", type=Path, help="with --cert: its issuers up to the root, PEM"
    )


COMMAND = Command("write a signed statement of the run (in-toto, SLSA provenance)", add_arguments)


def run(_: object, args: argparse.Namespace) -> str:
    from reprotrain.provenance.attestation import build_statement, statement_bytes

    key = args.key or (Path(os.environ[KEY_VARIABLE]) if os.environ.get(KEY_VARIABLE) else None)
    if args.cert is not None and (key is None or args.cert_chain is None):
        raise DataError(
            "--cert: give the certificate's private key (--key) and its chain up to the root "
            "(--cert-chain, PEM), which model_signing's signature carries too"
        )
    signer = _signer(key, args.cert, args.cert_chain)
    if args.verified is not None:
        root, subjects, weights, provenance = _verified_command(args.verified)
        out = args.out or args.verified / "attestation"
    else:
        root, subjects, weights, provenance = _pipeline_run(args.dvc_yaml)
        out = args.out or args.dvc_yaml.parent / "attestation"
    statement = build_statement(subjects, provenance)
    out.mkdir(parents=True, exist_ok=True)
    for earlier in (BUNDLE_FILE, MODEL_SIGNATURE_FILE):  # an earlier run's, never beside this one
        (out / earlier).unlink(missing_ok=True)
    payload = statement_bytes(statement)
    atomic_write_bytes(out / STATEMENT_FILE, payload)
    short_id = provenance.invocation_id[:12]
    if signer is None:
        return (
            f"statement of run {short_id} ({len(subjects)} subjects) -> {out / STATEMENT_FILE}, "
            f"UNSIGNED: no key (--key, or ${KEY_VARIABLE} naming a PEM file)"
        )
    from reprotrain.provenance.signing import sign_bundle

    bundle = sign_bundle(payload, signer)
    atomic_write_bytes(out / BUNDLE_FILE, (canonical_json(bundle) + "\n").encode())
    _model_signature(root / weights, out / MODEL_SIGNATURE_FILE, key, args.cert, args.cert_chain)
    return (
        f"signed statement of run {short_id} ({len(subjects)} subjects) -> {out / BUNDLE_FILE}; "
        f"model_signing signature of {weights}/ -> {out / MODEL_SIGNATURE_FILE}"
    )


def _signer(key: Path | None, cert: Path | None, chain: Path | None) -> Any:
    if key is None:
        return None
    from reprotrain.provenance.signing import SignatureRefused, load_signer

    try:
        return load_signer(key, cert, chain)
    except SignatureRefused as err:
        raise DataError(str(err)) from None


def _model_signature(
    folder: Path, out: Path, key: Path, cert: Path | None, chain: Path | None
) -> None:
    """``model_signing``'s signature of the weights folder, verifiable by its own CLI."""
    import model_signing

    config = model_signing.signing.Config()
    if cert is None:
        config.use_elliptic_key_signer(private_key=key)
    else:
        config.use_certificate_signer(
            private_key=key, signing_certificate=cert, certificate_chain=[chain]
        )
    config.sign(folder, out)


def repository_of(root: Path) -> tuple[str, str]:
    """The repository's URL (its ``origin``, else its path) and HEAD; refuses a tree whose
    tracked files differ from HEAD: the statement would name a commit that did not train."""
    changed = git(root, "status", "--porcelain", "--untracked-files=no").splitlines()
    if changed:
        names = ", ".join(line[3:] for line in changed[:3])
        raise DataError(
            f"{names}{' ...' if len(changed) > 3 else ''}: changed since the last commit; "
            "commit the run (code, params, dvc.lock, reports/) first, then attest it"
        )
    commit = git(root, "rev-parse", "HEAD").strip()
    done = subprocess.run(
        ["git", "remote", "get-url", "origin"], cwd=root, capture_output=True, text=True
    )
    url = done.stdout.strip() if done.returncode == 0 else str(root)
    if "://" not in url and Path(url).is_dir():  # a folder: as a file URL
        url = Path(url).resolve().as_uri()
    return url, commit


def _pipeline_run(dvc_yaml: Path) -> tuple[Path, list[dict], str, Any]:
    """The subjects and provenance of the pipeline's committed run."""
    import yaml

    from reprotrain.provenance.attestation import (
        PIPELINE_BUILD,
        Provenance,
        file_subjects,
        folder_subject,
    )

    if not dvc_yaml.is_file():
        raise DataError(f"{dvc_yaml}: no pipeline here; run attest where dvc.yaml is")
    base = dvc_yaml.parent.resolve()
    root = Path(git(base, "rev-parse", "--show-toplevel").strip())
    repository, commit = repository_of(root)
    train, evaluate = stage_arguments("train", dvc_yaml), stage_arguments("evaluate", dvc_yaml)
    files = [train.model, train.trace, train.run_record, train.metrics, evaluate.metrics]
    files += sorted(p for p in (base / train.plots).rglob("*") if p.is_file())
    missing = [str(f) for f in files if not (base / f).is_file()]
    if missing:
        raise DataError(f"{', '.join(missing)}: not there; run `dvc repro` first")
    names = [str((base / f).relative_to(root)) for f in files]
    weights = str((base / train.model).parent.relative_to(root))
    record = _json(base / train.run_record)
    environment = load_environment(base / train.env)
    params = yaml.safe_load((base / "params.yaml").read_text())
    inputs = record["inputs"]
    pipeline = str(dvc_yaml.resolve().relative_to(root))
    dependencies = [
        _source(repository, commit),
        _resource("code (the train stage's import closure)", "sha256", inputs["code_sha256"]),
        *(_resource(path, "md5", md5) for path, md5 in inputs["data_md5"].items()),
        *_file_dependencies(root, [base / "dvc.lock", *sorted(root.glob("requirements*.lock"))]),
        *_image_dependencies(root, environment),
    ]
    provenance = Provenance(
        build_type=PIPELINE_BUILD,
        external={
            "repository": repository,
            "commit": commit,
            "pipeline": pipeline,
            "stage": "train",
            "params": {"params.yaml": params, "recipe": inputs["recipe"]},
            "seed": params["seed"],
        },
        internal={"environment": environment},
        dependencies=dependencies,
        builder=BUILDER,
        invocation_id=record["run_id"],
    )
    subjects = [*file_subjects(root, names), folder_subject(root, weights)]
    return root, subjects, weights, provenance


def _verified_command(workdir: Path) -> tuple[Path, list[dict], str, Any]:
    """The subjects and provenance of a ``verify -- CMD --workdir`` that proved identical."""
    from reprotrain.commands._runfolders import VERIFIED_FILE
    from reprotrain.provenance.attestation import (
        COMMAND_BUILD,
        Provenance,
        file_subjects,
        folder_subject,
    )
    from reprotrain.provenance.environment import bit_deciding, capture_environment

    verified = workdir / VERIFIED_FILE
    if not verified.is_file():
        raise DataError(
            f"{verified}: not there; attest a `reprotrain verify --workdir {workdir} -- CMD` "
            "that ended IDENTICAL"
        )
    facts = _json(verified)
    if not Path(facts["cwd"]).is_dir():
        raise DataError(f"{verified}: verify ran in {facts['cwd']}, which is gone; attest there")
    run = workdir / "run-0"
    root = Path(git(Path(facts["cwd"]), "rev-parse", "--show-toplevel").strip())
    repository, commit = repository_of(root)
    if commit != facts["commit"]:
        raise DataError(
            f"{verified}: verify ran at commit {facts['commit'][:12]}, HEAD is {commit[:12]}; "
            "check out that commit to attest it"
        )
    names = sorted(str(p.relative_to(workdir)) for p in run.rglob("*") if p.is_file())
    environment = bit_deciding(capture_environment(None))
    external = {
        "repository": repository,
        "commit": commit,
        "command": facts["command"],
        "workingDirectory": str(Path(facts["cwd"]).resolve().relative_to(root)),
        "launch": facts["launch"],
    }
    invocation = run_id({"external": external, "environment": environment})
    provenance = Provenance(
        build_type=COMMAND_BUILD,
        external=external,
        internal={"environment": environment},
        dependencies=[
            _source(repository, commit),
            *_file_dependencies(root, sorted(root.glob("requirements*.lock"))),
        ],
        builder=BUILDER,
        invocation_id=invocation,
    )
    subjects = [*file_subjects(workdir, names), folder_subject(workdir, "run-0")]
    return workdir, subjects, "run-0", provenance


def _resource(name: str, algorithm: str, digest: str, uri: str | None = None) -> dict[str, Any]:
    """An in-toto ResourceDescriptor."""
    found: dict[str, Any] = {"name": name, "digest": {algorithm: digest}}
    return found if uri is None else {**found, "uri": uri}


def _source(repository: str, commit: str) -> dict[str, Any]:
    return _resource("source", "gitCommit", commit, f"git+{repository}@{commit}")


def _file_dependencies(root: Path, files: list[Path]) -> list[dict[str, Any]]:
    return [
        _resource(str(f.relative_to(root)), "sha256", sha256_file(f)) for f in files if f.is_file()
    ]


def _image_dependencies(root: Path, environment: dict[str, Any]) -> list[dict[str, Any]]:
    """The Dockerfile's digest-pinned base image, and the image the run was in, if any."""
    found = []
    dockerfile = root / "Dockerfile"
    text = dockerfile.read_text() if dockerfile.is_file() else ""
    if match := re.search(r"^ARG BASE_IMAGE=(\S+)@sha256:([0-9a-f]{64})$", text, re.M):
        name, digest = match.groups()
        found.append(_resource("base image (Dockerfile)", "sha256", digest, f"docker://{name}"))
    image = environment.get("container", {}).get("image_id", "none")
    if image != "none":
        found.append(_resource("container image", "sha256", image.removeprefix("sha256:")))
    return found


def _json(path: Path) -> dict[str, Any]:
    import json

    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise DataError(f"{path}: cannot read it as JSON ({err}); rerun `dvc repro`") from None
