"""DSSE envelopes signed offline with a key or a certificate, and checked the same way.

A *bundle* is one JSON file: the DSSE envelope (``payload``, ``payloadType``,
``signatures``, as the DSSE spec and securesystemslib write it) and what a
verifier needs beside the trusted key: nothing for a bare key (its key ID is in
the signature), or the signing certificate and its intermediates (PEM) for a
certificate signer. Signing and checking use securesystemslib's
:class:`~securesystemslib.dsse.Envelope` and pyca/cryptography; nothing goes
to a network, so there is no transparency log and no trusted time: a
certificate's validity is checked against this machine's clock.

Keys are ECDSA P-256 or P-384 in PEM (``openssl ecparam -name prime256v1
-genkey``); a certificate chain is checked link by link up to a root the
verifier names (``--cert-chain``): each certificate issued and signed by the
next, each valid now, the leaf allowed to sign (key usage). Every refusal is
a :class:`SignatureRefused` with one line saying what failed.
"""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The bundle's own media type (docs/attestation.md describes its fields).
BUNDLE_MEDIA_TYPE = "application/vnd.reprotrain.attestation.bundle.v1+json"
#: What a DSSE payload of an in-toto statement is.
IN_TOTO_PAYLOAD_TYPE = "application/vnd.in-toto+json"
#: The curves a signing key may use.
CURVES = ("secp256r1", "secp384r1")


class SignatureRefused(ValueError):
    """A bundle, key or certificate that does not verify; the message is one line."""


@dataclass(frozen=True)
class Signer:
    """A private key and, for a certificate signer, its certificate chain (leaf first)."""

    private_key: Any
    certificates: tuple[Any, ...] = ()


def load_signer(key: Path, certificate: Path | None = None, chain: Path | None = None) -> Signer:
    """The signer of a PEM private key, with its certificate and intermediates if given."""
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    try:
        private_key = load_pem_private_key(_read(key), password=None)
    except (ValueError, TypeError) as err:
        raise SignatureRefused(f"{key}: not an unencrypted PEM private key ({err})") from None
    if not isinstance(private_key, ec.EllipticCurvePrivateKey) or (
        private_key.curve.name not in CURVES
    ):
        raise SignatureRefused(f"{key}: not an ECDSA P-256 or P-384 key")
    certificates: tuple[Any, ...] = ()
    if certificate is not None:
        certificates = (*load_certificates(certificate), *load_certificates(chain or ()))
        if certificates[0].public_key().public_numbers() != (
            private_key.public_key().public_numbers()
        ):
            raise SignatureRefused(f"{certificate}: its public key is not {key}'s")
    return Signer(private_key, certificates)


def load_certificates(path: Path | tuple[()]) -> list[Any]:
    """Every certificate in a PEM file (none for ``()``)."""
    from cryptography import x509

    if path == ():
        return []
    try:
        return x509.load_pem_x509_certificates(_read(path))  # type: ignore[arg-type]
    except ValueError as err:
        raise SignatureRefused(f"{path}: no PEM certificate in it ({err})") from None


def load_public_key(path: Path) -> Any:
    from cryptography.hazmat.primitives.serialization import load_pem_public_key

    try:
        return load_pem_public_key(_read(path))
    except (ValueError, TypeError) as err:
        raise SignatureRefused(f"{path}: not a PEM public key ({err})") from None


def sign_bundle(payload: bytes, signer: Signer) -> dict[str, Any]:
    """The bundle of ``payload`` (an in-toto statement's bytes) signed by ``signer``."""
    from cryptography.hazmat.primitives.serialization import Encoding
    from securesystemslib.dsse import Envelope
    from securesystemslib.signer import CryptoSigner

    envelope = Envelope(payload, IN_TOTO_PAYLOAD_TYPE, {})
    envelope.sign(CryptoSigner(signer.private_key))
    material: dict[str, Any] = {}
    if signer.certificates:
        material["certificates"] = [
            c.public_bytes(Encoding.PEM).decode() for c in signer.certificates
        ]
    return {
        "mediaType": BUNDLE_MEDIA_TYPE,
        "dsseEnvelope": envelope.to_dict(),
        "verificationMaterial": material,
    }


