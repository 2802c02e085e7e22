"""The CPU kernels: which kernels a CPU runs, so the bits do not follow the host.

``profile`` (:class:`~reprotrain.cpu.profile.CpuProfile`: the ``portable`` and
``native`` profiles, their variables and checks) is light to import; under
``portable`` it routes the ops it lists to ``kernels`` (on torch's CPU key),
which runs matrix products on ``gemm`` (the pinned OpenBLAS in fixed row
blocks) and 2-D convolutions on ``conv`` (im2col around that GEMM).
"""
