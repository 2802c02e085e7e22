"""The frozen, typed config objects ``params.yaml`` is parsed into, once.

Every field's default, type, allowed range and meaning live here and nowhere
else; :mod:`reprotrain.pipeline.params_file` reads a file into them (strictly:
an unknown key, a missing key, a wrong type or an out-of-range value is one
:class:`ConfigError` naming the key) and writes the defaults back out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from reprotrain.cpu.profile import PROFILES, CpuProfile
from reprotrain.determinism import Mode


class ConfigError(ValueError):
    """A params file or override is invalid; the message names the key."""


def _spec(default: Any, help: str, **rules: Any) -> Any:
    return field(default=default, metadata={"help": help, **rules})


@dataclass(frozen=True)
class PrepareConfig:
    """The built-in preparation (stage ``prepare``): raw data -> one prepared tensor file."""

    source: str = _spec(
        "digits",
        "'digits' (scikit-learn's bundled 8x8 digits) or the name of an .npz file "
        "with arrays x and y in the raw-data folder (data/raw)",
    )
    val_fraction: float = _spec(0.15, "share of samples held out for validation", gt=0, lt=1)
    test_fraction: float = _spec(0.15, "share of samples held out for the test set", gt=0, lt=1)


@dataclass(frozen=True)
class Component:
    """A class named as LightningCLI names it: ``{class_path, init_args}``, plus ``code``.

    Only the shape is checked here (no import): :mod:`reprotrain.pipeline.recipe`
    imports the class and type-checks ``init_args`` against its ``__init__``.
    ``code`` lists more files or folders (relative to the repository root) whose
    bytes decide what the class computes, beside its package's source.
    """

    class_path: str
    init_args: dict[str, Any] = field(default_factory=dict)
    code: tuple[str, ...] = ()


#: The digits recipe (:mod:`reprotrain.recipes.digits`), the default in ``params.yaml``.
DEFAULT_MODEL = Component(
    "reprotrain.recipes.digits.Classifier",
    {
        "channels": 16,
        "hidden": 64,
        "dropout": 0.25,
        "optimizer": "adam",
        "lr": 0.005,
        "weight_decay": 0.0,
    },
)
DEFAULT_DATA = Component(
    "reprotrain.recipes.digits.DigitsData",
    {
        "path": "data/prepared/dataset.safetensors",
        "batch_size": 64,
        "num_workers": 2,
        "augment": True,
    },
)
COMPONENT_HELP = {
    "model": "the LightningModule: class_path and init_args, as in a LightningCLI config "
    "(docs/your-model.md)",
    "data": "the LightningDataModule: class_path and init_args (batch_size among them where "
    "it gives datasets), as in a LightningCLI config; null (or left out) for a model that "
    "defines its own *_dataloader() methods",
}


@dataclass(frozen=True)
class TrainConfig:
    max_epochs: int = _spec(10, "training epochs", ge=1, le=100000)
    checkpoint_every_n_epochs: int = _spec(
        5, "epochs between resumable checkpoints (no effect on the result)", ge=1, le=100000
    )
    trace: str = _spec(
        "default",
        "per-step trace next to the model (no effect on the result): 'default' fingerprints "
        "weights every 32nd step, 'full' every step and per tensor",
        choices=("default", "full"),
    )
    accelerator: str = _spec("cpu", "where to train; never 'auto'", choices=("cpu", "gpu"))
    devices: int = _spec(
        1, "devices (processes on cpu) per node; more than 1 needs strategy: ddp", ge=1, le=1024
    )
    num_nodes: int = _spec(
        1, "machines; world size = devices x num_nodes; more than 1 needs ddp", ge=1, le=4096
    )
    strategy: str = _spec(
        "single_device",
        "'single_device': one process; 'ddp': one process per device, gloo on cpu, NCCL on gpu "
        "(reproducible for a fixed world size)",
        choices=("single_device", "ddp"),
    )
    precision: str = _spec(
        "32-true",
        "Lightning precision",
        choices=("32-true", "64-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true"),
    )
    world_size_invariant: bool = _spec(
        False,
        "true: the same bits at any world size (1, 2, 4...: a power of two dividing "
        "data.init_args.batch_size / micro_batch_size), via micro-batches added in a fixed "
        "tree; the world size then leaves the run ID (docs/world-size-invariance.md)",
    )
    micro_batch_size: int = _spec(
        16,
        "samples per micro-batch under world_size_invariant (must divide "
        "data.init_args.batch_size); unused otherwise",
        ge=1,
        le=65536,
    )

    def process_layout(self) -> dict[str, Any]:
        """The part of the process layout that decides the bits (in the environment record)."""
        if self.world_size_invariant:
            return {"world_size_invariant": True}
        return {"strategy": self.strategy, "devices": self.devices, "num_nodes": self.num_nodes}


@dataclass(frozen=True)
class CpuConfig:
    profile: str = _spec(
        "portable",
        "CPU kernels: 'portable' pins them (AVX2 ATen, the project's OpenBLAS GEMM, no oneDNN) "
        "so every x86-64 CPU with AVX2 gives the same bits; 'native' uses the host's fastest, "
        "and its instruction set then decides the bits (docs/cpu-profile.md)",
        choices=PROFILES,
    )
    threads: int = _spec(
        1,
        "threads per process: under 'native' ATen's (the split of a reduction follows them), "
        "under 'portable' the GEMM's (fixed blocks: the speed alone)",
        ge=1,
        le=1024,
    )

    def to_profile(self) -> CpuProfile:
        return CpuProfile(self.profile, self.threads)


@dataclass(frozen=True)
class Params:
    seed: int = _spec(42, "seed for every random number generator", ge=0, le=2**32 - 1)
    deterministic: Mode = _spec(
        True,
        "true: bitwise-reproducible, fails closed; 'warn': same flags, warnings only; "
        "false: fast, cuDNN autotuning on",
        choices=(True, False, "warn"),
    )
    cpu: CpuConfig = field(default_factory=CpuConfig)
    #: Optional: only a pipeline with the built-in ``prepare`` stage has it.
    prepare: PrepareConfig | None = field(default_factory=PrepareConfig)
    model: Component = field(default_factory=lambda: DEFAULT_MODEL)
    #: None (``data: null`` or no ``data`` key, as a LightningCLI config for such a module has
    #: none): the model's own ``*_dataloader()`` methods give the data.
    data: Component | None = field(default_factory=lambda: DEFAULT_DATA)
    train: TrainConfig = field(default_factory=TrainConfig)

    @property
    def batch_size(self) -> int | None:
        """``data.init_args.batch_size`` when params.yaml sets it (the data module's default
        otherwise, known once the recipe is resolved)."""
        size = self.data.init_args.get("batch_size") if self.data is not None else None
        return size if type(size) is int else None

    def select(self, keys: Iterable[str]) -> dict[str, Any]:
        """Flat values under dotted ``keys`` (keys or whole sections): ``{"train.lr": 0.005}``."""
        flat = flatten(dataclasses.asdict(self))
        wanted = tuple(keys)
        return {
            name: value
            for name, value in flat.items()
            if any(name == key or name.startswith(f"{key}.") for key in wanted)
        }


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
