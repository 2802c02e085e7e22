"""NumPy arrays as tensors, read without running any code: ``.npy`` and ``.npz`` files, and
arrays or scalars a checkpoint pickles.

A script that saves its weights with ``np.save`` or ``np.savez``, or a checkpoint
that holds a NumPy value (a callback's state, a scaler's mean), holds tensors
like any other: a differing value must be a differing tensor, with its
magnitude, not a byte offset. ``np.load(allow_pickle=False)`` reads the files
(an object array, which only pickle could read, is refused). Inside a
checkpoint :mod:`reprotrain.compare.opaque` leaves a pickled array as a
placeholder of NumPy's reconstruct call; :func:`pickled_array` decodes it
from its dtype code, byte order, shape and raw bytes, with NumPy's plain
buffer reader, so nothing the file names is imported or called.

An array of a dtype torch has no tensor for (strings, structured records, long
doubles) is compared as a field: its dtype, shape and the sha256 of its bytes
(a ``repr`` would elide the middle of a long array). A file whose header
promises more bytes than it holds is refused before anything is allocated.
"""

from __future__ import annotations

import hashlib
import math
import re
import zipfile
from pathlib import Path
from typing import Any

#: The first bytes of a ``.npy`` file (and of each member of an ``.npz`` archive).
NPY_MAGIC = b"\x93NUMPY"
#: NumPy's reconstruct and scalar functions, by the module paths NumPy 1 and 2 pickle.
_RECONSTRUCT = {f"numpy.{m}.multiarray._reconstruct" for m in ("core", "_core")}
_SCALAR = {f"numpy.{m}.multiarray.scalar" for m in ("core", "_core")}
#: A plain dtype code: a bool, number or complex of some size (no object, string, record).
_PLAIN_CODE = re.compile(r"[?bBhHiIlLqQefdgFDG]|[biufc]\d{1,2}")


def is_array_file(path: Path) -> bool:
    """A ``.npy`` file (its magic bytes) or an ``.npz`` archive of them."""
    with path.open("rb") as handle:
        if handle.read(len(NPY_MAGIC)) == NPY_MAGIC:
            return True
    if path.suffix != ".npz" or not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as archive:
        names = archive.namelist()
    return bool(names) and all(name.endswith(".npy") for name in names)


def read_array_file(path: Path) -> dict[str, Any]:
    """Each array of the file by name (``.npy``: one, named ``(array)``), as a tensor where
    torch has its dtype. Raises ValueError for an object array or a file NumPy cannot read."""
    import numpy as np

    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as archive:
            for member in archive.infolist():
                with archive.open(member) as handle:
                    _check_header(handle, member.file_size, member.filename)
    else:
        with path.open("rb") as handle:
            _check_header(handle, path.stat().st_size, path.name)
    loaded = np.load(path, allow_pickle=False)
    if isinstance(loaded, np.ndarray):
        return {"(array)": as_tensor(loaded)}
    with loaded:
        return {name: as_tensor(array) for name, array in loaded.items()}


def _check_header(handle: Any, size: int, name: str) -> None:
    """Raise ValueError where an array's header promises more bytes than ``size`` holds (a
    crafted shape would have NumPy allocate it first) or an object array."""
    from numpy.lib import format as npy

    version = npy.read_magic(handle)
    read = npy.read_array_header_1_0 if version == (1, 0) else npy.read_array_header_2_0
    shape, _, dtype = read(handle, max_header_size=10_000)
    if dtype.hasobject:
        raise ValueError(f"{name}: an object array, which only pickle reads")
    if math.prod(shape) * dtype.itemsize > size:
        raise ValueError(f"{name}: its header promises shape {shape}, more than its {size} bytes")


def pickled_array(value: Any, opaque: type) -> Any:
    """The array or scalar a NumPy placeholder of a checkpoint stands for (a tensor where
    torch has its dtype); None for any other value, or one whose parts are not plain."""
    if not isinstance(value, opaque) or value.path not in _RECONSTRUCT | _SCALAR:
        return None
    import numpy as np

    contents = value.contents()
    if value.path in _SCALAR:
        parts = list(contents.get("args", {}).values())
        if len(parts) != 2:
            return None
        dtype, data = _dtype(parts[0], opaque), _raw(parts[1], opaque)
        shape, fortran = (), False
    else:
        state = contents.get("state")
        if not isinstance(state, tuple) or len(state) != 5:
            return None
        _, shape, dtype, fortran, data = state
        dtype, data = _dtype(dtype, opaque), _raw(data, opaque)
        if not (isinstance(shape, tuple) and all(type(n) is int for n in shape)):
            return None
    if dtype is None or data is None or len(data) != dtype.itemsize * math.prod(shape):
        return None
    return as_tensor(np.frombuffer(data, dtype=dtype).reshape(shape, order="F" if fortran else "C"))


def as_tensor(array: Any) -> Any:
    """``array`` as a tensor (a copy, in native byte order) where torch has its dtype, else
    its dtype, shape and the sha256 of its bytes, as a string to compare."""
    import torch

    native = array.astype(array.dtype.newbyteorder("="), order="C")  # astype copies
    try:
        return torch.from_numpy(native)
    except TypeError:  # a dtype torch does not hold
        digest = hashlib.sha256(native.tobytes()).hexdigest()[:16]
        return f"array {native.dtype} {native.shape} sha256 {digest}"


def _dtype(value: Any, opaque: type) -> Any:
    """The dtype a placeholder of ``numpy.dtype(code, ...)`` with its byte order stands for."""
    if not isinstance(value, opaque) or value.path != "numpy.dtype":
        return None
    import numpy as np

    contents = value.contents()
    code = contents.get("args", {}).get("0")
    state = contents.get("state")
    if not isinstance(code, str) or not _PLAIN_CODE.fullmatch(code):
        return None
    order = state[1] if isinstance(state, tuple) and len(state) > 1 else "="
    return np.dtype(code).newbyteorder(order if order in ("<", ">", "=", "|") else "=")


def _raw(value: Any, opaque: type) -> bytes | None:
    """The bytes pickle gave: bytes, or ``_codecs.encode(text, "latin1")`` (protocol 2)."""
    if isinstance(value, bytes | bytearray):
        return bytes(value)
    if isinstance(value, opaque) and value.path == "_codecs.encode":
        args = list(value.contents().get("args", {}).values())
        if len(args) == 2 and isinstance(args[0], str) and args[1] == "latin1":
            return args[0].encode("latin1")
    return None
