"""The device a measurement runs on (``ops``, ``bench``), and what its figures depend on.

A figure measured on one device, torch build or thread count says nothing
about another: :func:`device_facts` heads every report with them. Imports
torch; the commands import this module only when they run.
"""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any

import torch

from reprotrain.pipeline.errors import DataError


def pick_device(choice: str | None) -> torch.device:
    """``--device``: ``cuda`` or ``cpu``, default ``cuda`` when one is visible."""
    if choice == "cuda" and not torch.cuda.is_available():
        raise DataError("--device cuda: no CUDA device is visible here; use --device cpu")
    return torch.device(choice or ("cuda" if torch.cuda.is_available() else "cpu"))


def device_name(device: torch.device) -> str:
    """The GPU model, or the CPU model from /proc/cpuinfo (the machine's processor name)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def device_facts(device: torch.device) -> dict[str, Any]:
    """What a measurement on ``device`` depends on: model, torch / CUDA / cuDNN, threads."""
    return {
        "device": str(device),
        "device_name": device_name(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None,
        "threads": torch.get_num_threads(),
    }
