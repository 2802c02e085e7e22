"""The ``reprotrain`` verbs that are not pipeline stages, one module each.

``run-id``, ``checklist``, ``verify``, ``status``, ``compare``, ``locate``,
``opdiff``, ``run``, ``noise_floor``, ``bench``, ``ops``, ``attest`` and
``verify-attestation``, each with its options (``add_arguments``,
``COMMAND``) beside its ``run``, and nothing heavier than PyYAML imported at
module level. Modules starting with ``_`` are their shared helpers
(``_rerun``: train again in fresh processes; ``_findrun``: a run's files,
found in a folder or at a git revision; ``_rundiff``: two runs compared; ``_device``
and ``_steptime``: what ``ops`` and ``bench`` measure with torch;
``_rebuild``: a clean clone of a commit and the environment that runs its own
code). Commands sit on the stages and the library; only
:mod:`reprotrain.cli` is above.
"""
