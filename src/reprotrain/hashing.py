"""Content hashes that identify bits, not objects.

``sha256_state_dict`` hashes every tensor's name, dtype, shape and raw
bytes in name order, so two models have the same fingerprint exactly when
``torch.equal`` holds for every tensor (and -0.0 vs 0.0 or NaN payloads count
as different, as they should when the claim is "same bits"). ``sha256_file``
streams a file. ``canonical_json`` is the one JSON spelling used wherever
bytes are compared: sorted keys, fixed separators, a trailing newline.

safetensors files are byte-identical for identical tensors (tensors are
ordered by dtype and name, whatever the file name or process), but the
``__metadata__`` map is written in hash-map order, which varies between
processes once it has two or more keys. ``safetensors_metadata`` therefore
packs all metadata into one key holding canonical JSON, and
``load_safetensors`` unpacks it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

_CHUNK = 1 << 20
METADATA_KEY = "reprotrain"


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def sha256_state_dict(state_dict: Mapping[str, torch.Tensor]) -> str:
    """Hex sha256 over (name, dtype, shape, bytes) of every tensor, in name order."""
    digest = hashlib.sha256()
    for name in sorted(state_dict):
        tensor = state_dict[name].detach().cpu().contiguous()
        header = f"{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\0"
        digest.update(header.encode())
        # Reinterpret as bytes so every dtype (bf16 included) hashes its raw bits.
        digest.update(tensor.reshape(-1).view(dtype=_uint8()).numpy().tobytes())
    return digest.hexdigest()


def canonical_json(value: Any) -> str:
    """Deterministic JSON text: sorted keys, two-space indent, trailing newline."""
    return json.dumps(value, sort_keys=True, indent=2, ensure_ascii=False, allow_nan=False) + "\n"


def safetensors_metadata(values: Mapping[str, Any]) -> dict[str, str]:
    """Metadata for ``safetensors.save_file`` whose bytes do not depend on map order."""
    return {METADATA_KEY: canonical_json(dict(values))}


class UnreadableSafetensors(ValueError):
    """A file that cannot be read as a safetensors file of ours: truncated, a header that
    is not a safetensors one, or metadata that is not ours.

    The message says what is wrong, without the file: callers put ``path`` first in
    their own one-line message, with what to do about it.
    """

    def __init__(self, path: str | Path, reason: str) -> None:
        super().__init__(reason)
        self.path = Path(path)


def load_safetensors(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Tensors and unpacked metadata of a safetensors file; no pickle involved.

    Raises ``OSError`` for a file that cannot be opened and
    :class:`UnreadableSafetensors` (a ``ValueError``) for one that is not a
    readable safetensors file or whose metadata is not ours.
    """
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            raw = handle.metadata() or {}
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
    except SafetensorError as err:  # the Rust reader's errors name no file
        raise UnreadableSafetensors(path, str(err).splitlines()[0]) from None
    return tensors, _unpack_metadata(raw, path)


def read_safetensors_metadata(path: str | Path) -> dict[str, Any]:
    """The unpacked metadata of a safetensors file, from its JSON header alone (no torch).

    Raises ``OSError`` for an unreadable file and :class:`UnreadableSafetensors` (a
    ``ValueError``) for a header that is not a safetensors one or metadata that is not ours.
    """
    with Path(path).open("rb") as handle:
        size = int.from_bytes(handle.read(8), "little")
        if not 0 < size <= 100_000_000:
            raise UnreadableSafetensors(path, f"not a safetensors file (header size {size})")
        text = handle.read(size)
    if len(text) < size:
        raise UnreadableSafetensors(path, "truncated: the file ends inside its header")
    try:
        header = json.loads(text)
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
        raise UnreadableSafetensors(path, f"its header is not JSON ({err})") from None
    if not isinstance(header, dict):
        raise UnreadableSafetensors(path, "its header is not a JSON object")
    raw = header.get("__metadata__") or {}
    if not isinstance(raw, dict) or not all(isinstance(v, str) for v in raw.values()):
        raise UnreadableSafetensors(path, "its __metadata__ is not a map of strings")
    return _unpack_metadata(raw, path)


def _unpack_metadata(raw: dict[str, str], path: str | Path) -> dict[str, Any]:
    """Our JSON object under ``METADATA_KEY`` of a safetensors header's string metadata."""
    try:
        metadata = json.loads(raw[METADATA_KEY]) if METADATA_KEY in raw else {}
    except ValueError as err:
        raise UnreadableSafetensors(path, f"metadata key {METADATA_KEY!r}: {err}") from None
    if not isinstance(metadata, dict):
        raise UnreadableSafetensors(path, f"metadata key {METADATA_KEY!r} is not a JSON object")
    return metadata


def _uint8() -> Any:
    import torch

    return torch.uint8
