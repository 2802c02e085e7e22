"""Benchmarks and evidence for a GPU host: twin runs, determinism settings, the docs' GPU rows."""
