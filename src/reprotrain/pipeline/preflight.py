"""Checks of params and raw data that run first, before DVC touches any stage's outputs.

DVC deletes a stage's outputs just before it runs the stage's command, so a
bad value found inside ``train`` used to cost the workspace its model, trace
and reports (they stay in the DVC cache, but the workspace loses them). The
``env`` stage runs first: ``dvc.yaml`` marks it ``always_changed``, keeps its
record with ``persist: true`` (DVC never deletes it), and makes ``prepare``
(so everything after it) depend on that record. With ``--raw-dir`` the stage
calls :func:`preflight`, and any failure stops ``dvc repro`` there, with every
earlier output in place. The raw data is checked before the model and data
module are imported (:func:`check_raw_data`: no Lightning import stands between
a bad file and its one line), the estimates after (:func:`preflight`).

What it checks, each failure one line naming the key or file and what to do:
the whole of params.yaml (types, ranges, cross-field rules, via
:func:`reprotrain.pipeline.params_file.load_params`; the model and data module it
names, imported, type-checked and held to the contract, via
:mod:`reprotrain.pipeline.recipe` and :mod:`reprotrain.pipeline.contract`,
which the env stage runs first); with a ``prepare`` section, the raw data
(:mod:`reprotrain.pipeline.rawdata`: inside ``data/raw``, readable, shapes,
dtypes, finite values, labels); that no split is empty; that the network and a
batch fit in this machine's memory (an estimate, see :func:`training_bytes`);
that a GPU is visible when ``train.accelerator: gpu`` asks for one; that
the CPU has what ``cpu.profile: portable`` needs (AVX2, FMA); and, given the
later stages' outputs (:class:`PlannedOutputs`, from ``dvc.yaml``), that their
folders take a file (a real write, so a read-only mount is caught for root
too) and have room for them (:func:`output_bytes`, an upper estimate).
"""

from __future__ import annotations

import errno
import math
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reprotrain.pipeline.config import DEFAULT_MODEL, Params
from reprotrain.pipeline.errors import DataError
from reprotrain.pipeline.rawdata import load_raw, split_sizes

GIB = 2**30
#: Bytes per parameter while training with Adam: weights, gradients, two moments (float32).
BYTES_PER_PARAMETER = 16
#: Activations kept for backward, per float of a forward activation (forward + grads + slack).
ACTIVATION_FACTOR = 3
#: Upper bounds used by :func:`output_bytes`: a safetensors header or a small report; one
#: trace row (12 int64/float64 columns, ``trace.TraceCallback``) and, under ``full``, per
#: parameter tensor; a checkpoint holds weights and Adam's two moments, plus the trace.
FILE_OVERHEAD = 64 * 2**10
TRACE_ROW_BYTES = 12 * 8
TRACE_TENSOR_BYTES = 8
PARAMETER_TENSORS = 8
CHECKPOINT_COPIES = 3


@dataclass(frozen=True)
class PlannedOutputs:
    """Where the later stages write (their ``dvc.yaml`` arguments), for the space check."""

    dataset: Path
    model: Path
    trace: Path
    checkpoints: Path
    reports: tuple[Path, ...]


@dataclass(frozen=True)
class RawData:
    """What the checks read from the prepare stage's raw data (:func:`check_raw_data`)."""

    source: str
    samples: int
    #: One sample's channels x height x width.
    shape: tuple[int, int, int]
    classes: int
    #: The train / validation / test split sizes.
    splits: tuple[int, int, int]


def check_raw_data(params: Params, raw_dir: Path) -> RawData:
    """The prepare stage's raw data, checked (one line on a failure); needs no recipe."""
    if params.prepare is None:
        raise DataError(
            "params has no prepare section, but --raw-dir asks to check raw data for the "
            "prepare stage; add the section (`reprotrain params --defaults` prints it) or drop "
            "--raw-dir"
        )
    x, y, source = load_raw(params.prepare.source, raw_dir)
    splits = split_sizes(len(y), params.prepare, source)
    shape = (int(x.shape[1]), int(x.shape[2]), int(x.shape[3]))
    return RawData(source, len(y), shape, int(y.max()) + 1, splits)


