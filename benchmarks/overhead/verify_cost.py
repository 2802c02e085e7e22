"""What `reprotrain verify` costs against one training run, measured side by side.

Copies this checkout into a temporary folder, prepares the data there, then
alternates: the train stage's own command (as `dvc.yaml` writes it) once,
and `reprotrain verify` (two fresh training processes plus the comparison).
Prints the medians and their ratio. Target: 2.2 or less.

    .venv/bin/python benchmarks/overhead/verify_cost.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # python benchmarks/<group>/<script>.py: import from the root

from tests.helpers import cli_env, copy_checkout, stage_argv


def _timed(argv: list[str], repo: Path) -> float:
    start = time.perf_counter()
    subprocess.run(argv, cwd=repo, env=cli_env(), check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    cli = parser.parse_args()
    reprotrain = [sys.executable, "-m", "reprotrain"]
    with tempfile.TemporaryDirectory() as tmp:
        repo = copy_checkout(Path(tmp) / "repo")
        subprocess.run(["dvc", "repro", "train"], cwd=repo, env=cli_env(), check=True)
        commands = {
            "one training run": [*reprotrain, *stage_argv(repo, "train")],
            "verify (2 runs)": [*reprotrain, "verify", "--runs", "2"],
        }
        times: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(cli.repeats):
            for name, argv in commands.items():
                times[name].append(_timed(argv, repo))
    med = {name: statistics.median(values) for name, values in times.items()}
    print(f"{cli.repeats} interleaved runs each, fresh processes")
    for name, values in times.items():
        runs = ", ".join(f"{v:.2f}" for v in values)
        print(f"  {name:17s} median {med[name]:6.2f} s  runs {runs}")
    ratio = med["verify (2 runs)"] / med["one training run"]
    print(f"  verify / one run = {ratio:.2f} (target <= 2.2)")


if __name__ == "__main__":
    main()
