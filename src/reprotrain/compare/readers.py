"""A run's output file read by its kind: which kind, then its tensors and other fields.

:func:`file_kind` says how a file is read (by its safetensors header, its suffix,
or a ``torch.save`` zip); :data:`READERS` read each kind into tensors and fields
by key path (``state_dict/...``): safetensors with its metadata; a checkpoint
with ``torch.load(weights_only=True)``, or with its own classes as placeholders
that run nothing (:mod:`reprotrain.compare.opaque`), a pickled ``pathlib`` path
read as that path; NumPy files without pickle (:mod:`reprotrain.compare.arrays`).
:mod:`reprotrain.compare.files` compares what two of them read. torch and
safetensors load only inside a reader.
"""

from __future__ import annotations

import json
import pickle
import re
import zipfile
from collections.abc import Callable
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any, Literal

from reprotrain.compare.arrays import is_array_file, pickled_array, read_array_file
from reprotrain.hashing import METADATA_KEY

Kind = Literal["safetensors", "checkpoint", "arrays", "file"]
CHECKPOINT_SUFFIXES = (".ckpt", ".pt", ".pth")
#: What a reader raises for a file that is not what it should be (safetensors' own error
#: is neither OSError nor ValueError; torch.load raises RuntimeError for a bad zip).
_TORCH_READ_ERRORS = (OSError, ValueError, RuntimeError, EOFError, pickle.UnpicklingError)


def file_kind(path: Path) -> Kind:
    """How a file is read: by its safetensors header, its suffix, or a torch.save zip."""
    if _has_safetensors_header(path):
        return "safetensors"
    if path.suffix in CHECKPOINT_SUFFIXES:
        return "checkpoint"
    if is_array_file(path):
        return "arrays"
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as archive:
            if any(n.endswith("/data.pkl") for n in archive.namelist()):
                return "checkpoint"
    return "file"


def _has_safetensors_header(path: Path) -> bool:
    with path.open("rb") as handle:
        size = int.from_bytes(handle.read(8), "little")
        return 1 < size <= min(100_000_000, path.stat().st_size - 8) and handle.read(1) == b"{"


def unreadable_reason(err: BaseException, kind: Kind) -> str:
    """The reader's error in one line; torch's refusal by the class it would not load."""
    text = str(err)
    if kind == "checkpoint" and (refused := _REFUSED.search(text)):
        return (
            f"holds {refused.group(1)}, which torch.load(weights_only=True) refuses (it runs no "
            "code from a file): save plain types (a Hydra config: OmegaConf.to_container), or "
            "compare FinalStateCallback's safetensors instead"
        )
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return (lines or [type(err).__name__])[0][:200]


_REFUSED = re.compile(r"Unsupported global: GLOBAL ([\w.]+)")


def read_errors(kind: Kind) -> tuple[type[BaseException], ...]:
    """What the reader of ``kind`` raises for a file that is not what it should be."""
    if kind == "safetensors":
        from safetensors import SafetensorError

        return (OSError, ValueError, SafetensorError)
    if kind == "arrays":  # np.load: a bad header or an object array, a broken archive
        return (OSError, ValueError, EOFError, zipfile.BadZipFile)
    return _TORCH_READ_ERRORS


def read_safetensors(path: Path) -> tuple[dict[str, Any], dict[str, Any], bool]:
    from safetensors import safe_open

    from reprotrain.trace.tracefile import FORMAT

    with safe_open(str(path), framework="pt") as handle:
        metadata = dict(handle.metadata() or {})
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
    fields = {f"metadata/{key}": value for key, value in metadata.items()}
    try:
        ours = json.loads(metadata.get(METADATA_KEY, "{}"))
    except json.JSONDecodeError:
        ours = {}
    return tensors, fields, isinstance(ours, dict) and ours.get("format") == FORMAT


def read_arrays(path: Path) -> tuple[dict[str, Any], dict[str, Any], bool]:
    """A NumPy file's arrays: tensors, and as fields those torch has no dtype for."""
    import torch

    tensors: dict[str, Any] = {}
    fields: dict[str, Any] = {}
    for name, value in read_array_file(path).items():
        (tensors if isinstance(value, torch.Tensor) else fields)[name] = value
    return tensors, fields, False


