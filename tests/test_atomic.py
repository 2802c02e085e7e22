"""Atomic writes: the final name holds the old or the new bytes, never a part."""

from __future__ import annotations

from pathlib import Path

import pytest

from reprotrain.atomic import atomic_path, atomic_write_text


def test_write_replaces_whole_file_and_leaves_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "out.json"
    atomic_write_text(target, "old\n")
    atomic_write_text(target, "new\n")
    assert target.read_text() == "new\n"
    assert [p.name for p in target.parent.iterdir()] == ["out.json"]


def test_failed_writer_keeps_previous_file(tmp_path: Path) -> None:
    target = tmp_path / "model.bin"
    target.write_bytes(b"previous")
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("killed mid-write")
    assert target.read_bytes() == b"previous"
    assert [p.name for p in tmp_path.iterdir()] == ["model.bin"]
