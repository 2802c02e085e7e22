"""Read a torch checkpoint that holds objects, without running any of its code.

``torch.load(weights_only=True)`` refuses a checkpoint that pickles a class of
its own: a Lightning checkpoint whose ``hyper_parameters`` hold the model's
``net`` (``save_hyperparameters()`` in the Hydra and LightningCLI templates),
a Hydra ``DictConfig``. Loading it with ``weights_only=False`` would import
and run that code. :func:`load_opaque` does neither: its unpickler resolves
only the globals a tensor needs (torch's rebuild functions, dtypes, sizes,
``OrderedDict`` and a few builtin containers); every other class or function
becomes an :class:`Opaque` placeholder that records its name, the arguments it
was called with and the state pickle gave it, and runs nothing. The objects'
tensors (a pickled ``net``'s parameters) and plain values then compare like
any others; :func:`opaque_names` says which classes were not loaded.
"""

from __future__ import annotations

import collections
import pickle
import types
from pathlib import Path
from typing import Any

#: Globals resolved to the real object: what rebuilding a tensor needs, and plain containers.
REAL: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    **{
        (module, kind.__name__): kind
        for module in ("builtins", "__builtin__")  # torch pickles with protocol 2
        for kind in (set, frozenset, complex, slice, bytearray)
    },
}
TORCH_REAL = (
    ("torch._utils", "_rebuild_tensor"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_parameter"),
    ("torch._utils", "_rebuild_parameter_with_state"),
    ("torch", "Size"),
)


class Opaque:
    """A pickled object of a class that was not loaded: its name, call arguments and state."""

    path = "?"

    def __new__(cls, *args: Any, **kwargs: Any) -> Opaque:
        return super().__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.__dict__["_args"] = (list(args), dict(kwargs))
        self.__dict__["_state"] = None

    def __setstate__(self, state: Any) -> None:
        self.__dict__["_state"] = state
        self.__dict__.setdefault("_args", ([], {}))

    def __setitem__(self, key: Any, value: Any) -> None:  # SETITEMS on a dict subclass
        self.__dict__.setdefault("_items", {})[key] = value

    def append(self, value: Any) -> None:  # APPENDS on a list subclass
        self.__dict__.setdefault("_items", {})[len(self.__dict__.get("_items", {}))] = value

    def extend(self, values: Any) -> None:
        for value in values:
            self.append(value)

    def __call__(self, *args: Any, **kwargs: Any) -> Opaque:  # a placeholder function's result
        return _placeholder(f"{self.path}()")(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<{self.path}, not loaded>"

    def contents(self) -> dict[str, Any]:
        """What pickle gave it, as a mapping to compare: arguments, state, items."""
        args, kwargs = self.__dict__.get("_args", ([], {}))
        out: dict[str, Any] = {"class": self.path}
        if args or kwargs:
            out["args"] = {**{str(i): a for i, a in enumerate(args)}, **kwargs}
        if self.__dict__.get("_state") is not None:
            out["state"] = self.__dict__["_state"]
        if "_items" in self.__dict__:
            out["items"] = self.__dict__["_items"]
        return out


_PLACEHOLDERS: dict[str, type[Opaque]] = {}


def _placeholder(path: str) -> type[Opaque]:
    if path not in _PLACEHOLDERS:
        _PLACEHOLDERS[path] = type(path.rpartition(".")[2] or path, (Opaque,), {"path": path})
    return _PLACEHOLDERS[path]


def _reconstructor(cls: Any, base: Any, state: Any) -> Any:
    """``copyreg._reconstructor`` without calling ``base``: the object is a placeholder."""
    made = cls.__new__(cls) if isinstance(cls, type) and issubclass(cls, Opaque) else Opaque()
    if state is not None:
        made.__setstate__({"base_state": state})
    return made


class _Unpickler(pickle.Unpickler):
    """Resolves :data:`REAL` and torch's rebuild functions; anything else to a placeholder."""

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if (module, name) in REAL:
            return REAL[(module, name)]
        if (module, name) in TORCH_REAL:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) == ("copyreg", "_reconstructor"):
            return _reconstructor
        path = f"{module}.{name}"
        _SEEN.add(path)
        return _placeholder(path)


_SEEN: set[str] = set()


#: What ``torch.load(pickle_module=...)`` needs: an Unpickler, ``load`` and a name.
_PICKLE_MODULE = types.SimpleNamespace(
    Unpickler=_Unpickler, load=pickle.load, __name__="reprotrain-opaque-pickle"
)


def load_opaque(path: Path) -> tuple[Any, list[str]]:
    """The checkpoint at ``path`` with every unknown class a placeholder, and those classes."""
    import torch

    _SEEN.clear()
    loaded = torch.load(path, map_location="cpu", weights_only=False, pickle_module=_PICKLE_MODULE)
    return loaded, sorted(_SEEN)
