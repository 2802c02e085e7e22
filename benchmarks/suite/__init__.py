"""Benchmarks of the test suite and its hosts: where its CPU goes, start-up, host speed."""
