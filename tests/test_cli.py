"""The CLI answers --help and argument errors without importing torch or Lightning."""

from __future__ import annotations

import errno
import subprocess
import sys

import pytest

from reprotrain.pipeline.arguments import COMMANDS
from tests.helpers import ROOT, cli_env

HEAVY = ("torch", "lightning", "numpy", "safetensors")


def _imported_after(argv: list[str]) -> tuple[int, set[str]]:
    """Run ``reprotrain ARGV`` in a fresh interpreter: exit code, heavy modules it loaded."""
    probe = (
        "import sys\n"
        "from reprotrain.cli import main\n"
        "try:\n"
        f"    code = main({argv!r})\n"
        "except SystemExit as stop:\n"
        "    code = stop.code\n"
        f"print(code, *sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, env=cli_env()
    )
    words = result.stdout.splitlines()[-1].split() if result.stdout else []
    assert words, result.stderr
    return int(words[0]), set(words[1:])


@pytest.mark.parametrize("command", ["", *COMMANDS, "params"])
def test_help_imports_no_torch(command: str) -> None:
    code, heavy = _imported_after([command, "--help"] if command else ["--help"])
    assert (code, heavy) == (0, set())


@pytest.mark.parametrize("command", ["train", "verify", "bench", "compare"])
def test_an_argument_error_exits_2_without_importing_torch(command: str) -> None:
    code, heavy = _imported_after([command, "--no-such-flag"])
    assert (code, heavy) == (2, set())


def test_running_a_command_does_import_what_it_needs() -> None:
    # Negative control: the probe does see torch once a command really runs.
    code, heavy = _imported_after(["params", "--params", str(ROOT / "params.yaml")])
    assert code == 0 and "torch" not in heavy
    code, heavy = _imported_after(["ops", "--only", "no-such-op", "--repeats", "2"])
    assert "torch" in heavy


def test_a_usage_error_is_one_line_that_says_where_to_look() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "reprotrain", "compare", "a", "b", "--bogus"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=cli_env(),
    )
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "reprotrain: error: unrecognized arguments: --bogus; see `reprotrain compare --help`"
    ]


def _fail_with(monkeypatch: pytest.MonkeyPatch, error: OSError) -> int:
    import reprotrain.commands.compare as command
    from reprotrain.cli import main

    def broken(*_: object) -> int:
        raise error

    monkeypatch.setattr(command, "run", broken)
    return main(["compare", "a", "b"])


def test_a_full_disk_is_one_line_with_the_file_and_what_to_do(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("DVC_STAGE", raising=False)
    full = OSError(errno.ENOSPC, "No space left on device", "models/model.safetensors")
    assert _fail_with(monkeypatch, full) == 2
    assert capsys.readouterr().err.splitlines() == [
        "reprotrain: error: models/model.safetensors: No space left on device; "
        "free disk space there and rerun"
    ]
    # Under dvc repro the line also says where the stage's previous outputs are.
    monkeypatch.setenv("DVC_STAGE", "train")
    assert _fail_with(monkeypatch, full) == 2
    assert "`dvc checkout train` restores them" in capsys.readouterr().err
    # Negative control: other OS errors are not dressed up as storage errors.
    with pytest.raises(FileNotFoundError):
        _fail_with(monkeypatch, FileNotFoundError(errno.ENOENT, "No such file", "x"))
