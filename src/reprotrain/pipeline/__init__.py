"""The pipeline: one user of the library, run by ``dvc repro``.

``config`` (params.yaml as frozen, typed objects), ``rawdata`` and ``preflight``
(checks run before DVC deletes outputs), ``command`` (what a verb declares,
and a stage's command line read back from dvc.yaml), ``errors``, ``model``,
``data``, ``curves``, ``training`` (the train stage's Lightning fit) and
``run_record`` sit on the library; ``stages/`` holds exactly the ``dvc.yaml``
stages, one module each, built on those.
"""
