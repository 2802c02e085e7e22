"""The ``reprotrain`` verbs that are not pipeline stages, one module each.

``run-id``, ``checklist``, ``verify``, ``compare``, ``locate``,
``noise_floor``, ``bench`` and ``ops``; modules starting with ``_`` are their
shared helpers (``_rerun``: train again in fresh processes; ``_rundiff``: a
run's files, found in a folder or at a git revision, and two runs compared).
Commands sit on the stages and the library; only :mod:`reprotrain.cli` is above.
"""
