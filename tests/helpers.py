"""Helpers for tests that run the real `reprotrain` command in fresh processes."""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]


def built_once(basetemp: Path, worker_id: str, name: str, build: Callable[[Path], None]) -> Path:
    """``basetemp``'s run-wide folder ``name``, made by ``build`` once per pytest run.

    The first xdist worker to ask builds it in the run's shared temp folder
    (the parent of a worker's own) under a file lock; the others wait and get
    the same folder. ``build`` gets an absent path to create.
    """
    shared = basetemp if worker_id == "master" else basetemp.parent
    built = shared / name
    with (shared / f"{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (shared / f"{name}.done").exists():
            shutil.rmtree(built, ignore_errors=True)
            build(built)
            (shared / f"{name}.done").touch()
    return built


def cli_env(**extra: str) -> dict[str, str]:
    """The environment for a fresh `reprotrain` process: no inherited hash seed."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONHASHSEED", "CI")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["DVC_NO_ANALYTICS"] = "1"
    return {**env, **extra}


#: Seconds a command may run before the suite calls it hung (a whole pipeline on 2 busy
#: cores takes a few minutes at most).
HUNG_AFTER_S = 600


def run_process(cmd: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` in a session of its own; never raises on failure, fails a test on a hang.

    A command still running after :data:`HUNG_AFTER_S` is hung: every Python process
    it started (DDP ranks, DataLoader workers, dvc's stages) gets SIGABRT and, with
    ``PYTHONFAULTHANDLER`` set, prints every thread's stack, which the failure shows.
    """
    with subprocess.Popen(
        cmd, cwd=cwd, env={**env, "PYTHONFAULTHANDLER": "1"}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    ) as proc:  # fmt: skip
        try:
            stdout, stderr = proc.communicate(timeout=HUNG_AFTER_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(_stacks_of_hung(proc, " ".join(cmd))) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def _stacks_of_hung(proc: subprocess.Popen, command: str) -> str:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGABRT)
    time.sleep(5)  # each process writes its stacks, then aborts
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    stdout, stderr = proc.communicate()
    return (
        f"hung: still running after {HUNG_AFTER_S} s: {command}\nstdout:\n{stdout[-4000:]}\n"
        f"stderr, with every process's stacks at SIGABRT:\n{stderr[-30000:]}"
    )


def run_cli(*args: str | Path, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """Run `python -m reprotrain ARGS` in a fresh process (:func:`run_process`)."""
    return run_process([sys.executable, "-m", "reprotrain", *map(str, args)], cwd, cli_env(**env))


#: The files one training writes into a run folder (train_argv), compared byte for byte.
RUN_OUTPUTS = (
    "model.safetensors",
    "trace.safetensors",
    "metrics.json",
    "run.json",
    "plots/train_loss.csv",
    "plots/val.csv",
)


#: What a project's train stage writes (examples/tabular's dvc.yaml), compared byte for byte.
PROJECT_TRAIN_OUTPUTS = (
    "models/model.safetensors",
    "models/trace.safetensors",
    "reports/train_metrics.json",
    "reports/plots/train/train_loss.csv",
    "reports/plots/train/val.csv",
)
#: The train stage's output options and the file each writes in a flat run folder (RUN_OUTPUTS).
RUN_FOLDER = {
    "--model": "model.safetensors",
    "--metrics": "metrics.json",
    "--plots": "plots",
    "--trace": "trace.safetensors",
    "--run-record": "run.json",
    "--checkpoints": "ckpt",
}


def project_train_argv(repo: Path, out: Path | None, *overrides: str) -> list[str]:
    """A project's train stage command as its dvc.yaml has it; with ``out``, writing a flat
    run folder (:data:`RUN_FOLDER`)."""
    argv = stage_argv(repo, "train")
    if out is not None:
        for option, name in RUN_FOLDER.items():
            argv[argv.index(option) + 1] = str(out / name)
    return [*argv, *overrides]


def ranks(world: int) -> tuple[str, ...]:
    """The ``-S`` overrides for ``world`` processes on this machine (DDP above one)."""
    strategy = "ddp" if world > 1 else "single_device"
    return ("-S", f"train.devices={world}", "-S", f"train.strategy={strategy}")


def injected(**variables: str) -> dict[str, str]:
    """``variables`` with tests/inject first on PYTHONPATH (its sitecustomize reads them)."""
    path = [str(ROOT / "tests" / "inject"), os.environ.get("PYTHONPATH")]
    return {"PYTHONPATH": os.pathsep.join(filter(None, path)), **variables}


def edit_once(path: Path, old: str, new: str) -> None:
    """Replace the one occurrence of ``old`` in ``path``."""
    text = path.read_text()
    assert text.count(old) == 1, (path, old)
    path.write_text(text.replace(old, new))


def train_argv(prepared: Path, env: Path, out: Path, *overrides: str) -> list[str]:
    """`reprotrain train` arguments writing a flat run folder ``out`` (as verify's runs)."""
    return [
        "train",
        *("--params", str(ROOT / "params.yaml"), "-S", f"data.init_args.path={prepared}"),
        *overrides,
        *("--data", str(prepared), "--env", str(env), "--checkpoints", str(out / "ckpt")),
        *("--model", str(out / "model.safetensors"), "--trace", str(out / "trace.safetensors")),
        *("--metrics", str(out / "metrics.json"), "--plots", str(out / "plots")),
        *("--run-record", str(out / "run.json")),
    ]


def verify_training(prepared: Path, env: Path, workdir: Path, *overrides: str) -> dict[str, Any]:
    """`reprotrain verify --json -- reprotrain train ... --evidence`: two fresh trainings.

    Needs no DVC and no locked environment, so it runs on a lent GPU host (its
    own torch, no DVC): the drift from the lock is recorded, not refused.
    """
    train = train_argv(prepared, env, Path("{out}"), *overrides)
    outputs = [arg for name in RUN_OUTPUTS for arg in ("--output", name)]
    done = run_cli(
        "verify", "--json", "--workdir", workdir, *outputs, "--",
        sys.executable, "-m", "reprotrain", *train, "--evidence", cwd=workdir.parent,
    )  # fmt: skip
    assert done.returncode in (0, 1), done.stdout + done.stderr
    return json.loads(done.stdout)


def run_in_process(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """`reprotrain ARGS` in this process: fast (no interpreter start, no torch import).

    Paths must be absolute. For error paths; the end-to-end tests use run_cli.
    """
    from reprotrain.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def run_checked(*cmd: str | Path, cwd: Path, **env: str) -> str:
    """Run a command (dvc, git, reprotrain...) in a fresh process; fail the test if it fails."""
    result = run_process([str(c) for c in cmd], cwd, cli_env(**env))
    assert result.returncode == 0, f"{' '.join(map(str, cmd))}\n{result.stdout}\n{result.stderr}"
    return result.stdout + result.stderr


def copy_checkout(dest: Path) -> Path:
    """A fresh git repository holding this checkout's files (tracked or not, never ignored)."""
    listed = run_checked("git", "ls-files", "-z", "-co", "--exclude-standard", cwd=ROOT)
    for name in filter(None, listed.split("\0")):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    run_checked("git", "init", "-q", cwd=dest)
    commit_all(dest, "copy of the checkout")
    return dest


def commit_all(repo: Path, message: str) -> None:
    run_checked("git", "add", "-A", cwd=repo)
    run_checked(
        "git",
        "-c",
        "user.name=t",
        "-c",
        "user.email=t@t",
        "commit",
        "--allow-empty",
        "-qm",
        message,
        cwd=repo,
    )


def stage_argv(repo: Path, stage: str) -> list[str]:
    """The `reprotrain` arguments of a stage, as `dvc.yaml` in ``repo`` writes them."""
    import shlex

    import yaml

    cmd = yaml.safe_load((repo / "dvc.yaml").read_text())["stages"][stage]["cmd"]
    return shlex.split(cmd)[1:]


def cmdline(process: psutil.Process) -> str:
    """The command line, or "" for a process that is gone or a zombie."""
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


def kill_tree(roots) -> None:
    """SIGKILL each process and all its descendants (DataLoader workers included)."""
    victims = []
    for root in roots:
        with contextlib.suppress(psutil.Error):
            victims += [root, *root.children(recursive=True)]
    for victim in victims:
        with contextlib.suppress(psutil.Error):
            victim.kill()


def start_cli(argv: list[str], cwd: Path, **popen: Any) -> subprocess.Popen:
    """`python -m reprotrain ARGV` started in a fresh process (as :func:`run_cli` runs it)."""
    return subprocess.Popen(
        [sys.executable, "-m", "reprotrain", *argv], cwd=cwd, env=cli_env(), **popen
    )


def kill_after_checkpoint(argv: list[str], ckpt_root: Path, min_epoch: int, cwd: Path) -> None:
    """Start `reprotrain train`, SIGKILL it at a random moment after epoch `min_epoch` is saved."""
    proc = start_cli(argv, cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for_checkpoint(proc, ckpt_root, min_epoch)
    time.sleep(random.uniform(0, 0.2))  # inside the next epoch, well before the end
    kill_tree([psutil.Process(proc.pid)])
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"


def signal_after_checkpoint(
    argv: list[str], cwd: Path, signum: int, to_group: bool = False
) -> tuple[int, str]:
    """Start `reprotrain train`, send ``signum`` once ``cwd/ckpt`` holds epoch 0's checkpoint.

    ``to_group``: to its whole process group (ranks and DataLoader workers), as a
    cluster preempting a job does. Returns the exit code and stderr.
    """
    proc = start_cli(
        argv, cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=to_group,
    )  # fmt: skip
    wait_for_checkpoint(proc, cwd / "ckpt", 0)
    # Past epoch 0's last hooks: a signal that lands between its checkpoint and the end of
    # the epoch stops the run at the epoch's end, with epoch=0.ckpt as the newest (seen in a
    # CI run on a busy host), which is right but not the checkpoint at the signal tested here.
    time.sleep(0.05)
    if to_group:
        os.killpg(proc.pid, signum)
    else:
        proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=180)
    return proc.returncode, stderr


#: A value for :func:`params_with` that removes the key.
DELETE = object()


def params_with(changes: dict[str, object]) -> dict:
    """The default params as a YAML-ready dict, with dotted ``changes`` applied as given."""
    import yaml

    from reprotrain.pipeline.params_file import render_defaults

    raw = yaml.safe_load(render_defaults())
    for key, value in changes.items():
        *parents, leaf = key.split(".")
        node = raw
        for part in parents:
            node = node[part]
        if value is DELETE:
            del node[leaf]
        else:
            node[leaf] = value
    return raw


def wait_for_checkpoint(proc: subprocess.Popen, ckpt_root: Path, min_epoch: int) -> None:
    """Block until ``proc`` has written a verified checkpoint of epoch ``min_epoch`` or later."""
    from reprotrain.resume import sidecar  # Lightning: only for the tests that need it

    deadline = time.monotonic() + 300
    while True:
        assert time.monotonic() < deadline, "no checkpoint within 300 s"
        assert proc.poll() is None, "the run finished before its checkpoint was seen"
        done = [
            int(re.findall(r"\d+", p.stem)[0])
            for p in ckpt_root.glob("*/epoch=*.ckpt")
            if sidecar(p).is_file()
        ]
        if done and max(done) >= min_epoch:
            return
        time.sleep(0.02)
