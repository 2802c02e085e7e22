"""What the `env` stage adds to a `dvc repro`, measured side by side.

Makes two copies of this checkout in a temporary folder, runs the pipeline
once in each, then times no-op `dvc repro` runs, interleaved: copy A has the
`env` stage (always_changed, so it runs every time), copy B is identical but
without it (train still reads the same environment file, as a plain input).
The difference of the medians is the cost of capturing the environment on
every repro. Target: 1 s or less.

    .venv/bin/python benchmarks/overhead/env_capture.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # python benchmarks/<group>/<script>.py: import from the root

from tests.helpers import cli_env, copy_checkout


def _dvc_repro(repo: Path) -> float:
    start = time.perf_counter()
    subprocess.run(["dvc", "repro"], cwd=repo, env=cli_env(), check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    cli = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        with_env = copy_checkout(Path(tmp) / "with-env")
        without = copy_checkout(Path(tmp) / "without-env")
        _dvc_repro(with_env)
        spec = yaml.safe_load((without / "dvc.yaml").read_text())
        del spec["stages"]["env"]
        (without / "dvc.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
        (without / "reports/environment.json").write_bytes(
            (with_env / "reports/environment.json").read_bytes()
        )
        _dvc_repro(without)
        times: dict[str, list[float]] = {"with env stage": [], "without": []}
        for _ in range(cli.repeats):
            times["with env stage"].append(_dvc_repro(with_env))
            times["without"].append(_dvc_repro(without))
    med = {name: statistics.median(values) for name, values in times.items()}
    print(f"no-op `dvc repro`, {cli.repeats} interleaved runs each")
    for name, values in times.items():
        print(
            f"  {name:15s} median {med[name]:.3f} s  runs {', '.join(f'{v:.3f}' for v in values)}"
        )
    print(f"  env stage adds {med['with env stage'] - med['without']:.3f} s (target <= 1 s)")


if __name__ == "__main__":
    main()
