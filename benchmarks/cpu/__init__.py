"""Benchmarks of the CPU kernels: the portable profile's pins, routed kernels and their bits."""
