"""Fingerprints change exactly when bits change; safetensors bytes are process-independent."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from reprotrain.hashing import canonical_json, sha256_file, sha256_state_dict
from tests.helpers import cli_env


def _state() -> dict[str, torch.Tensor]:
    return {"b": torch.arange(4, dtype=torch.float32), "a": torch.ones(2, 2, dtype=torch.bfloat16)}


def test_equal_tensors_give_equal_fingerprints() -> None:
    assert sha256_state_dict(_state()) == sha256_state_dict(dict(reversed(_state().items())))


def test_one_ulp_changes_the_sha256() -> None:
    changed = _state()
    changed["b"][1] = torch.nextafter(changed["b"][1], torch.tensor(2.0))
    assert sha256_state_dict(changed) != sha256_state_dict(_state())


def test_signed_zero_name_shape_and_dtype_all_count() -> None:
    base = sha256_state_dict({"w": torch.zeros(2)})
    assert base != sha256_state_dict({"w": -torch.zeros(2)})
    assert base != sha256_state_dict({"v": torch.zeros(2)})
    assert base != sha256_state_dict({"w": torch.zeros(1, 2)})
    assert base != sha256_state_dict({"w": torch.zeros(2, dtype=torch.float64)})


def test_canonical_json_is_order_independent() -> None:
    assert canonical_json({"b": 1, "a": [1.5]}) == canonical_json({"a": [1.5], "b": 1})
    assert canonical_json({"a": 1}).endswith("}\n")


# safetensors' NumPy front end: the writer (and its map order) is the Rust one that
# torch's front end calls, without torch's start-up in each fresh process.
_WRITE = """
import sys, numpy
from safetensors.numpy import save_file
from reprotrain.hashing import safetensors_metadata
meta = {f"key{i}": str(i) for i in range(8)}
if sys.argv[2] == "packed":
    meta = safetensors_metadata(meta)
save_file({"w": numpy.arange(6.0, dtype=numpy.float32)}, sys.argv[1], metadata=meta)
"""


def _write_in_fresh_process(path: Path, how: str) -> str:
    subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_WRITE), str(path), how],
        env=cli_env(),
        check=True,
        timeout=120,
    )
    return sha256_file(path)


def test_packed_metadata_gives_identical_bytes_across_processes(tmp_path: Path) -> None:
    hashes = {_write_in_fresh_process(tmp_path / f"{i}.st", "packed") for i in range(3)}
    assert len(hashes) == 1


def test_raw_multi_key_metadata_is_not_byte_stable(tmp_path: Path) -> None:
    # Negative control for the packing: safetensors writes its metadata map in
    # per-process hash order (8 keys: 40,320 orders, so three equal runs ~ 1e-9).
    hashes = {_write_in_fresh_process(tmp_path / f"{i}.st", "raw") for i in range(3)}
    assert len(hashes) > 1


def test_a_damaged_safetensors_file_is_one_error_that_names_it(tmp_path: Path) -> None:
    import json

    import pytest
    from safetensors.torch import save_file

    from reprotrain.hashing import (
        UnreadableSafetensors,
        load_safetensors,
        read_safetensors_metadata,
        safetensors_metadata,
    )

    good = tmp_path / "good.safetensors"
    save_file({"w": torch.arange(4.0)}, good, safetensors_metadata({"seed": 1}))
    assert read_safetensors_metadata(good) == load_safetensors(good)[1] == {"seed": 1}
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(good.read_bytes()[:-4])
    headers = {
        "list": [1],
        "string": {"__metadata__": "x"},
        "ours": {"__metadata__": {"reprotrain": "["}},
    }
    for name, header in headers.items():
        text = json.dumps(header).encode()
        (tmp_path / f"{name}.safetensors").write_bytes(len(text).to_bytes(8, "little") + text)
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(good.read_bytes()[:20])  # ends inside the header
    for path, read in (
        (truncated, load_safetensors),
        (cut, read_safetensors_metadata),
        *((tmp_path / f"{name}.safetensors", read_safetensors_metadata) for name in headers),
        (tmp_path / "ours.safetensors", load_safetensors),
    ):
        with pytest.raises(UnreadableSafetensors) as raised:
            read(path)
        assert raised.value.path == path and isinstance(raised.value, ValueError)
        assert str(raised.value) and "\n" not in str(raised.value)
