"""Write files so they appear whole or not at all.

Each writer puts the bytes in a temporary file in the destination's own
folder, flushes and fsyncs it, then ``os.replace``s it over the final name
(atomic on POSIX within one file system). A crash at any moment leaves either
the previous file or the new one under the final name, never a truncated one;
a stray ``.<name>.tmp-*`` file may remain and is never read.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_path(final: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``final``; on success, move it into place.

    For writers that insist on a path (``safetensors.save_file``). On an
    exception the temporary file is removed and ``final`` is untouched.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{final.name}.tmp-", dir=final.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        with tmp.open("rb") as handle:
            os.fsync(handle.fileno())
        tmp.chmod(0o644)
        tmp.replace(final)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_bytes(final: str | Path, data: bytes) -> None:
    """Write ``data`` to ``final`` atomically."""
    with atomic_path(final) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(final: str | Path, text: str) -> None:
    """Write UTF-8 ``text`` to ``final`` atomically."""
    atomic_write_bytes(final, text.encode("utf-8"))