def read_checkpoint(path: Path) -> tuple[dict[str, Any], dict[str, Any], bool]:
    """Tensors and fields by key path; a file that pickles objects of its own classes is
    read with those classes as placeholders (:mod:`reprotrain.compare.opaque`), named in
    the field :data:`NOT_LOADED`."""
    import torch

    from reprotrain.compare.opaque import Opaque, load_opaque

    unloaded: list[str] = []
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as refused:  # weights_only's refusal of a global
        try:
            loaded, unloaded = load_opaque(path)
        except Exception as err:  # not even placeholders take it: the refusal says why
            raise refused from err
    except _TORCH_READ_ERRORS:
        raise
    except Exception as err:  # bytes that are no pickle fail the unpickler in any way
        raise ValueError(f"not a torch file ({type(err).__name__}: {err})") from err
    tensors: dict[str, Any] = {}
    fields: dict[str, Any] = {}
    _flatten(loaded, "", tensors, fields, torch.Tensor, Opaque, {})
    if unloaded := [name for name in unloaded if name not in _PATH_CLASSES]:  # read as paths
        fields[NOT_LOADED] = ", ".join(unloaded)
    return tensors, fields, False


#: The field that names the classes a checkpoint pickles and no code was loaded for.
NOT_LOADED = "(classes not loaded)"


def _flatten(
    value: Any, key: str, tensors: dict, fields: dict, tensor_type: type, opaque: type,
    seen: dict[int, Any],
) -> None:  # fmt: skip
    """Every tensor and every other leaf of nested dicts, lists and placeholders, by key path;
    an object met again (a parent link) is a field naming where it was first. ``seen`` holds
    the objects met, not only their ids: a placeholder's contents are made anew at each
    call, and a freed one's id would be taken by the next, which was never met."""
    if isinstance(value, tensor_type):
        tensors[key or "(tensor)"] = value
        return
    if (array := pickled_array(value, opaque)) is not None:
        _flatten(array, key, tensors, fields, tensor_type, opaque, seen)
        return
    value = _as_path(value, opaque)
    if isinstance(value, dict | list | tuple | opaque) and value:
        if id(value) in seen:
            fields[key] = "<seen above>"
            return
        seen[id(value)] = value
    if isinstance(value, opaque):
        value = value.contents()
    if isinstance(value, dict) and value:
        for k, v in value.items():
            k = _as_path(k, opaque)  # a Path key (a placeholder otherwise): keyed by its text
            _flatten(v, f"{key}/{k}" if key else str(k), tensors, fields, tensor_type, opaque, seen)
    elif isinstance(value, list | tuple) and value:
        for i, v in enumerate(value):
            _flatten(v, f"{key}/{i}" if key else str(i), tensors, fields, tensor_type, opaque, seen)
    else:
        fields[key or "(value)"] = value


#: pathlib's classes: a pickled path (not in ``weights_only``'s list, so a placeholder whose
#: arguments are the path's parts) is read back as a pure path, which runs no code.
_PATH_CLASSES = {
    **dict.fromkeys(("pathlib.PosixPath", "pathlib.PurePosixPath"), PurePosixPath),
    **dict.fromkeys(("pathlib.WindowsPath", "pathlib.PureWindowsPath"), PureWindowsPath),
}


def _as_path(value: Any, opaque: type) -> Any:
    """A placeholder of a pickled path as that path (its parts in one string, where a run's
    folder is found like in any other); any other value as it is."""
    if not isinstance(value, opaque) or value.path not in _PATH_CLASSES:
        return value
    contents = value.contents()
    parts = list(contents.get("args", {}).values())
    if not all(isinstance(part, str) for part in parts) or "state" in contents:
        return value
    return _PATH_CLASSES[value.path](*parts)


#: Each kind but ``file`` -> its reader: (tensors, fields, whether the tensors are a trace's).
READERS: dict[str, Callable[[Path], tuple[dict[str, Any], dict[str, Any], bool]]] = {
    "safetensors": read_safetensors,
    "checkpoint": read_checkpoint,
    "arrays": read_arrays,
}
