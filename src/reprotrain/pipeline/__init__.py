"""The pipeline: one user of the library, run by ``dvc repro``.

``config`` (params.yaml as frozen, typed objects), ``rawdata`` and ``preflight``
(checks run before DVC deletes outputs), ``arguments`` (every
sub-command's options, without torch), ``errors``, ``model``, ``data``,
``curves`` and ``run_record`` sit on the library; ``stages/`` holds exactly
the ``dvc.yaml`` stages, one module each, built on those.
"""
