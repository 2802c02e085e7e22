"""reprotrain: bitwise-reproducible PyTorch Lightning training.

The library (usable in any Lightning project, no pipeline imports):

* :mod:`reprotrain.determinism`: ``configure_determinism`` and friends.
* :mod:`reprotrain.hashing`: ``fingerprint_state_dict``, ``sha256_file``, ``canonical_json``.
* :mod:`reprotrain.atomic`: whole-or-nothing file writes.

The pipeline (:mod:`reprotrain.pipeline`) is one user of the library: the
``prepare``, ``train`` and ``evaluate`` stages that ``dvc.yaml`` runs.
"""

__version__ = "0.1.0"
