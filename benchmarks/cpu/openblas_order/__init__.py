"""The summation order of the pinned OpenBLAS's SGEMM kernels: a C model and its checks."""
