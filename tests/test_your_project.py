"""An existing Lightning project adopts the library: Hydra and LightningCLI (docs/your-project.md).

Each project in tests/projects/ trains the user's own module (digits.py) with
reprotrain's callbacks listed in its config. ``verify -- CMD`` finds two clean
runs identical, and a value planted at one line (``# FAULT``) is named at
that line by the op recording (negative control).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.helpers import ROOT, cli_env, run_checked, run_cli

PROJECTS = ROOT / "tests" / "projects"
_SOURCE = (PROJECTS / "digits.py").read_text().splitlines()
FAULT_LINE = "tests/projects/digits.py:" + str(
    next(i for i, line in enumerate(_SOURCE, 1) if line.rstrip().endswith("# FAULT"))
)
#: project -> (its command for verify; the override that plants the fault; the clean verdict
#: when verify compares every file: .hydra/*.yaml and LightningCLI's config.yaml record
#: the run folder, compared with it as {out}; this project logs nothing itself, so Hydra's
#: log holds no timestamp: tests/test_anyscript.py's Hydra app, which logs, gets exit 4)
COMMANDS = {
    "hydra": (
        [sys.executable, str(PROJECTS / "hydra_train.py"), "hydra.run.dir={out}"],
        "model.fault=true",
        "IDENTICAL",
    ),
    "lightningcli": (
        [
            sys.executable, str(PROJECTS / "cli_train.py"), "fit",
            "--config", str(PROJECTS / "cli.yaml"), "--trainer.default_root_dir={out}",
            "--trainer.callbacks+=reprotrain.trace.callback.TraceCallback",
            "--trainer.callbacks.path={out}/trace.safetensors",
        ],
        "--model.fault=true",
        "IDENTICAL",
    ),
}  # fmt: skip
#: verify's exit code for each verdict (docs/any-script.md)
EXIT = {"IDENTICAL": 0, "NOT REPRODUCIBLE": 1}


def _verify(project: str, work: Path, *options: str, extra: tuple[str, ...] = ()) -> dict:
    command = COMMANDS[project][0]
    done = run_cli(
        "verify", "--json", "--workdir", work, *options, "--", *command, *extra, cwd=ROOT
    )
    report = json.loads(done.stdout)
    assert done.returncode == EXIT[report["verdict"]], done.stdout + done.stderr
    return report


@pytest.mark.slow
@pytest.mark.parametrize("project", sorted(COMMANDS))
def test_a_project_is_identical_and_its_planted_fault_is_named_at_its_line(
    project: str, tmp_path: Path
) -> None:
    _, fault, clean_verdict = COMMANDS[project]
    # Every file the run wrote: checkpoint, trace, final state, configs (run folder as {out}).
    clean = _verify(project, tmp_path / "clean")
    assert clean["verdict"] == clean_verdict, clean
    assert {"trace.safetensors", "final_state.safetensors"} <= set(clean["outputs"])
    report = _verify(project, tmp_path / "fault", "--output", "trace.safetensors", extra=(fault,))
    assert report["verdict"] == "NOT REPRODUCIBLE"
    op = report["op"]
    assert op["kind"] == "inputs" and op["op"]["line"] == FAULT_LINE, report["ops"]
    assert "Python value" in " ".join(op["differing_inputs"])
    # One diagnosis: the trace's headline says what the op recording found, not "kernel".
    assert "a Python value passed to this op differs" in report["trace"]
    assert "non-deterministic kernel" not in report["trace"]


@pytest.mark.slow
def test_the_wheel_installs_into_a_projects_own_environment_and_verifies_there(
    tmp_path: Path,
) -> None:
    """The package's dependencies are ranges: it joins a venv with its own torch and Lightning."""
    dist = tmp_path / "dist"
    run_checked(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                "-w", dist, ROOT, cwd=tmp_path)  # fmt: skip
    (wheel,) = dist.glob("reprotrain-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        requires = [
            line.split(":", 1)[1].strip()
            for line in archive.read(name).decode().splitlines()
            if line.startswith("Requires-Dist:")
        ]
    assert requires and not [r for r in requires if "==" in r], requires  # no lock pins
    venv = tmp_path / "project-venv"
    run_checked(sys.executable, "-m", "venv", venv, cwd=tmp_path)
    # The project's own pins (Lightning 2.6.5, not the lock's 2.6.6), then the wheel.
    own = ("torch==2.13.0", "lightning==2.6.5")
    run_checked(venv / "bin" / "pip", "install", "-q", *own, wheel, cwd=tmp_path)
    path = f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}"

    def verify(fault: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [venv / "bin" / "reprotrain", "verify", "--workdir", tmp_path / fault, "--",
             "python", ROOT / "tests" / "scripts" / "fault_loop.py", "--out", "{out}",
             "--fault", fault],
            cwd=tmp_path, env=cli_env(PATH=path), capture_output=True, text=True,
        )  # fmt: skip

    clean = verify("none")
    assert clean.returncode == 0 and "IDENTICAL" in clean.stdout, clean.stdout + clean.stderr
    listed = run_checked(venv / "bin" / "pip", "list", cwd=tmp_path).lower().splitlines()
    assert ["lightning", "2.6.5"] in [line.split()[:2] for line in listed]
    planted = verify("time")  # negative control: a clock value in the loop
    assert planted.returncode == 1, planted.stdout + planted.stderr
