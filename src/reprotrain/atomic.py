"""Write files so they appear whole or not at all.

Each writer puts the bytes in a temporary file in the destination's own
folder, flushes and fsyncs it, then ``os.replace``s it over the final name
(atomic on POSIX within one file system). A crash at any moment leaves either
the previous file or the new one under the final name, never a truncated one;
a stray ``.<name>.tmp-*`` file may remain and is never read. A failed write
(a full disk, a read-only folder) removes its temporary file and raises an
``OSError`` that names the final file, not the temporary one.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def atomic_path(final: str | Path, sync: bool = True) -> Iterator[Path]:
    """Yield a temporary path beside ``final``; on success, move it into place.

    For writers that insist on a path (``safetensors.save_file``). On an
    exception the temporary file is removed and ``final`` is untouched.
    ``sync=False`` skips the fsync: a crash of the process still leaves the
    old file or the new one, but a power loss may leave an empty file. Only
    for files that are made again by rerunning (a diagnostic recording).
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{final.name}.tmp-", dir=final.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        if sync:
            with tmp.open("rb") as handle:
                os.fsync(handle.fileno())
        tmp.chmod(0o644)
        tmp.replace(final)
    except OSError as err:
        if err.filename not in (None, str(tmp)):  # a write() error names no file
            raise
        raise OSError(err.errno, err.strerror, str(final)) from err
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_bytes(final: str | Path, data: bytes, sync: bool = True) -> None:
    """Write ``data`` to ``final`` atomically (``sync``: see :func:`atomic_path`)."""
    with atomic_path(final, sync) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(final: str | Path, text: str) -> None:
    """Write UTF-8 ``text`` to ``final`` atomically."""
    atomic_write_bytes(final, text.encode("utf-8"))


def atomic_write_safetensors(
    final: str | Path, tensors: Mapping[str, Any], metadata: dict[str, str] | None = None
) -> None:
    """Write torch ``tensors`` to ``final`` as safetensors, atomically.

    Serialised in memory first, so a storage error is a plain ``OSError`` with
    its errno (``safetensors.save_file`` wraps it in its own exception). Each
    name is written as its own tensor: tensors that share memory (tied weights,
    one ``Parameter`` under two names in a ``state_dict``), which safetensors
    refuses, are written from copies, the same bytes.
    """
    from safetensors.torch import save

    atomic_write_bytes(final, save(_own_memory(tensors), metadata=metadata))


def _own_memory(tensors: Mapping[str, Any]) -> dict[str, Any]:
    """``tensors``, contiguous, each in memory of its own: one that shares its storage with an
    earlier one is copied (the others are the same objects, nothing copied)."""
    seen: set[tuple[Any, int]] = set()
    owned = {}
    for name, tensor in tensors.items():
        tensor = tensor.contiguous()
        storage = (tensor.device, tensor.untyped_storage().data_ptr())
        if storage[1] and storage in seen:
            tensor = tensor.clone()
        seen.add(storage)
        owned[name] = tensor
    return owned
