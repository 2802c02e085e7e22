"""The CLI answers --help and argument errors without importing torch or Lightning.

It builds its parser by importing every verb module (cli.VERBS) for its
``COMMAND``, so each of them must import nothing heavy at module level: the
probe runs ``reprotrain VERB --help`` in a fresh interpreter and lists what
got imported (about 0.14 s in all here, against 3-4 s for torch and Lightning).
"""

from __future__ import annotations

import dataclasses
import errno
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from reprotrain import cli
from reprotrain.cli import VERBS, verb_command
from tests.helpers import ROOT, cli_env

HEAVY = ("torch", "lightning", "numpy", "safetensors")
#: The verbs that train or configure determinism (or record the variables the stages run
#: with: env, checklist, status), so must start with PYTHONHASHSEED and the CPU profile fixed.
RESTARTING = {
    "env",
    "prepare",
    "train",
    "evaluate",
    "run-id",
    "checklist",
    "status",
    "verify",
    "locate",
    "noise-floor",
    "bench",
    "ops",
}


def _imported_after(argv: list[str], src: Path = ROOT / "src") -> tuple[int, set[str]]:
    """Run ``reprotrain ARGV`` in a fresh interpreter: exit code, heavy modules it loaded.

    ``src`` is the folder the ``reprotrain`` package is imported from.
    """
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
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=cli_env(PYTHONPATH=str(src)),
    )
    words = result.stdout.splitlines()[-1].split() if result.stdout else []
    assert words, result.stderr
    return int(words[0]), set(words[1:])


#: ``reprotrain --help``'s groups -> the verbs each lists, in order.
HELP_GROUPS = {
    "the pipeline's stages (dvc.yaml runs them) and its params": [
        "env", "prepare", "train", "evaluate", "params"
    ],
    "rerun and compare (the pipeline's runs or any script's)": [
        "run", "verify", "compare", "locate", "opdiff"
    ],
    "CI and provenance": [
        "status", "checklist", "run-id", "reference-note", "attest", "verify-attestation"
    ],
    "determinism lab (measured on this machine)": ["noise-floor", "bench", "ops"],
}  # fmt: skip


def help_groups(text: str) -> dict[str, list[str]]:
    """The groups of verbs a ``--help`` text lists after its options: title -> verbs.

    A group is a ``title:`` line, then one ``  verb  summary`` line per verb; a line
    that is neither (a summary wrapped onto a second line) is kept as ``?line``.
    """
    groups: dict[str, list[str]] = {}
    verbs: list[str] | None = None
    for line in text.split("\noptions:\n", 1)[1].splitlines():
        if not line.startswith(" ") and line.endswith(":"):
            verbs = groups.setdefault(line[:-1], [])
        elif verbs is not None and line.strip():
            words = line.split()
            summary = line[2 + len(words[0]) :]
            ok = line.startswith("  ") and summary.startswith("  ") and summary.strip()
            verbs.append(words[0] if ok else f"?{line}")
    return groups


def test_help_lists_every_verb_once_in_its_group_one_line_each(capsys) -> None:
    with pytest.raises(SystemExit) as stop:
        cli.main(["--help"])
    assert stop.value.code == 0
    groups = help_groups(capsys.readouterr().out)
    assert groups == HELP_GROUPS
    assert sorted(v for verbs in groups.values() for v in verbs) == sorted([*VERBS, "params"])
    assert list(cli.VERB_GROUPS) == list(HELP_GROUPS)
    # Negative control: a summary wrapped onto a second line shows as no verb.
    text = "x\noptions:\n  -h\n\nCI and provenance:\n  status  would\n    change anything\n"
    assert help_groups(text) == {"CI and provenance": ["status", "?    change anything"]}


@pytest.mark.parametrize("command", ["", *VERBS, "params"])
def test_help_imports_no_torch(command: str) -> None:
    code, heavy = _imported_after([command, "--help"] if command else ["--help"])
    assert (code, heavy) == (0, set())


def test_a_verb_module_that_imports_torch_at_the_top_is_caught(tmp_path: Path) -> None:
    """Negative control: the probe sees a planted module-level import in one verb module."""
    copy = tmp_path / "reprotrain"
    shutil.copytree(ROOT / "src" / "reprotrain", copy, ignore=shutil.ignore_patterns("__pycache__"))
    verb = copy / "commands" / "compare.py"
    text = verb.read_text()
    verb.write_text(text.replace("import argparse\n", "import argparse\n\nimport torch\n", 1))
    for argv in (["--help"], ["opdiff", "--help"]):  # every verb's help builds the parser
        code, heavy = _imported_after(argv, src=tmp_path)
        assert code == 0 and "torch" in heavy, argv
    assert _imported_after(["--help"]) == (0, set())  # the unplanted package


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


def test_the_verbs_that_restart_are_those_that_train_or_configure_determinism() -> None:
    assert {verb for verb in VERBS if verb_command(verb).restarts} == RESTARTING


class _Restarted(Exception):
    pass


def _restarts(verb_args: list[str], monkeypatch: pytest.MonkeyPatch) -> bool:
    """Whether a real start (``main()`` reading sys.argv) of ``reprotrain ARGS`` restarts."""

    def restart(_: object) -> None:
        raise _Restarted

    monkeypatch.setattr(cli, "_restart_for_determinism", restart)
    monkeypatch.setattr(sys, "argv", ["reprotrain", *verb_args])
    try:
        cli.main()
    except _Restarted:
        return True
    return False


def test_a_verb_restarts_exactly_when_its_command_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import reprotrain.commands.compare as compare

    missing = ["compare", "no-such-run-a", "no-such-run-b"]
    assert not _restarts(missing, monkeypatch)  # ran instead, and said the run is missing
    assert "no-such-run-a" in capsys.readouterr().err
    assert _restarts(["status"], monkeypatch)
    assert not _restarts(["params", "--defaults"], monkeypatch)
    # Negative control: the same verb restarts once its entry says so.
    monkeypatch.setattr(compare, "COMMAND", dataclasses.replace(compare.COMMAND, restarts=True))
    assert _restarts(missing, monkeypatch)


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
    # The env stage, whose record persists, says nothing of it; in a subfolder's pipeline too.
    for env in ("env", "pipelines/lm/dvc.yaml:env"):
        monkeypatch.setenv("DVC_STAGE", env)
        assert _fail_with(monkeypatch, full) == 2
        assert "dvc checkout" not in capsys.readouterr().err
    # Negative control: other OS errors are not dressed up as storage errors.
    with pytest.raises(FileNotFoundError):
        _fail_with(monkeypatch, FileNotFoundError(errno.ENOENT, "No such file", "x"))
