"""Two files of any kind, one from each run folder, compared to one verdict.

Files with the same bytes are ``identical`` without being read. Otherwise the
file is read as its kind:

* ``safetensors`` (found by its header, whatever the name): tensor by tensor
  (:func:`reprotrain.compare.weights.compare_weights`), then the metadata by key;
  a trace (:class:`~reprotrain.trace.callback.TraceCallback`) holds fingerprints, so
  its rows say "differs" with no magnitude;
* ``checkpoint`` (``.ckpt``, ``.pt``, ``.pth``, or a ``torch.save`` zip):
  ``torch.load(weights_only=True)`` (no code from the file runs), every tensor
  found by its key path (``state_dict/…``, ``optimizer_states/0/state/0/exp_avg``,
  loops' counters) compared as above, every other value by its ``repr``. A
  checkpoint that pickles objects of its own classes (a ``net`` kept by
  ``save_hyperparameters()``, a Hydra config) is read with those classes as
  placeholders that run nothing (:mod:`reprotrain.compare.opaque`): their
  tensors and fields compare like any others, and the verdict names them;
* ``arrays``: a ``.npy`` file or an ``.npz`` archive of them, array by array as tensors
  (:mod:`reprotrain.compare.arrays`: no pickled object is read); a NumPy array or
  scalar inside a checkpoint is a tensor too;
* ``file``: any other file, by bytes; a text file names its first differing line.

Before comparing, each run's own folder path (as given and resolved) is
replaced by ``{out}`` in strings, in key paths (``ModelCheckpoint``'s
``best_k_models`` is keyed by each checkpoint's path) and in bytes, so a config
or a checkpoint that records where it was written compares equal; a pickled
``pathlib`` path is read as that path (its parts in one string), not as a
placeholder; a set is compared by its sorted members (its order follows the
hashes of each run's own paths). Another name in a key is still a difference.
The verdict's ``status`` is ``identical``, ``tensors`` (a tensor differs:
value, dtype, shape, missing), ``fields`` (every tensor equal, a non-tensor
value differs), ``bytes`` (a file with no tensors differs) or ``unreadable``
(one of the two cannot be read as its kind; ``detail`` names the file and the
reader's error). A file that differs only outside its tensors is never
``tensors``. A file only one run wrote (:func:`one_sided`) is ``tensors`` when
it holds tensors, else ``bytes``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from reprotrain.compare.readers import (
    NOT_LOADED,
    READERS,
    Kind,
    file_kind,
    read_errors,
    unreadable_reason,
)

if TYPE_CHECKING:  # torch loads only when two files differ (an identical verify stays fast)
    from reprotrain.compare.weights import TensorDiff

__all__ = ["FileVerdict", "compare_files", "one_sided"]

Status = Literal["identical", "tensors", "fields", "bytes", "unreadable"]
PLACEHOLDER = "{out}"
_CHUNK = 1 << 20


@dataclass(frozen=True)
class FileVerdict:
    """One file of two runs; ``tensors``/``fields`` list only what differs."""

    name: str
    kind: Kind
    status: Status
    tensors_compared: int = 0
    tensors: list[TensorDiff] = field(default_factory=list)
    fields: list[str] = field(default_factory=list)
    detail: str = ""
    #: The tensors are fingerprints (a trace): a difference has no magnitude.
    hashes: bool = False

    @property
    def identical(self) -> bool:
        return self.status == "identical"

    def summary(self) -> str:
        """One line: the file, its kind and its verdict."""
        head = f"{self.name} ({self.kind})"
        if self.status == "identical":
            return f"{head}: identical{f' ({self.detail})' if self.detail else ''}"
        if self.status == "tensors" and not self.tensors:  # written by one run only
            return f"{head}: {self.detail}"
        note = f" ({self.detail})" if self.detail else ""
        if self.status == "tensors":
            return f"{head}: {len(self.tensors)} of {self.tensors_compared} tensors differ{note}"
        if self.status == "fields":
            return (
                f"{head}: all {self.tensors_compared} tensors equal; "
                f"{len(self.fields)} other fields differ{note}"
            )
        if self.status == "bytes":
            return f"{head}: differs ({self.detail})"
        return f"{head}: unreadable: {self.detail}"

    def detail_lines(self) -> list[str]:
        """What differs, a line each: tensors first, then other fields."""
        rows = [_tensor_text(d, self.hashes) for d in self.tensors]
        return rows + self.fields

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "status": self.status,
            "tensors_compared": self.tensors_compared,
            "differing": self.detail_lines(),
            "detail": self.detail,
        }


def _tensor_text(diff: TensorDiff, hashes: bool) -> str:
    if hashes and diff.status == "different":
        return f"{diff.name}: differs"
    return diff.to_text()


def compare_files(name: str, a: Path, b: Path, folders: tuple[Path, Path]) -> FileVerdict:
    """The verdict on ``a`` and ``b``, each from its run folder in ``folders``."""
    if _same_bytes(a, b):
        return FileVerdict(name, _kind_or_file(a), "identical")
    try:
        kind = file_kind(a)
    except OSError as err:
        return FileVerdict(name, "file", "unreadable", detail=f"{a}: {err.strerror}")
    if kind == "file":
        return _compare_bytes(name, a, b, folders)
    reader = READERS[kind]
    loaded = []
    for path, folder in zip((a, b), folders, strict=True):
        try:
            tensors, fields, hashes = reader(path)
        except read_errors(kind) as err:
            return FileVerdict(
                name, kind, "unreadable", detail=f"{path}: {unreadable_reason(err, kind)}"
            )
        unloaded = fields.get(NOT_LOADED, "")
        loaded.append((_placeheld_keys(tensors, folder), _placeheld(fields, folder), hashes))
    from reprotrain.compare.weights import compare_weights

    (ta, fa, hashes), (tb, fb, _) = loaded
    diffs = [d for d in compare_weights(ta, tb) if not d.equal]
    fields = _field_diffs(fa, fb)
    compared = len(set(ta) | set(tb))
    status: Status = "tensors" if diffs else "fields" if fields else "identical"
    detail = "same tensors and fields; the bytes differ" if status == "identical" else ""
    if unloaded:
        detail = (
            f"{detail}; " if detail else ""
        ) + f"read without running its code: {unloaded} compared by their tensors and fields"
    return FileVerdict(name, kind, status, compared, diffs, fields, detail, hashes)


def one_sided(name: str, present: Path, absent: str) -> FileVerdict:
    """A file one run wrote and ``absent`` did not: its tensors, if any, are missing."""
    kind = _kind_or_file(present)
    status: Status = "bytes" if kind == "file" else "tensors"
    return FileVerdict(name, kind, status, detail=f"not written by {absent}")


def _kind_or_file(path: Path) -> Kind:
    try:
        return file_kind(path)
    except OSError:
        return "file"


def _same_bytes(a: Path, b: Path) -> bool:
    if a.stat().st_size != b.stat().st_size:
        return False
    with a.open("rb") as ha, b.open("rb") as hb:
        while chunk := ha.read(_CHUNK):
            if chunk != hb.read(_CHUNK):
                return False
    return True


def _folder_spellings(folder: Path) -> list[str]:
    spellings = {str(folder), str(folder.resolve())}
    return sorted(spellings, key=len, reverse=True)  # the longer first: one may contain the other


def _with_placeholder(text: str, folder: Path) -> str:
    for spelling in _folder_spellings(folder):
        text = text.replace(spelling, PLACEHOLDER)
    return text


def _placeheld_keys(tensors: dict[str, Any], folder: Path) -> dict[str, Any]:
    """The same tensors, with the run's own folder in their key paths written as ``{out}``
    (``ModelCheckpoint``'s ``best_k_models`` is keyed by each checkpoint's path)."""
    return {_with_placeholder(key, folder): value for key, value in tensors.items()}


def _placeheld(fields: dict[str, Any], folder: Path) -> dict[str, str]:
    """Each value's repr by its key path, with the run's own folder written as ``{out}`` in
    both."""
    out = {}
    for key, value in fields.items():
        # a set's order follows its members' hashes, and each run's paths hash otherwise
        if isinstance(value, set | frozenset):
            members = sorted(_with_placeholder(repr(v), folder) for v in value)
            text = f"{type(value).__name__}({{{', '.join(members)}}})"
        else:
            text = _with_placeholder(value if isinstance(value, str) else repr(value), folder)
        out[_with_placeholder(key, folder)] = repr(text) if isinstance(value, str) else text
    return out


def _field_diffs(a: dict[str, str], b: dict[str, str]) -> list[str]:
    out = []
    for key in sorted(set(a) | set(b)):
        if key not in b:
            out.append(f"{key}: missing (not in b)")
        elif key not in a:
            out.append(f"{key}: extra (not in a)")
        elif a[key] != b[key]:
            out.append(f"{key}: {_clip(a[key])} vs {_clip(b[key])}")
    return out


def _clip(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def _short(text: str, limit: int = 60) -> str:
    return repr(_clip(text, limit))


def _compare_bytes(name: str, a: Path, b: Path, folders: tuple[Path, Path]) -> FileVerdict:
    """Bytes with each run's folder as ``{out}``; a text file names its first differing line."""
    contents = []
    for path, folder in zip((a, b), folders, strict=True):
        data = path.read_bytes()
        for spelling in _folder_spellings(folder):
            data = data.replace(spelling.encode(), PLACEHOLDER.encode())
        contents.append(data)
    da, db = contents
    if da == db:
        return FileVerdict(
            name, "file", "identical", detail="equal once each run's folder is {out}"
        )
    try:
        lines_a, lines_b = da.decode().splitlines(), db.decode().splitlines()
    except UnicodeDecodeError:
        at = next(
            (i for i, (x, y) in enumerate(zip(da, db, strict=False)) if x != y),
            min(len(da), len(db)),
        )
        return FileVerdict(
            name, "file", "bytes", detail=f"{len(da)} vs {len(db)} bytes, first at byte {at}"
        )
    at = next(
        (i for i, (x, y) in enumerate(zip(lines_a, lines_b, strict=False)) if x != y),
        min(len(lines_a), len(lines_b)),
    )
    line_a = lines_a[at] if at < len(lines_a) else "(no line)"
    line_b = lines_b[at] if at < len(lines_b) else "(no line)"
    return FileVerdict(
        name, "file", "bytes", detail=f"text, line {at + 1}: {_short(line_a)} vs {_short(line_b)}"
    )
