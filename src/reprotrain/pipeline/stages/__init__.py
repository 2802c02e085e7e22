"""The ``dvc.yaml`` stages, one module each: ``env``, ``prepare``, ``train``, ``evaluate``.

Each has ``PARAMS`` (exactly the params.yaml keys it reads, as dvc.yaml lists
them) and ``run(params, args)``; its arguments are in
:mod:`reprotrain.pipeline.arguments`.
"""
