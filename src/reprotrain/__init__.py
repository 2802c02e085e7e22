"""reprotrain: bitwise-reproducible PyTorch Lightning training.

The package has three layers; each imports only from the ones above it here:

* The library, the modules at this level (usable in any Lightning project,
  no pipeline imports): :mod:`~reprotrain.determinism` (``configure_determinism``),
  :mod:`~reprotrain.distributed`, :mod:`~reprotrain.resume`, :mod:`~reprotrain.trace`
  with :mod:`~reprotrain.tracefile`, :mod:`~reprotrain.tracerows` and
  :mod:`~reprotrain.rngstate` (per-step fingerprints), the comparisons
  :mod:`~reprotrain.tracediff`, :mod:`~reprotrain.weightdiff`,
  :mod:`~reprotrain.envdiff`, :mod:`~reprotrain.diffreport`,
  :mod:`~reprotrain.modulediff`, and the building blocks
  :mod:`~reprotrain.hashing`, :mod:`~reprotrain.devicehash`,
  :mod:`~reprotrain.atomic`, :mod:`~reprotrain.environment`,
  :mod:`~reprotrain.provenance`, :mod:`~reprotrain.nondeterminism`,
  :mod:`~reprotrain.opcatalog`.
* The pipeline (:mod:`reprotrain.pipeline`), one user of the library: typed
  config, model, data, and the stages ``dvc.yaml`` runs (``pipeline/stages/``).
* The commands (:mod:`reprotrain.commands`): the CLI verbs that are not
  stages (verify, compare, ...), and :mod:`reprotrain.cli` on top.

Old module names keep working for one release with a ``DeprecationWarning``:
``reprotrain.compare`` (now tracediff + weightdiff + diffreport + envdiff),
``reprotrain.locate`` (now modulediff), ``reprotrain.fingerprints`` (now devicehash).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

__version__ = "0.1.0"

#: Deprecated module name -> the modules its names now live in.
MOVED = {
    "reprotrain.compare": ("tracediff", "weightdiff", "diffreport", "envdiff"),
    "reprotrain.locate": ("modulediff",),
    "reprotrain.fingerprints": ("devicehash",),
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports a deprecated name as a module holding the public names of its successors."""

    def find_spec(self, fullname: str, path: object, target: object = None) -> object:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        successors = [f"reprotrain.{name}" for name in MOVED[module.__name__]]
        warnings.warn(
            f"{module.__name__} is deprecated; import from {', '.join(successors)}",
            DeprecationWarning,
            stacklevel=2,
        )
        for name in successors:
            successor = importlib.import_module(name)
            for attr in getattr(successor, "__all__", ()):
                setattr(module, attr, getattr(successor, attr))


sys.meta_path.append(_MovedModules())
