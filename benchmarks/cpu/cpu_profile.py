"""Cost of ``cpu.profile: portable`` against ``native`` on this CPU, side by side in one run.

Each round runs, for both profiles one after the other (in alternating order),
``reprotrain bench --device cpu`` (median step time of the default model, the
``pipeline`` workload, and of the larger ``conv`` workload, deterministic mode)
and times a whole ``reprotrain train`` stage (the workload's params, in a
scratch folder; process start and the ~7 s torch import included). Prints
each figure per profile and the ratio portable / native (median over rounds).
Run from the repository root after ``make venv``::

    .venv/bin/python benchmarks/cpu/cpu_profile.py [--rounds 3] [--workload lm|digits]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # python benchmarks/<group>/<script>.py: import from the root

from benchmarks._common.workspace import WORKLOADS, add_workload_argument

BIN = Path(sys.executable).parent
PROFILES = ("portable", "native")


def bench(profile: str, params: Path) -> dict[str, float]:
    done = subprocess.run(
        [
            *(BIN / "reprotrain", "bench", "--device", "cpu", "--json", "--repeats", "3"),
            *("--params", params, "-S", f"cpu.profile={profile}"),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    workloads = json.loads(done.stdout)["workloads"]
    return {
        f"{name} step (s)": w["modes"]["deterministic"]["median_step_s"]
        for name, w in workloads.items()
    }


def train(profile: str, work: Path, params: Path) -> float:
    out = work / profile
    shutil.rmtree(out, ignore_errors=True)
    argv = [
        BIN / "reprotrain",
        "train",
        "--params",
        params,
        "-S",
        f"cpu.profile={profile}",
    ]
    if (work / "data.safetensors").exists():  # a recipe with a prepare step
        argv += ["-S", f"data.init_args.path={work / 'data.safetensors'}"]
        argv += ["--data", work / "data.safetensors"]
    argv += [
        "--env",
        work / "env.json",
        "--checkpoints",
        out / "ck",
    ]
    argv += [
        "--model",
        out / "m.safetensors",
        "--metrics",
        out / "m.json",
        "--plots",
        out / "plots",
    ]
    argv += ["--run-record", out / "run.json"]
    start = time.perf_counter()
    subprocess.run(argv, capture_output=True, check=True, cwd=work)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    add_workload_argument(parser)
    args = parser.parse_args()
    params = WORKLOADS[args.workload]
    work = Path(tempfile.mkdtemp(prefix="reprotrain-cpu-profile-"))
    try:
        shutil.copy(params, work / "params.yaml")
        if args.workload == "digits":  # the one recipe with a prepare step
            subprocess.run(
                [
                    *(BIN / "reprotrain", "prepare", "--raw-dir", work),
                    *("--out", work / "data.safetensors"),
                ],
                cwd=work,
                check=True,
                capture_output=True,
            )
        subprocess.run(
            [
                BIN / "reprotrain",
                "env",
                "--lock",
                ROOT / "requirements-cpu.lock",
                "--out",
                work / "env.json",
            ],
            cwd=work,
            check=True,
            capture_output=True,
        )
        rows: dict[str, dict[str, list[float]]] = {p: {} for p in PROFILES}
        for round_ in range(args.rounds):
            for profile in PROFILES if round_ % 2 == 0 else PROFILES[::-1]:
                figures = {
                    **bench(profile, params),
                    "train stage (s)": train(profile, work, params),
                }
                for name, value in figures.items():
                    rows[profile].setdefault(name, []).append(value)
        cpu = next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            "?",
        )
        print(f"CPU: {cpu}; {args.workload}; {args.rounds} rounds; medians; ratio portable/native")
        print(f"{'':22} {'portable':>10} {'native':>10} {'ratio':>7}")
        for name in rows["portable"]:
            a, b = (statistics.median(rows[p][name]) for p in PROFILES)
            print(f"{name:22} {a:10.4f} {b:10.4f} {a / b:7.2f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
