"""Errors for bad input files; kept free of heavy imports so every command can use them."""

from __future__ import annotations


class DataError(ValueError):
    """A data, model, lock or record file is missing or malformed; the message names it."""


class Interrupted(Exception):
    """Training stopped by SIGINT or SIGTERM; the message says which checkpoint resumes it."""


def yaml_line(err: Exception) -> str:
    """`` (line N)`` where a YAML parser error points, for a one-line message; else ``""``."""
    where = getattr(err, "problem_mark", None)
    return f" (line {where.line + 1})" if where else ""
