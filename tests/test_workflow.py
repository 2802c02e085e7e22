"""The shipped GitHub workflow: what its CPU job runs, a linter on it, and a runner's run of it.

`.ci/run-workflow` runs the job's `run:` steps in order in a fresh clone, as a hosted runner
would; the slow test does that under a user's machine (pip's machine config and find-links
isolated), with a stand-in for PyTorch's CPU index built from the wheel pip finds here.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from reprotrain.provenance.environment import read_lock_pins
from tests.helpers import ROOT

WORKFLOW = ROOT / ".github" / "workflows" / "reproducibility.yml"
RUNNER = ROOT / ".ci" / "run-workflow"
ZIZMOR = Path(sys.executable).with_name("zizmor")


def _cpu_runs() -> list[str]:
    steps = yaml.safe_load(WORKFLOW.read_text())["jobs"]["cpu"]["steps"]
    return [step["run"] for step in steps if "run" in step]


def test_cpu_job_checks_the_committed_reference_and_reruns() -> None:
    runs = _cpu_runs()
    assert runs[0] == "make test"
    check = next(i for i, run in enumerate(runs) if "make check-reference" in run)
    repro = next(i for i, run in enumerate(runs) if "make repro" in run)
    # the one-run check on a clean clone first; the reruns after it
    assert check < repro
    assert any("reprotrain verify" in run for run in runs)
    # the job sets nothing about torch's index: make decides (tools/torch-index)
    assert "PIP_EXTRA_INDEX_URL" not in WORKFLOW.read_text()


def test_runner_script_lists_the_steps_in_the_workflows_order() -> None:
    done = subprocess.run(
        [sys.executable, str(RUNNER), "--dry-run"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    listed = [line for line in done.stdout.splitlines() if line.startswith("run-workflow: [run]")]
    steps = yaml.safe_load(WORKFLOW.read_text())["jobs"]["cpu"]["steps"]
    assert listed == [f"run-workflow: [run] {s['name']}" for s in steps if "run" in s]


def test_zizmor_passes_the_workflow_and_flags_an_unpinned_action(tmp_path: Path) -> None:
    clean = subprocess.run(
        [str(ZIZMOR), "--offline", str(WORKFLOW.parent)], capture_output=True, text=True
    )
    assert clean.returncode == 0, clean.stdout + clean.stderr
    # negative control: the same workflow with one action pinned by tag, not by SHA
    bad = tmp_path / ".github" / "workflows" / WORKFLOW.name
    bad.parent.mkdir(parents=True)
    text = WORKFLOW.read_text()
    pinned = text.split("uses: actions/checkout@", 1)[1].split("\n", 1)[0]
    bad.write_text(text.replace(pinned, "v4", 1))
    flagged = subprocess.run([str(ZIZMOR), "--offline", str(bad)], capture_output=True, text=True)
    assert flagged.returncode != 0
    assert "unpinned-uses" in flagged.stdout + flagged.stderr


def _stand_in_cpu_index(folder: Path) -> str:
    """A PEP 503 index holding the CPU lock's torch wheel, from pip's find-links here."""
    version = read_lock_pins(ROOT / "requirements-cpu.lock")["torch"]
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True
    ).stdout
    links = [
        link.strip("'\"")
        for line in listed.splitlines()
        if line.split("=", 1)[0].endswith("find-links")
        for link in line.split("=", 1)[1].split()
    ]
    links += os.environ.get("PIP_FIND_LINKS", "").split()
    wheels = sorted({w.resolve() for d in links for w in Path(d).glob(f"torch-{version}-*.whl")})
    if not wheels:
        return "https://download.pytorch.org/whl/cpu"  # a machine that reaches it
    project = folder / "simple" / "torch"
    project.mkdir(parents=True)
    anchors = []
    for wheel in wheels:
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        anchors.append(f'<a href="{wheel.resolve().as_uri()}#sha256={digest}">{wheel.name}</a>')
    (project / "index.html").write_text("<html><body>" + "".join(anchors) + "</body></html>\n")
    return (folder / "simple").as_uri()


@pytest.mark.slow
def test_the_cpu_job_passes_in_a_fresh_clone_on_a_users_machine(tmp_path: Path) -> None:
    if shutil.which("make") is None:
        pytest.skip("needs make")
    if os.environ.get("REPROTRAIN_RUN_WORKFLOW") or os.environ.get("GITHUB_ACTIONS"):
        pytest.skip("this is already a run of the workflow's steps (the job, or this test's)")
    index = _stand_in_cpu_index(tmp_path / "index")
    # The steps whose commands .ci/run itself runs on its fresh clone right after the slow
    # tests (make test, make test-slow, make check-reference, reprotrain verify as `make
    # verify`) are left out: nested here they would repeat 20+ minutes of its own. What
    # only this run shows: the venv made on a user's machine, and the job's two repros.
    skip = ("make test", "make check-reference", "reprotrain verify")
    skips = [arg for text in skip for arg in ("--skip", text)]
    done = subprocess.run(
        [sys.executable, str(RUNNER), "--simulate-user-machine", index, *skips],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "lack requirements-cpu.lock's torch wheel: adding --extra-index-url" in out
    assert "job cpu passed" in out
    assert "run-workflow: >>> dvc repro twice" in out, out[-4000:]
