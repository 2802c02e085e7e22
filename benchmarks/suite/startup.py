"""Each command's start-up: wall time of a real run, and how much of it is Lightning.

Every command runs for real in fresh processes, interleaved over ``--repeats``
rounds (median reported): ``prepare`` (the digits, in a temporary folder),
``checklist`` (this repository), ``verify -- CMD`` on a script that writes one
file (two runs of it, so the figure is the parent's start-up plus two Python
starts), and ``train``'s imports (``reprotrain.pipeline.training``: everything
a training process loads before it builds a model). Beside each, from one
``python -X importtime`` run: the seconds spent importing Lightning (with
torchmetrics) and torch. ``prepare (before)`` is the same prepare with the
loaders' module imported first, as the stage did until it read the prepared
file through :mod:`reprotrain.pipeline.prepared`: the ratio is this change's.
``plain loop's set-up`` is what a plain PyTorch script that records its steps
adds (``configure_determinism`` and ``record_step``); ``(before)`` imports
Lightning first, as both did until they stopped needing it.

    .venv/bin/python benchmarks/suite/startup.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CLI = "from reprotrain.cli import main; import sys; sys.exit(main(sys.argv[1:]))"
#: What a plain PyTorch script adds to record its steps (docs/any-script.md): the recorder
#: and configure_determinism. Before, both imported Lightning (the seeding, the callback).
PLAIN = (
    "from reprotrain.determinism import configure_determinism; "
    "from reprotrain.ops.recorder import record_step; configure_determinism(0, True)"
)


def commands(work: Path) -> dict[str, tuple[list[str], Path]]:
    """name -> (python arguments after the interpreter, working folder)."""
    (work / "raw").mkdir(exist_ok=True)
    shutil.copy(ROOT / "params.yaml", work / "params.yaml")
    (work / "w.py").write_text("import sys, pathlib\npathlib.Path(sys.argv[1], 'o').touch()\n")
    prepare = ["prepare", "--raw-dir", "raw", "--out", "data.safetensors"]
    before = "import reprotrain.pipeline.data; " + CLI
    return {
        "prepare": (["-c", CLI, *prepare], work),
        "prepare (before)": (["-c", before, *prepare], work),
        "checklist": (["-c", CLI, "checklist"], ROOT),
        "verify -- CMD (2 runs)": (
            ["-c", CLI, "verify", "--", sys.executable, "w.py", "{out}"],
            work,
        ),
        "train's imports": (["-c", "import reprotrain.pipeline.training"], work),
        "plain loop's set-up": (["-c", PLAIN], work),
        "plain loop's set-up (before)": (["-c", "import lightning.pytorch; " + PLAIN], work),
    }


def run(args: list[str], cwd: Path, *extra: str) -> tuple[float, str]:
    env = {**os.environ, "PYTHONHASHSEED": "0", "PYTHONPATH": str(ROOT / "src")}
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, *extra, *args], cwd=cwd, env=env, capture_output=True, text=True
    )
    seconds = time.perf_counter() - start
    if done.returncode not in (0, 1):  # checklist: 1 when an item fails here
        raise SystemExit(f"startup: {args[:3]} failed: {done.stderr[-500:]}")
    return seconds, done.stderr


def package_seconds(log: str, package: str) -> float:
    """Cumulative import seconds of ``package``'s outermost imports in an importtime log."""
    total = 0.0
    for line in log.splitlines():
        if line.startswith("import time:") and line.count("|") == 2:
            _, cumulative, name = line.split("|")
            if name.strip() == package:
                total += int(cumulative) / 1e6
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cases = commands(Path(tmp))
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.repeats):
            for name, (argv, cwd) in cases.items():
                times[name].append(run(argv, cwd)[0])
        logs = {name: run(argv, cwd, "-X", "importtime")[1] for name, (argv, cwd) in cases.items()}
    print(f"start-up, median of {args.repeats} interleaved fresh processes")
    print(f"  {'command':30s} {'wall s':>7s} {'Lightning s':>12s} {'torch s':>8s}")
    for name, values in times.items():
        light = sum(package_seconds(logs[name], p) for p in ("lightning", "torchmetrics"))
        print(
            f"  {name:30s} {statistics.median(values):7.2f} {light:12.2f}"
            f" {package_seconds(logs[name], 'torch'):8.2f}"
        )
    for name in ("prepare", "plain loop's set-up"):
        ratio = statistics.median(times[name]) / statistics.median(times[f"{name} (before)"])
        print(f"{name} now / before: {ratio:.2f}")


if __name__ == "__main__":
    main()
