"""Benchmarks, by what they measure: ``cpu/``, ``gpu/``, ``suite/``, ``overhead/``; ``_common/``
holds what they share. Each script runs from the repository root as
``python benchmarks/<group>/<script>.py`` and puts the root on ``sys.path`` first, so that
``benchmarks._common`` (and ``tests.helpers``) import the same way from every folder."""
