"""Signed statements of a run: attest, verify-attestation, the tamper catalog, and rebuilds.

Every check is offline. Keys and certificates are made here with pyca/cryptography:
a P-256 key pair, another one (the wrong signer), a root CA with a code-signing leaf,
an expired leaf and a leaf of another CA. Each tampered bundle must be refused with
one ``REJECTED`` line and exit 1 (never a traceback); the untampered one is the
control. ``--rebuild`` trains the attested commit again in a clean clone with its own
environment (slow): REBUILT, and NOT REBUILT where the committed outputs are not what
the commit's code makes.
"""

from __future__ import annotations

import base64
import datetime
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from reprotrain.hashing import sha256_file
from reprotrain.provenance.attestation import (
    BUILD_TYPES,
    COMMAND_BUILD,
    PIPELINE_BUILD,
    StatementRefused,
    check_statement,
    model_signing_digest,
    statement_bytes,
)
from reprotrain.provenance.signing import load_signer, sign_bundle
from tests.helpers import commit_all, edit_once, run_checked, run_cli

BUNDLE = Path("attestation") / "attestation.bundle.json"
VERDICT = "reprotrain verify-attestation: "
NOW = datetime.datetime.now(datetime.UTC)
DAY = datetime.timedelta(days=1)


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem(key: ec.EllipticCurvePrivateKey, path: Path) -> Path:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return path


def _public(key: ec.EllipticCurvePrivateKey, path: Path) -> Path:
    path.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return path


def _cert(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[str, ec.EllipticCurvePrivateKey] | None = None,
    days: tuple[int, int] = (-1, 30),
) -> x509.Certificate:
    """A certificate for ``key``: a CA when self-signed, else a code-signing leaf."""
    name, signer = issuer or (subject, key)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(NOW + days[0] * DAY)
        .not_valid_after(NOW + days[1] * DAY)
        .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), True)
    )
    if issuer is not None:
        usage = dict.fromkeys(
            ("content_commitment", "key_encipherment", "data_encipherment", "key_agreement",
             "key_cert_sign", "crl_sign", "encipher_only", "decipher_only"), False,
        )  # fmt: skip
        builder = builder.add_extension(x509.KeyUsage(digital_signature=True, **usage), True)
        builder = builder.add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CODE_SIGNING]), False
        )
    return builder.sign(signer, hashes.SHA256())


def _write_cert(cert: x509.Certificate, path: Path) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """PEM files: a signer and its public key, another public key, a CA with a leaf, an
    expired leaf, and a leaf of another CA."""
    folder = tmp_path_factory.mktemp("keys")
    signer, other, root, stranger = _key(), _key(), _key(), _key()
    leaf = _cert("run signer", signer, ("reprotrain test CA", root))
    expired = _cert("run signer", signer, ("reprotrain test CA", root), days=(-30, -1))
    foreign = _cert("run signer", signer, ("another CA", stranger))
    return {
        "key": _pem(signer, folder / "key.pem"),
        "pub": _public(signer, folder / "pub.pem"),
        "other_pub": _public(other, folder / "other.pem"),
        "root": _write_cert(_cert("reprotrain test CA", root), folder / "root.pem"),
        "leaf": _write_cert(leaf, folder / "leaf.pem"),
        "expired": _write_cert(expired, folder / "expired.pem"),
        "foreign": _write_cert(foreign, folder / "foreign.pem"),
    }


