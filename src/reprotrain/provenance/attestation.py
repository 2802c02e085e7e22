"""In-toto statements with SLSA provenance: what a run is, in a form an outsider can check.

A statement (in-toto Statement v1, predicate SLSA Provenance v1) names

* ``subject``: the run's output files by sha256, and the weights folder by the
  digest sigstore's ``model_signing`` computes over it (so its own signature
  of the folder and this statement name one digest);
* ``buildDefinition``: a ``buildType`` from :data:`BUILD_TYPES` (each says how
  to rebuild, docs/attestation.md), ``externalParameters`` (exactly the keys
  that build type lists: repository, git commit, resolved params, seed,
  stage...), ``internalParameters`` (the environment record that decides the
  bits) and ``resolvedDependencies`` (code, data, locks, ``dvc.lock``, image);
* ``runDetails``: the builder and, as ``invocationId``, the run ID.

:func:`check_statement` parses one back with the in-toto and SLSA schemas
(``in_toto_attestation``'s protobufs: an unknown field is refused) and refuses a
build type it does not know or parameters it does not expect, in one line
(:class:`StatementRefused`). Signing is :mod:`reprotrain.provenance.signing`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reprotrain.hashing import sha256_file

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PROVENANCE_TYPE = "https://slsa.dev/provenance/v1"
#: A DVC pipeline of reprotrain, rebuilt by ``reprotrain verify-attestation --rebuild``.
PIPELINE_BUILD = "urn:reprotrain:build:dvc-pipeline:v1"
#: A command proved by ``reprotrain verify -- CMD``; rebuilt by running it at the commit.
COMMAND_BUILD = "urn:reprotrain:build:verified-command:v1"
#: Each build type -> exactly the externalParameters it takes.
BUILD_TYPES: dict[str, frozenset[str]] = {
    PIPELINE_BUILD: frozenset({"repository", "commit", "pipeline", "stage", "params", "seed"}),
    COMMAND_BUILD: frozenset({"repository", "commit", "command", "workingDirectory", "launch"}),
}
#: The subject annotation that marks a folder digest computed as model_signing does.
FOLDER_DIGEST = "model_signing"


class StatementRefused(ValueError):
    """A statement that is incomplete, of an unknown kind, or not what its files are."""


@dataclass(frozen=True)
class Provenance:
    """What :func:`build_statement` needs beside the subjects."""

    build_type: str
    external: Mapping[str, Any]
    internal: Mapping[str, Any]
    dependencies: list[dict[str, Any]]
    builder: str
    invocation_id: str


def file_subjects(root: Path, names: Iterable[str]) -> list[dict[str, Any]]:
    """A subject per file (sha256), named by its path under ``root``."""
    return [{"name": name, "digest": {"sha256": sha256_file(root / name)}} for name in names]


def folder_subject(root: Path, name: str) -> dict[str, Any]:
    """The folder ``root/name`` as a subject, with the digest model_signing signs for it."""
    return {
        "name": name.rstrip("/") + "/",
        "digest": {"sha256": model_signing_digest(root / name)},
        "annotations": {"digest": FOLDER_DIGEST},
    }


def model_signing_digest(folder: Path) -> str:
    """The digest ``model_signing`` puts in its signature's subject for ``folder``: sha256
    over each file's sha256 (git files ignored, as its default configuration does)."""
    from model_signing import hashing
    from model_signing._signing.signing import Payload

    return Payload(hashing.Config().hash(folder)).statement.pb.subject[0].digest["sha256"]


def build_statement(subjects: list[dict[str, Any]], provenance: Provenance) -> dict[str, Any]:
    """The statement as JSON-ready data (checked by :func:`check_statement` before use)."""
    statement = {
        "_type": STATEMENT_TYPE,
        "subject": subjects,
        "predicateType": PROVENANCE_TYPE,
        "predicate": {
            "buildDefinition": {
                "buildType": provenance.build_type,
                "externalParameters": dict(provenance.external),
                "internalParameters": dict(provenance.internal),
                "resolvedDependencies": provenance.dependencies,
            },
            "runDetails": {
                "builder": {"id": provenance.builder},
                "metadata": {"invocationId": provenance.invocation_id},
            },
        },
    }
    check_statement(statement)
    return statement


def statement_bytes(statement: Mapping[str, Any]) -> bytes:
    """The statement's bytes as signed: sorted keys, two-space indent, one final newline."""
    return (json.dumps(statement, indent=2, sort_keys=True) + "\n").encode()


def check_statement(statement: Any) -> dict[str, Any]:
    """``statement`` if it is a complete statement of a known build; else one line why."""
    from google.protobuf import json_format
    from in_toto_attestation.predicates.provenance.v1 import provenance_pb2
    from in_toto_attestation.v1.statement import Statement
    from in_toto_attestation.v1.statement_pb2 import Statement as StatementMessage

    if not isinstance(statement, dict):
        raise StatementRefused("the payload is not a JSON object")
    try:
        parsed = json_format.ParseDict(statement, StatementMessage())
        Statement.copy_from_pb(parsed).validate()
        if statement["predicateType"] != PROVENANCE_TYPE:
            raise ValueError(f"predicateType {statement['predicateType']!r} is not SLSA v1")
        predicate = json_format.ParseDict(statement["predicate"], provenance_pb2.Provenance())
    except (json_format.ParseError, ValueError, KeyError) as err:
        raise StatementRefused(f"not a complete in-toto/SLSA statement: {err}") from None
    definition = predicate.build_definition
    if definition.build_type not in BUILD_TYPES:
        raise StatementRefused(f"buildType {definition.build_type!r} is not one reprotrain knows")
    given = set(statement["predicate"]["buildDefinition"].get("externalParameters", {}))
    expected = BUILD_TYPES[definition.build_type]
    if given != expected:
        unknown, missing = sorted(given - expected), sorted(expected - given)
        raise StatementRefused(
            f"externalParameters: unknown {unknown}, missing {missing} for {definition.build_type}"
        )
    if not predicate.run_details.metadata.invocation_id:
        raise StatementRefused("runDetails.metadata.invocationId (the run ID) is missing")
    return statement


def external(statement: Mapping[str, Any]) -> dict[str, Any]:
    return statement["predicate"]["buildDefinition"]["externalParameters"]


def internal(statement: Mapping[str, Any]) -> dict[str, Any]:
    return statement["predicate"]["buildDefinition"]["internalParameters"]


def subject_mismatches(statement: Mapping[str, Any], root: Path) -> list[str]:
    """One line per subject that ``root`` lacks or holds with another digest."""
    lines = []
    for subject in statement["subject"]:
        name, want = subject["name"], subject["digest"].get("sha256")
        path = root / name
        if not path.exists():
            lines.append(f"{name}: missing under {root}")
            continue
        folder = subject.get("annotations", {}).get("digest") == FOLDER_DIGEST
        have = model_signing_digest(path) if folder else sha256_file(path)
        if have != want:
            lines.append(f"{name}: sha256 {have[:12]}, attested {str(want)[:12]}")
    return lines
