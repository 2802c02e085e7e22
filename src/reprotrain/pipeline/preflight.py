"""Checks of params and raw data that run first, before DVC touches any stage's outputs.

DVC deletes a stage's outputs just before it runs the stage's command, so a
bad value found inside ``train`` used to cost the workspace its model, trace
and reports (they stay in the DVC cache, but the workspace loses them). The
``env`` stage runs first: ``dvc.yaml`` marks it ``always_changed``, keeps its
record with ``persist: true`` (DVC never deletes it), and makes ``prepare``
(so everything after it) depend on that record. With ``--raw-dir`` the stage
calls :func:`preflight`, and any failure stops ``dvc repro`` there, with every
earlier output in place.

What it checks, each failure one line naming the key or file and what to do:
the whole of params.yaml (types, ranges, cross-field rules, via
:func:`reprotrain.pipeline.config.load_params`); the raw data
(:mod:`reprotrain.pipeline.rawdata`: inside ``data/raw``, readable, shapes,
dtypes, finite values, labels); that no split is empty; that the network and a
batch fit in this machine's memory (an estimate, see :func:`training_bytes`);
that a GPU is visible when ``train.accelerator: gpu`` asks for one; and that
the CPU has what ``cpu.profile: portable`` needs (AVX2, FMA).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from reprotrain.determinism import DeterminismError
from reprotrain.environment import cpu_facts
from reprotrain.pipeline.config import ModelConfig, Params
from reprotrain.pipeline.errors import DataError
from reprotrain.pipeline.rawdata import load_raw, split_sizes

GIB = 2**30
#: Bytes per parameter while training with Adam: weights, gradients, two moments (float32).
BYTES_PER_PARAMETER = 16
#: Activations kept for backward, per float of a forward activation (forward + grads + slack).
ACTIVATION_FACTOR = 3


def network_parameters(model: ModelConfig, shape: tuple[int, int, int], classes: int) -> int:
    """Parameter count of :func:`reprotrain.pipeline.model.build_network` for C x H x W input."""
    channels, height, width = shape
    c = model.channels
    flat = 2 * c * (height // 2) * (width // 2)
    convs = (channels * 9 + 1) * c + (c * 9 + 1) * 2 * c
    return convs + (flat + 1) * model.hidden + (model.hidden + 1) * classes


def training_bytes(params: Params, shape: tuple[int, int, int], classes: int) -> int:
    """A lower estimate of the memory one training step needs: state plus one batch."""
    _, height, width = shape
    c = params.model.channels
    per_sample = (3 * c * height * width + 2 * c * (height // 2) * (width // 2)) * 4
    batch = params.data.batch_size * per_sample * ACTIVATION_FACTOR
    return network_parameters(params.model, shape, classes) * BYTES_PER_PARAMETER + batch


def available_bytes() -> int | None:
    """Physical memory of this machine (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _gpu_bytes(gpus: list[dict[str, Any]]) -> int | None:
    memory = [g.get("memory", "") for g in gpus]
    sizes = [int(m.split()[0]) * 2**20 for m in memory if m.split() and m.split()[0].isdigit()]
    return min(sizes) if sizes else None


def preflight(
    params: Params,
    raw_dir: Path,
    gpus: list[dict[str, Any]],
    cpu_flags: Iterable[str] | None = None,
) -> str:
    """Refuse, with one line, what would fail later in the pipeline; return what was checked.

    ``gpus`` and ``cpu_flags`` as the environment record has them; ``cpu_flags``
    None: this machine's.
    """
    flags = set(cpu_facts()["dispatch_flags"] if cpu_flags is None else cpu_flags)
    if (missing := params.cpu.to_profile().missing_features(flags)) and (
        params.train.accelerator == "cpu"
    ):
        message = (
            f"cpu.profile: portable needs a CPU with {', '.join(missing)} (x86-64-v3), which this "
            "one lacks, so it cannot give the committed bits here; set cpu.profile: native"
        )
        if params.deterministic is True:
            raise DeterminismError(message)
        print(f"reprotrain: warning: {message}", file=sys.stderr)
    x, y, source = load_raw(params.data.source, raw_dir)
    sizes = split_sizes(len(y), params.data, source)
    shape = (int(x.shape[1]), int(x.shape[2]), int(x.shape[3]))
    classes = int(y.max()) + 1
    wants_gpu = params.train.accelerator == "gpu"
    if wants_gpu and not gpus:
        raise DataError(
            "train.accelerator: gpu, but no NVIDIA GPU is visible here (nvidia-smi finds none); "
            "set train.accelerator: cpu, or run on a GPU host (docker run --gpus all)"
        )
    need = training_bytes(params, shape, classes)
    have = _gpu_bytes(gpus) if wants_gpu else available_bytes()
    if have is not None and need > have:
        raise DataError(
            f"{source}: {shape[1]}x{shape[2]} images with model.channels="
            f"{params.model.channels}, model.hidden={params.model.hidden} and "
            f"data.batch_size={params.data.batch_size} need at least {need / GIB:.1f} GiB to "
            f"train, more than the {have / GIB:.1f} GiB here; lower those values or downscale "
            "the images"
        )
    return (
        f"checked params and {source} ({len(y)} samples, {shape[0]}x{shape[1]}x{shape[2]}, "
        f"{classes} classes, splits {sizes[0]}/{sizes[1]}/{sizes[2]}, about "
        f"{need / 2**20:.0f} MiB to train)"
    )
