"""Start-up: commands that neither train nor build a model import neither Lightning nor
torchmetrics (3-5 s of a process's start on the build hosts, paid by every stage of every
``dvc repro`` and by every CLI test), nor does a plain PyTorch loop that records its steps.

Each command runs for real under ``python -X importtime``, whose log lists every module
imported, nested under the module that imported it, so a failure names the chain that
pulled Lightning in, whatever Lightning's own modules are called next release.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import ROOT, cli_env

#: The packages a command that neither trains nor builds a user's model must not import.
HEAVY = ("lightning", "pytorch_lightning", "lightning_fabric", "torchmetrics")


def heavy_imports(log: str) -> list[str]:
    """Each heavy package's import, as the chain of importers down to it (outermost first).

    ``-X importtime`` writes a module's line after its children's, indented two more
    spaces per level of nesting: a module's importer is the next line one level out.
    """
    entries = []
    for line in log.splitlines():
        if line.startswith("import time:") and line.count("|") == 2:
            name = line.rsplit("|", 1)[1]
            entries.append(((len(name) - len(name.lstrip())) // 2, name.strip()))
    chains = []
    for index, (depth, name) in enumerate(entries):
        if name not in HEAVY:
            continue
        chain, level = [name], depth
        for outer_depth, outer in entries[index + 1 :]:
            if outer_depth < level:
                chain.insert(0, outer)
                level = outer_depth
        chains.append(" -> ".join(chain))
    return chains


def run_timed(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-X", "importtime", "-m", "reprotrain", *map(str, args)]
    env = cli_env(PYTHONHASHSEED="0")  # as the CLI's own restart would set it
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def _prepare(tmp_path: Path) -> list[str]:
    (tmp_path / "raw").mkdir()
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    return ["prepare", "--raw-dir", "raw", "--out", "data.safetensors"]


def _verify(tmp_path: Path) -> list[str]:
    (tmp_path / "w.py").write_text("import sys, pathlib\npathlib.Path(sys.argv[1], 'o').touch()\n")
    return ["verify", "--", sys.executable, "w.py", "{out}"]


def _checklist(tmp_path: Path) -> list[str]:
    """Read-only: in this repository, whatever state its outputs are in."""
    return ["checklist"]


def _compare(tmp_path: Path) -> list[str]:
    from safetensors.numpy import save_file

    for name in ("a", "b"):
        save_file({"w": np.zeros(3, np.float32)}, str(tmp_path / f"{name}.safetensors"))
    return ["compare", "a.safetensors", "b.safetensors"]


def _status(tmp_path: Path) -> list[str]:
    """Read-only: in this repository (exit 1 where a stage would rerun, as in a fresh clone)."""
    return ["status"]


def _opdiff(tmp_path: Path) -> list[str]:
    """The AMD side committed for issue 43 against itself: it also stays readable."""
    recording = ROOT / "docs" / "cpu" / "amd-zen4" / "digits-step0-ops.safetensors"
    return ["opdiff", str(recording), str(recording)]


#: Commands run in the repository itself, read-only; they may answer 1 (something to do).
IN_REPOSITORY = (_checklist, _status)


@pytest.mark.parametrize(
    "command",
    [_prepare, _verify, _checklist, _compare, _status, _opdiff],
    ids=lambda c: c.__name__[1:],
)
def test_commands_that_build_no_model_import_no_lightning(tmp_path: Path, command) -> None:
    here = command in IN_REPOSITORY
    done = run_timed(*command(tmp_path), cwd=ROOT if here else tmp_path)
    assert done.returncode in ((0, 1) if here else (0,)), done.stderr[-2000:]
    assert heavy_imports(done.stderr) == []
    assert re.search(r"\|\s+reprotrain\.\w+", done.stderr)  # the log was read


def test_a_plain_loop_that_records_a_step_imports_no_lightning(tmp_path: Path) -> None:
    """docs/any-script.md's set-up in a plain PyTorch loop (configure_determinism, and
    record_step recording step 0) needs no Lightning. Control: the test below."""
    script = ROOT / "tests" / "scripts" / "fault_loop.py"
    env = cli_env(PYTHONHASHSEED="0", REPROTRAIN_RECORD_OPS="0", REPROTRAIN_OPS_DIR="ops")
    done = subprocess.run(
        [sys.executable, "-X", "importtime", script, "--out", tmp_path, "--fault", "none"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert list((tmp_path / "ops").glob("ops-rank0*.safetensors")), "no step was recorded"
    assert heavy_imports(done.stderr) == []
    assert re.search(r"\|\s+reprotrain\.ops\.recorder", done.stderr)  # the log was read


def test_a_planted_eager_import_is_named_with_the_chain_that_pulled_it_in(
    tmp_path: Path,
) -> None:
    """The control: the loaders' module imports Lightning at its top, and is named."""
    code = "import reprotrain.pipeline.data"
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code],
        cwd=tmp_path,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    chains = heavy_imports(done.stderr)
    assert "reprotrain.pipeline.data -> lightning" in chains, chains


@pytest.mark.parametrize("bad", [True, False], ids=["bad-data", "good-data-control"])
def test_the_env_stage_refuses_bad_raw_data_before_it_imports_lightning(
    tmp_path: Path, bad: bool
) -> None:
    """A bad raw file stops `dvc repro` in seconds; good data goes on to the recipe (control)."""
    (tmp_path / "raw").mkdir()
    x = np.full((30, 4, 4), np.nan if bad else 0.5, np.float32)
    np.savez(tmp_path / "raw" / "user.npz", x=x, y=np.arange(30) % 3)
    params = (ROOT / "params.yaml").read_text().replace("source: digits", "source: user.npz")
    (tmp_path / "params.yaml").write_text(params)
    lock = ROOT / "requirements-cpu.lock"
    done = run_timed("env", "--raw-dir", "raw", "--lock", lock, "--out", "e.json", cwd=tmp_path)
    if bad:
        assert done.returncode == 2 and "x contains NaN" in done.stderr, done.stderr[-2000:]
        assert heavy_imports(done.stderr) == [] and not (tmp_path / "e.json").exists()
    else:
        assert done.returncode == 0, done.stderr[-2000:]
        assert any(chain.endswith("lightning") for chain in heavy_imports(done.stderr))