@dataclass(frozen=True)
class Sizes:
    """What the estimates need from the resolved model and data arguments."""

    #: ``data.init_args.batch_size``; 1 (the largest trace) where the data module has none.
    batch_size: int
    #: The digits CNN's channels and hidden width; None for any other module.
    cnn: tuple[int, int] | None

    @classmethod
    def of(cls, recipe: Any) -> Sizes:
        """From a resolved :class:`~reprotrain.pipeline.recipe.Recipe`."""
        model = recipe.model
        cnn = None
        if model.class_path == DEFAULT_MODEL.class_path:
            cnn = (int(model.init_args["channels"]), int(model.init_args["hidden"]))
        source = recipe.components[0]  # the data module, else the model giving the data
        batch_size = source.init_args.get("batch_size")  # else the loader's: unknown here
        return cls(batch_size if type(batch_size) is int and batch_size > 0 else 1, cnn)


def network_parameters(cnn: tuple[int, int], shape: tuple[int, int, int], classes: int) -> int:
    """Parameter count of :func:`reprotrain.recipes.digits.build_network` for C x H x W input."""
    channels, height, width = shape
    c, hidden = cnn
    flat = 2 * c * (height // 2) * (width // 2)
    convs = (channels * 9 + 1) * c + (c * 9 + 1) * 2 * c
    return convs + (flat + 1) * hidden + (hidden + 1) * classes


def training_bytes(sizes: Sizes, shape: tuple[int, int, int], classes: int) -> int:
    """A lower estimate of the memory one training step needs: state plus one batch (0 when
    the module is not the digits CNN, whose size this knows)."""
    if sizes.cnn is None:
        return 0
    _, height, width = shape
    c = sizes.cnn[0]
    per_sample = (3 * c * height * width + 2 * c * (height // 2) * (width // 2)) * 4
    batch = sizes.batch_size * per_sample * ACTIVATION_FACTOR
    return network_parameters(sizes.cnn, shape, classes) * BYTES_PER_PARAMETER + batch


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


def output_bytes(
    params: Params,
    model: Sizes,
    sizes: tuple[int, int, int],
    shape: tuple[int, int, int],
    classes: int,
    planned: PlannedOutputs,
) -> dict[Path, int]:
    """An upper estimate of the bytes each planned output takes (checkpoints: the folder)."""
    weights = network_parameters(model.cnn, shape, classes) * 4 if model.cnn else 0
    steps = math.ceil(sizes[0] / model.batch_size) * params.train.max_epochs
    row = TRACE_ROW_BYTES + (
        PARAMETER_TENSORS * TRACE_TENSOR_BYTES if params.train.trace == "full" else 0
    )
    trace = steps * row + FILE_OVERHEAD
    return {
        planned.dataset: sum(sizes) * (math.prod(shape) * 4 + 8) + FILE_OVERHEAD,
        planned.model: weights + FILE_OVERHEAD,
        planned.trace: trace,
        planned.checkpoints: 2 * (CHECKPOINT_COPIES * weights + trace + FILE_OVERHEAD),
        **{report: FILE_OVERHEAD for report in planned.reports},
    }


def check_outputs(needs: Mapping[Path, int]) -> None:
    """Refuse, with one line, an output folder that takes no file or lacks room for ``needs``.

    Each output is checked in its nearest existing folder (what the stage's
    ``mkdir`` will create lies below it); space is summed per file system.
    """
    by_folder: dict[Path, list[tuple[Path, int]]] = {}
    for path, size in needs.items():
        folder = path if path.is_dir() else path.parent
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent
        if not folder.is_dir():
            raise DataError(
                f"{folder}: a file where a folder must be, for {path}; move the file away, or "
                "point the stage's path in dvc.yaml elsewhere"
            )
        by_folder.setdefault(folder, []).append((path, size))
    by_device: dict[int, list[Path]] = {}
    for folder, outputs in by_folder.items():
        names = ", ".join(str(p) for p, _ in outputs)
        try:
            fd, probe = tempfile.mkstemp(prefix=".reprotrain-write-check-", dir=folder)
            os.close(fd)
            Path(probe).unlink()
        except OSError as err:
            if err.errno not in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC):
                raise
            raise DataError(
                f"{folder}/: cannot write there ({err.strerror}), where {names} go; make the "
                "folder writable and free, or point the stage's path in dvc.yaml elsewhere"
            ) from None
        by_device.setdefault(folder.stat().st_dev, []).append(folder)
    for folders in by_device.values():
        stats = os.statvfs(folders[0])
        free = stats.f_bavail * stats.f_frsize
        need = sum(size for folder in folders for _, size in by_folder[folder])
        if need > free:
            where = ", ".join(f"{folder}/" for folder in folders)
            raise DataError(
                f"{where}: {free / 2**20:.1f} MiB free, but the pipeline's outputs there need "
                f"about {need / 2**20:.1f} MiB; free disk space there (or point the stage's "
                "paths in dvc.yaml at another disk) and rerun"
            )


def check_accelerator(params: Params) -> None:
    """Refuse ``train.accelerator: gpu`` where torch sees no CUDA device.

    The env stage checks the same with nvidia-smi under ``dvc repro``; a stage
    command run on its own (or a torch without CUDA) meets this one instead of
    Lightning's traceback. Asks torch only for ``gpu``: a CPU run never touches CUDA.
    """
    if params.train.accelerator != "gpu":
        return
    import torch

    if torch.cuda.device_count() < 1:
        build = torch.version.cuda or "none, a CPU-only torch"
        raise DataError(
            f"train.accelerator: gpu, but torch finds no CUDA device here (its CUDA build: "
            f"{build}); set train.accelerator: cpu (-S train.accelerator=cpu), or run on a "
            "GPU host (docker run --gpus all)"
        )


def preflight(
    params: Params,
    model: Sizes,
    raw: RawData,
    gpus: list[dict[str, Any]],
    planned: PlannedOutputs | None = None,
) -> str:
    """Refuse, with one line, what would fail later in the pipeline; return what was checked.

    ``raw`` from :func:`check_raw_data`; ``gpus`` as the environment record has them.
    With ``planned``, also the outputs' folders (writable, room). The CPU's features are
    the env stage's own first check (:func:`reprotrain.pipeline.stages.env.check_cpu`).
    """
    source, shape, classes, sizes = raw.source, raw.shape, raw.classes, raw.splits
    wants_gpu = params.train.accelerator == "gpu"
    if wants_gpu and not gpus:
        raise DataError(
            "train.accelerator: gpu, but no NVIDIA GPU is visible here (nvidia-smi finds none); "
            "set train.accelerator: cpu, or run on a GPU host (docker run --gpus all)"
        )
    need = training_bytes(model, shape, classes)
    have = _gpu_bytes(gpus) if wants_gpu else available_bytes()
    if have is not None and need > have:
        channels, hidden = model.cnn  # type: ignore[misc]  # need > 0: the digits CNN
        raise DataError(
            f"{source}: {shape[1]}x{shape[2]} images with model.init_args.channels="
            f"{channels}, model.init_args.hidden={hidden} and "
            f"data.init_args.batch_size={model.batch_size} need at least {need / GIB:.1f} GiB to "
            f"train, more than the {have / GIB:.1f} GiB here; lower those values or downscale "
            "the images"
        )
    if planned is not None:
        check_outputs(output_bytes(params, model, sizes, shape, classes, planned))
    estimate = f", about {need / 2**20:.0f} MiB to train" if model.cnn else ""
    return (
        f"checked the prepare stage's raw data, {source} ({raw.samples} samples, "
        f"{shape[0]}x{shape[1]}x{shape[2]}, {classes} classes, splits "
        f"{sizes[0]}/{sizes[1]}/{sizes[2]}{estimate})"
    )
