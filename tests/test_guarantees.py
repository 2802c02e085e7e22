"""docs/guarantees.md: every guarantee beside a test that exists and a negative control.

A row whose test was renamed or deleted, or that lost its test or its control,
fails here, naming the row; a planted row naming a test that does not exist is
the control.
"""

from __future__ import annotations

import ast
import re

from tests.helpers import ROOT

LIST = ROOT / "docs" / "guarantees.md"
CELL = re.compile(r"^(test_\w+\.py)::(test_\w+)$")


def rows(text: str) -> list[list[str]]:
    """The table's data rows, cells stripped."""
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]


def missing(cell: str) -> str | None:
    """Why ``cell`` is not a test function of a file under tests/; None when it is."""
    match = CELL.match(cell)
    if match is None:
        return f"{cell!r}: not file::test"
    path = ROOT / "tests" / match.group(1)
    if not path.is_file():
        return f"{cell}: no such file"
    tree = ast.parse(path.read_text())
    names = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    return None if match.group(2) in names else f"{cell}: no such test"


def problems(text: str) -> list[str]:
    found = []
    for guarantee, test, control in rows(text):
        for cell in (test, control):
            if problem := missing(cell):
                found.append(f"{guarantee}: {problem}")
        if test == control:
            found.append(f"{guarantee}: the control is the test itself")
    return found


def test_every_guarantee_has_a_test_and_a_negative_control_that_exist() -> None:
    text = LIST.read_text()
    assert len(rows(text)) >= 20
    assert problems(text) == []


def test_a_guarantee_whose_test_is_gone_is_named() -> None:
    text = LIST.read_text() + (
        "| a planted guarantee | test_train.py::test_that_was_renamed | "
        "test_train.py::test_different_seed_gives_different_weights |\n"
    )
    assert problems(text) == [
        "a planted guarantee: test_train.py::test_that_was_renamed: no such test"
    ]
