"""The recipes a benchmark trains, by ``--workload`` name, and the CPU's name (standard library
only: gpu_evidence reads it on a bare GPU host before anything else loads)."""

import platform
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

WORKLOADS = {"lm": ROOT / "pipelines" / "lm" / "params.yaml", "digits": ROOT / "params.yaml"}


def cpu_model() -> str:
    """The CPU's model name, as ``/proc/cpuinfo`` gives it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
