"""The recipes a benchmark trains, by ``--workload`` name (no imports: gpu_evidence reads it
on a bare GPU host before anything else loads)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

WORKLOADS = {"lm": ROOT / "pipelines" / "lm" / "params.yaml", "digits": ROOT / "params.yaml"}
