"""Atomic writes: the final name holds the old or the new bytes, never a part."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from reprotrain.atomic import atomic_path, atomic_write_text
from tests.helpers import cli_env


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


# Each kind imports only what its writer needs (the text writer neither torch nor Lightning).
_WRITE_BIG = """
import sys
from pathlib import Path
from reprotrain.atomic import atomic_path, atomic_write_text
kind, final = sys.argv[1], Path(sys.argv[2])
if kind == "text":
    text = "x" * 400_000_000  # 400 MB: the write takes long enough to be caught
    print("ready", flush=True)
    atomic_write_text(final, text)
    sys.exit()
import torch
big = torch.ones(100_000_000)
if kind == "safetensors":
    from safetensors.torch import save_file
    print("ready", flush=True)
    with atomic_path(final) as tmp:
        save_file({"w": big}, tmp)
else:
    from reprotrain.resume import VerifiedCheckpointIO
    print("ready", flush=True)
    VerifiedCheckpointIO().save_checkpoint({"w": big}, final)
"""


@pytest.mark.parametrize(
    ("kind", "name"),
    [("text", "metrics.json"), ("safetensors", "model.safetensors"), ("ckpt", "epoch=3.ckpt")],
)
def test_kill_9_during_a_write_never_exposes_a_partial_file(
    kind: str, name: str, tmp_path: Path
) -> None:
    final = tmp_path / name
    final.write_bytes(b"previous, complete output")
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITE_BIG, kind, str(final)],
        env=cli_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "ready"
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(f".{name}.tmp-*")) and time.monotonic() < deadline:
        time.sleep(0.001)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the write finished before the kill"
    assert final.read_bytes() == b"previous, complete output"


def test_a_full_disk_is_an_oserror_naming_the_final_file_and_no_temp_stays(tmp_path: Path) -> None:
    # A real full file system (a 64 KiB tmpfs in a private mount namespace), not a mock.
    folder = tmp_path / "small"
    folder.mkdir()
    code = (
        "import errno, sys, torch\n"
        "from reprotrain.atomic import atomic_write_safetensors\n"
        "try:\n"
        f"    atomic_write_safetensors('{folder}/model.safetensors', {{'w': torch.ones(2**16)}})\n"
        "except OSError as err:\n"
        "    print(errno.errorcode[err.errno], err.filename)\n"
    )
    mount = f'mount -t tmpfs -o size=64k tmpfs {folder} && exec {sys.executable} -c "$0"'
    result = subprocess.run(
        ["unshare", "--mount", "--map-root-user", "sh", "-c", mount, code],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.stdout.split() == ["ENOSPC", f"{folder}/model.safetensors"], result.stderr
