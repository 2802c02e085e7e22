"""reprotrain: bitwise-reproducible PyTorch Lightning training.

The package has three layers; each imports only from the ones above it here
(tests/test_structure.py checks it, docs/architecture.md maps every module):

* The library, usable in any Lightning project, no pipeline imports. At the
  root, what every part uses: :mod:`~reprotrain.determinism`
  (``configure_determinism``, raise-or-warn), :mod:`~reprotrain.seeding`,
  :mod:`~reprotrain.resume`,
  :mod:`~reprotrain.hashing` (sha256 digests), :mod:`~reprotrain.fingerprint`
  (int64 tensor fingerprints on the tensor's device), :mod:`~reprotrain.atomic`.
  By concern, in subpackages: :mod:`reprotrain.cpu` (the CPU profiles and the
  portable profile's kernels),
  :mod:`reprotrain.trace` (per-step fingerprints of a run, and their diff),
  :mod:`reprotrain.ops` (every aten op of a step: recording, alignment,
  non-deterministic op probes), :mod:`reprotrain.distributed` (DDP ranks and
  world-size invariance), :mod:`reprotrain.provenance` (the environment
  record, run IDs, DVC checksums), :mod:`reprotrain.compare` (weights,
  modules, files, and the combined report).
* The pipeline (:mod:`reprotrain.pipeline`), one user of the library: typed
  config, model, data, and the stages ``dvc.yaml`` runs (``pipeline/stages/``).
* The commands (:mod:`reprotrain.commands`): the CLI verbs that are not
  stages (verify, compare, ...), and :mod:`reprotrain.cli` on top.
"""

from __future__ import annotations

__version__ = "0.1.0"
