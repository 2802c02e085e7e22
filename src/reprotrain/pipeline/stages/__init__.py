"""The ``dvc.yaml`` stages, one module each: ``env``, ``prepare``, ``train``, ``evaluate``.

Each has ``PARAMS`` (exactly the params.yaml keys it reads, as dvc.yaml lists
them), ``add_arguments`` and ``COMMAND`` (its options, see
:mod:`reprotrain.pipeline.command`) and ``run(params, args)``.
"""