def read_bundle(path: Path) -> dict[str, Any]:
    """A bundle file's JSON; refused in one line when it is not one."""
    try:
        bundle = json.loads(_read(path))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise SignatureRefused(f"{path}: not a bundle: not JSON ({err})") from None
    if not isinstance(bundle, dict) or bundle.get("mediaType") != BUNDLE_MEDIA_TYPE:
        raise SignatureRefused(f"{path}: not a bundle: its mediaType is not {BUNDLE_MEDIA_TYPE}")
    return bundle


def verify_bundle(
    bundle: dict[str, Any],
    public_key: Any = None,
    roots: list[Any] | None = None,
    now: datetime.datetime | None = None,
) -> bytes:
    """The signed payload, once its signature verifies with ``public_key``, or with the
    bundle's certificate chained up to one of ``roots``; else :class:`SignatureRefused`."""
    from securesystemslib.dsse import Envelope
    from securesystemslib.exceptions import VerificationError
    from securesystemslib.signer import SSlibKey

    try:
        envelope = Envelope.from_dict(bundle["dsseEnvelope"])
    except (KeyError, TypeError, ValueError) as err:
        raise SignatureRefused(f"not a bundle: its DSSE envelope is incomplete ({err})") from None
    if envelope.payload_type != IN_TOTO_PAYLOAD_TYPE:
        raise SignatureRefused(f"the envelope holds {envelope.payload_type}, not an in-toto one")
    if public_key is None:
        if roots is None:
            raise SignatureRefused("nothing to verify the signature with: give a key or a chain")
        public_key = _chained_leaf(bundle, roots, now or datetime.datetime.now(datetime.UTC))
    key = SSlibKey.from_crypto(public_key)
    try:
        envelope.verify([key], 1)
    except VerificationError:
        raise SignatureRefused(
            "the signature does not verify with the given key: the statement was changed "
            "after signing, or another key signed it"
        ) from None
    return envelope.payload


def _chained_leaf(bundle: dict[str, Any], roots: list[Any], now: datetime.datetime) -> Any:
    """The bundle's signing certificate's key, once its chain reaches one of ``roots``."""
    from cryptography import x509

    pems = bundle.get("verificationMaterial", {}).get("certificates") or []
    if not pems:
        raise SignatureRefused("the bundle carries no certificate: it was signed with a bare key")
    try:
        chain = [x509.load_pem_x509_certificate(pem.encode()) for pem in pems]
    except (ValueError, AttributeError) as err:
        raise SignatureRefused(f"the bundle's certificates are not PEM ({err})") from None
    leaf = chain[0]
    try:
        usage = leaf.extensions.get_extension_for_class(x509.KeyUsage).value
    except x509.ExtensionNotFound:
        usage = None
    if usage is not None and not usage.digital_signature:
        raise SignatureRefused(f"certificate {_name(leaf)} may not sign (no digitalSignature)")
    trusted = [root for root in roots if _valid_now(root, now)]
    for at, cert in enumerate(chain):
        _valid_now(cert, now)
        if any(cert == root for root in trusted):
            return leaf.public_key()  # a certificate the verifier trusts itself
        issuers = chain[at + 1 : at + 2] or trusted
        if not any(_issued_by(cert, issuer) for issuer in issuers):
            by = _name(issuers[0]) if at + 1 < len(chain) else "any root of the given chain"
            raise SignatureRefused(f"certificate {_name(cert)} was not issued by {by}: not trusted")
        if at + 1 == len(chain):
            return leaf.public_key()
    raise SignatureRefused("the bundle's certificate chain is empty")


def _issued_by(cert: Any, issuer: Any) -> bool:
    from cryptography.exceptions import InvalidSignature

    try:
        cert.verify_directly_issued_by(issuer)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def _valid_now(cert: Any, now: datetime.datetime) -> bool:
    """True, or a refusal naming the certificate and when it is valid."""
    if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
        raise SignatureRefused(
            f"certificate {_name(cert)} is valid from {cert.not_valid_before_utc:%Y-%m-%d} to "
            f"{cert.not_valid_after_utc:%Y-%m-%d}, not now ({now:%Y-%m-%d}): expired or not "
            "yet valid"
        )
    return True


def _name(cert: Any) -> str:
    return repr(cert.subject.rfc4514_string())


def _read(path: Path) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as err:
        raise SignatureRefused(f"{path}: {err.strerror or err}") from None