@pytest.fixture(scope="module")
def attested(dvc_repo: Path, keys: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    """The committed pipeline run, attested with the key (and, beside, with the leaf)."""
    repo = Path(shutil.copytree(dvc_repo, tmp_path_factory.mktemp("att") / "r", symlinks=True))
    done = run_cli("attest", "--key", keys["key"], cwd=repo)
    assert done.returncode == 0, done.stderr
    assert f"-> {BUNDLE}" in done.stdout and "model.sig" in done.stdout, done.stdout
    certified = run_cli(
        *("attest", "--key", keys["key"], "--cert", keys["leaf"], "--cert-chain", keys["root"]),
        *("--out", "by-cert"),
        cwd=repo,
    )
    assert certified.returncode == 0, certified.stderr
    return repo


@pytest.fixture
def repo(attested: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(attested, tmp_path / "r", symlinks=True))


def _verify(repo: Path, bundle: Path | str, *trust: str | Path, **env: str):
    return run_cli("verify-attestation", bundle, *trust, cwd=repo, **env)


def _statement(repo: Path) -> dict:
    return json.loads((repo / "attestation" / "statement.json").read_text())


def test_a_committed_run_is_attested_verified_and_its_weights_signed_for_model_signing(
    repo: Path, keys: dict[str, Path]
) -> None:
    done = _verify(repo, BUNDLE, "--key", keys["pub"])
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith(f"{VERDICT}VERIFIED: run ") and "signature good" in done.stdout
    statement = _statement(repo)
    record = json.loads((repo / "reports" / "run.json").read_text())
    definition = statement["predicate"]["buildDefinition"]
    head = run_checked("git", "rev-parse", "HEAD", cwd=repo).strip()
    assert statement["predicate"]["runDetails"]["metadata"]["invocationId"] == record["run_id"]
    assert definition["buildType"] == PIPELINE_BUILD
    assert definition["externalParameters"]["commit"] == head
    assert definition["externalParameters"]["seed"] == 42
    environment = json.loads((repo / "reports" / "environment.json").read_text())
    assert definition["internalParameters"]["environment"] == environment
    dependencies = {d["name"]: d["digest"] for d in definition["resolvedDependencies"]}
    assert dependencies["requirements-cpu.lock"]["sha256"] == environment["lock"]["sha256"]
    assert dependencies["source"] == {"gitCommit": head}
    names = {s["name"] for s in statement["subject"]}
    assert {"models/model.safetensors", "models/trace.safetensors", "reports/metrics.json"} <= names
    # model_signing's own verifier accepts its signature of the weights folder, whose
    # digest is the statement's subject for it.
    folder = {s["name"]: s["digest"]["sha256"] for s in statement["subject"]}["models/"]
    assert folder == model_signing_digest(repo / "models")
    signature = json.loads((repo / "attestation" / "model.sig").read_text())
    payload = json.loads(base64.b64decode(signature["dsseEnvelope"]["payload"]))
    assert payload["subject"][0]["digest"]["sha256"] == folder
    model_signing = Path(sys.executable).parent / "model_signing"
    argv = [model_signing, "verify", "key", "models", "--signature", "attestation/model.sig"]
    accepted = subprocess.run(
        [*argv, "--public_key", keys["pub"]], cwd=repo, capture_output=True, text=True
    )
    assert accepted.returncode == 0, accepted.stdout + accepted.stderr
    # Control: another key is refused by model_signing too.
    refused = subprocess.run(
        [*argv, "--public_key", keys["other_pub"]], cwd=repo, capture_output=True, text=True
    )
    assert refused.returncode != 0


def test_a_certificate_signed_bundle_verifies_against_its_root(
    repo: Path, keys: dict[str, Path]
) -> None:
    done = _verify(repo, "by-cert/attestation.bundle.json", "--cert-chain", keys["root"])
    assert done.returncode == 0, done.stdout + done.stderr
    assert "VERIFIED" in done.stdout


def _resigned(repo: Path, keys: dict[str, Path], change, cert: str | None = None) -> Path:
    """The statement changed by ``change`` and signed again (a signer who lies)."""
    statement = _statement(repo)
    change(statement)
    signer = load_signer(keys["key"], keys[cert] if cert else None)
    bundle = sign_bundle(statement_bytes(statement), signer)
    path = repo / "resigned.bundle.json"
    path.write_text(json.dumps(bundle))
    return path


def _flip_weight_byte(repo: Path, keys: dict[str, Path]) -> tuple[Path, list]:
    weights = repo / "models" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    return repo / BUNDLE, ["--key", keys["pub"]]


def _changed_predicate(repo: Path, keys: dict[str, Path]) -> tuple[Path, list]:
    bundle = json.loads((repo / BUNDLE).read_text())
    statement = json.loads(base64.b64decode(bundle["dsseEnvelope"]["payload"]))
    statement["predicate"]["buildDefinition"]["externalParameters"]["seed"] = 7
    bundle["dsseEnvelope"]["payload"] = base64.b64encode(statement_bytes(statement)).decode()
    (repo / BUNDLE).write_text(json.dumps(bundle))
    return repo / BUNDLE, ["--key", keys["pub"]]


def _another_key(repo: Path, keys: dict[str, Path]) -> tuple[Path, list]:
    return repo / BUNDLE, ["--key", keys["other_pub"]]


def _certified_by(cert: str):
    def tamper(repo: Path, keys: dict[str, Path]) -> tuple[Path, list]:
        return _resigned(repo, keys, lambda s: None, cert), ["--cert-chain", keys["root"]]

    return tamper


def _another_commit(repo: Path, keys: dict[str, Path]) -> tuple[Path, list]:
    (repo / "NOTES.md").write_text("a later commit\n")
    commit_all(repo, "after the attested run")
    return repo / BUNDLE, ["--key", keys["pub"]]


def _truncated(repo: Path, keys: dict[str, Path]) -> tuple[Path, list]:
    text = (repo / BUNDLE).read_text()
    (repo / BUNDLE).write_text(text[: len(text) // 2])
    return repo / BUNDLE, ["--key", keys["pub"]]


def _unknown_parameter(repo: Path, keys: dict[str, Path]) -> tuple[Path, list]:
    def change(statement: dict) -> None:
        statement["predicate"]["buildDefinition"]["externalParameters"]["lr"] = 0.1

    return _resigned(repo, keys, change), ["--key", keys["pub"]]


def _unknown_build(repo: Path, keys: dict[str, Path]) -> tuple[Path, list]:
    def change(statement: dict) -> None:
        statement["predicate"]["buildDefinition"]["buildType"] = "https://example.com/make"

    return _resigned(repo, keys, change), ["--key", keys["pub"]]


#: Each tampering -> what its one REJECTED line names.
TAMPERED = {
    "a changed weight byte": (_flip_weight_byte, "models/model.safetensors: sha256"),
    "a changed predicate field": (_changed_predicate, "signature does not verify"),
    "a signature by another key": (_another_key, "signature does not verify"),
    "an expired certificate": (_certified_by("expired"), "expired or not yet valid"),
    "an untrusted certificate": (_certified_by("foreign"), "not trusted"),
    "a statement for another commit": (_another_commit, "another commit's run"),
    "a truncated bundle": (_truncated, "not a bundle: not JSON"),
    "an unknown parameter": (_unknown_parameter, "externalParameters: unknown ['lr']"),
    "an unknown build type": (_unknown_build, "is not one reprotrain knows"),
}


@pytest.mark.parametrize("name", TAMPERED)
def test_a_tampered_attestation_is_rejected_in_one_line(
    repo: Path, keys: dict[str, Path], name: str
) -> None:
    tamper, expect = TAMPERED[name]
    bundle, trust = tamper(repo, keys)
    done = _verify(repo, bundle, *trust)
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.splitlines() == [done.stdout.strip()] and not done.stderr, done.stderr
    assert done.stdout.startswith(f"{VERDICT}REJECTED: ") and expect in done.stdout, done.stdout


def test_a_key_file_that_holds_no_key_is_bad_input(repo: Path) -> None:
    (repo / "nokey.pem").write_text("not a key\n")
    done = _verify(repo, BUNDLE, "--key", "nokey.pem")
    assert done.returncode == 2 and "nokey.pem: not a PEM public key" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_every_build_type_lists_its_parameters_and_a_statement_without_one_is_refused() -> None:
    assert all(BUILD_TYPES.values())
    with pytest.raises(StatementRefused, match="not a complete in-toto"):
        check_statement({"_type": "https://in-toto.io/Statement/v1", "subject": []})


def test_attest_without_a_key_writes_the_unsigned_statement_and_says_so(repo: Path) -> None:
    """Over an earlier signed attestation: its bundle and signature go, not left beside."""
    done = run_cli("attest", cwd=repo)
    assert done.returncode == 0, done.stderr
    assert "UNSIGNED: no key" in done.stdout
    assert sorted(p.name for p in (repo / "attestation").iterdir()) == ["statement.json"]


def test_attest_refuses_a_run_that_is_not_committed(repo: Path, keys: dict[str, Path]) -> None:
    edit_once(repo / "params.yaml", "seed: 42", "seed: 43")
    done = run_cli("attest", "--key", keys["key"], "--out", "again", cwd=repo)
    assert done.returncode == 2 and "params.yaml: changed since the last commit" in done.stderr
    assert not (repo / "again").exists()


def test_a_command_verify_proved_identical_is_attested_from_its_workdir(
    repo: Path, keys: dict[str, Path], tmp_path: Path
) -> None:
    (repo / "write.py").write_text(
        "import pathlib, sys\npathlib.Path(sys.argv[1], 'weights.bin').write_bytes(b'w' * 64)\n"
    )
    commit_all(repo, "a training script")
    work = tmp_path / "verified"
    command = ("python", "write.py", "{out}")
    done = run_cli("verify", "--workdir", work, "--", *command, cwd=repo)
    assert done.returncode == 0 and (work / "verified.json").is_file(), done.stderr
    done = run_cli("attest", "--verified", work, "--key", keys["key"], cwd=repo)
    assert done.returncode == 0, done.stderr
    bundle = work / "attestation" / "attestation.bundle.json"
    done = _verify(repo, bundle, "--key", keys["pub"], "--root", work, "--commit", "HEAD")
    assert done.returncode == 0 and "VERIFIED" in done.stdout, done.stdout + done.stderr
    statement = json.loads((work / "attestation" / "statement.json").read_text())
    definition = statement["predicate"]["buildDefinition"]
    assert definition["buildType"] == COMMAND_BUILD
    assert definition["externalParameters"]["command"] == list(command)
    assert {s["name"] for s in statement["subject"]} == {"run-0/weights.bin", "run-0/"}
    # Control: another byte in the run's file.
    (work / "run-0" / "weights.bin").write_bytes(b"x" * 64)
    done = _verify(repo, bundle, "--key", keys["pub"], "--root", work, "--commit", "HEAD")
    assert done.returncode == 1 and "run-0/weights.bin: sha256" in done.stdout, done.stdout


def test_verify_reference_runs_the_code_of_the_commit_it_clones(repo: Path) -> None:
    """DVC hashes the clone's src/, so its stages must run it, not the installed package."""
    stage = repo / "src" / "reprotrain" / "pipeline" / "stages" / "env.py"
    edit_once(
        stage,
        "    if args.diff:\n",
        '    raise DataError("planted: the clone\'s own code ran")\n    if args.diff:\n',
    )
    commit_all(repo, "a planted env stage")
    done = run_cli("verify", "--reference", "HEAD", cwd=repo)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "planted: the clone's own code ran" in done.stderr, done.stderr


#: A user's model: the digits classifier with its logits scaled.
SCALED = """\
from reprotrain.recipes.digits import Classifier

SCALE = 1.0


class Scaled(Classifier):
    def forward(self, x):
        return super().forward(x) * SCALE
"""


def _rebuild(repo: Path, keys: dict[str, Path], work: Path, bundle: Path = BUNDLE):
    return _verify(
        repo, bundle, "--key", keys["pub"], "--rebuild", "--repo", repo, "--workdir", work
    )


@pytest.fixture(scope="module")
def rebuilds(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The rebuilds' work folder: one environment per lock, made by the first rebuild."""
    return tmp_path_factory.mktemp("rebuilds")


@pytest.mark.slow
def test_a_rebuild_of_the_attested_commit_gives_its_bits(
    repo: Path, keys: dict[str, Path], rebuilds: Path
) -> None:
    """The clone installs the commit's own lock and package, trains, and every subject is
    the attested bytes; a statement made on another kind of host is not judged here."""
    done = _rebuild(repo, keys, rebuilds)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{VERDICT}REBUILT: run " in done.stdout and "subjects the attested bytes" in done.stdout

    def elsewhere(statement: dict) -> None:
        environment = statement["predicate"]["buildDefinition"]["internalParameters"]
        environment["environment"]["cpu"]["vendor"] = "ElsewhereCPU"

    done = _rebuild(repo, keys, rebuilds, _resigned(repo, keys, elsewhere))
    assert done.returncode == 7, done.stdout + done.stderr
    assert f"{VERDICT}UNVERIFIABLE HERE" in done.stdout and "cpu.vendor" in done.stdout


@pytest.mark.slow
def test_outputs_the_commits_code_does_not_make_are_not_rebuilt(
    repo: Path, keys: dict[str, Path], rebuilds: Path
) -> None:
    """Trained with a changed line of the model's code that was then put back, committed
    and attested in good faith: the rebuild of the commit makes other bytes."""
    (repo / "scaled").mkdir()
    (repo / "scaled" / "__init__.py").write_text("")
    model = repo / "scaled" / "model.py"
    model.write_text(SCALED.replace("SCALE = 1.0", "SCALE = 1.001"))
    edit_once(repo / "params.yaml", "reprotrain.recipes.digits.Classifier", "scaled.model.Scaled")
    pipeline = repo / "dvc.yaml"  # the stages that build the model depend on its package
    pipeline.write_text(
        pipeline.read_text().replace(
            "      - src/reprotrain\n", "      - src/reprotrain\n      - scaled\n"
        )
    )
    run_checked("dvc", "repro", "dvc.yaml", cwd=repo)
    model.write_text(SCALED)
    commit_all(repo, "outputs of a line that is not committed")
    assert run_cli("attest", "--key", keys["key"], cwd=repo).returncode == 0
    done = _rebuild(repo, keys, rebuilds)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"{VERDICT}NOT REBUILT" in done.stdout and "models/model.safetensors" in done.stdout
    assert "diverge at step" in done.stdout, done.stdout


#: A training script whose bytes depend on a variable no statement holds.
PLANTED = (
    "import os, pathlib, sys\n"
    "pathlib.Path(sys.argv[1], 'weights.bin').write_bytes(os.environ.get('PLANT', 'w').encode())\n"
)


@pytest.mark.slow
def test_a_verified_command_rebuilds_to_its_bytes_and_an_input_outside_its_statement_not(
    repo: Path, keys: dict[str, Path], rebuilds: Path, tmp_path: Path
) -> None:
    (repo / "write.py").write_text(PLANTED)
    commit_all(repo, "a training script")

    def attested(name: str, **env: str) -> Path:
        work = tmp_path / name
        argv = ("verify", "--workdir", work, "--", "python", "write.py", "{out}")
        done = run_cli(*argv, cwd=repo, **env)
        assert done.returncode == 0, done.stdout + done.stderr
        done = run_cli("attest", "--verified", work, "--key", keys["key"], cwd=repo)
        assert done.returncode == 0, done.stderr
        return work / "attestation" / "attestation.bundle.json"

    done = _rebuild(repo, keys, rebuilds, attested("plain"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{VERDICT}REBUILT" in done.stdout
    # Its statement names no lock: the clone's lock's bytes name the environment, so the
    # pipeline's rebuilds of the same lock made it (when they ran first) and none is made anew.
    lock = sha256_file(repo / "requirements-cpu.lock")[:12]
    assert [p.name for p in rebuilds.glob("venv-*")] == [f"venv-{lock}"]
    # Control: its runs were identical, but under a variable the statement does not hold.
    done = _rebuild(repo, keys, rebuilds, attested("planted", PLANT="x"))
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"{VERDICT}NOT REBUILT" in done.stdout and "run-0/weights.bin" in done.stdout
