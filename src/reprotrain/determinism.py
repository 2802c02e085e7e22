"""Determinism for any PyTorch Lightning project, set up from process start.

Call :func:`configure_determinism` once, before the model, the data loaders or
anything else touches CUDA::

    from reprotrain.determinism import configure_determinism

    settings = configure_determinism(seed=42, mode=True)
    trainer = L.Trainer(**settings.trainer_flags(), ...)

What it guarantees, in ``mode=True``: python, numpy and torch (every device)
are seeded; DataLoader workers are seeded by Lightning's worker init function
(``PL_SEED_WORKERS``); ``torch.use_deterministic_algorithms(True)``,
``cudnn.deterministic=True`` and ``cudnn.benchmark=False`` are in force; and
``CUBLAS_WORKSPACE_CONFIG`` was set before CUDA started. With the same code,
data, seed, hardware model and torch/CUDA/cuDNN build, training then gives the
same bits on every run. Across GPU models, CPU vs GPU, or library versions it
does not: floating-point rounding differs there.

What each setting buys and costs, and why it is kept (:data:`SETTING_REASONS`,
also in every :class:`DeterminismSettings`; measured per setting by
``benchmarks/gpu/determinism_settings.py``): the one setting not kept is torch's
``fill_uninitialized_memory``, which writes NaN into every ``torch.empty``
output first. It changes no bits of a program that reads no uninitialized
memory (torch's own documentation says so, and the benchmark shows the same
weights with and without it on the conv and transformer workloads, CPU and
GPU), and it cost 3% per step on the conv workload on an H200. A program that
does read uninitialized memory shows as NOT REPRODUCIBLE in ``reprotrain
verify``; ``fill_uninitialized_memory=True`` turns torch's fill back on.

What it refuses: two things cannot be fixed from inside a running process,
so it checks them and fails closed (:class:`DeterminismError`) in ``True``
mode, and warns in ``"warn"`` mode:

* ``PYTHONHASHSEED`` must have been set when the interpreter started (set-ordering
  of strings depends on it). :func:`reexec_with_fixed_hash_seed` restarts the
  process with it set; the ``reprotrain`` CLI does that first thing.
* CUDA must not be initialised yet: cuBLAS reads ``CUBLAS_WORKSPACE_CONFIG``
  when its handle is created, so setting it later (as Lightning's
  ``Trainer(deterministic=True)`` does) can be silently too late. A later call
  in the same process (several fits in one benchmark, sweep or notebook) is
  accepted while the value an earlier call saw before CUDA started is still
  the one exported.

``torch.compile``: in ``True`` and ``"warn"`` modes Inductor's cache
(``TORCHINDUCTOR_CACHE_DIR``) becomes a folder of its own for this torch build and C++
compiler (:func:`reprotrain.provenance.toolchain.keyed_cache_dir`): Inductor's key
for a kernel leaves out both, and a torch replaced at the same path loaded kernels
the other one built. Call it before the first compile.

An op with no deterministic kernel raises torch's error; after its traceback,
a process that called :func:`configure_determinism` prints one more line
naming the op, the line of the user's code that called it, and the choices
(:func:`explain_nondeterministic_error`).

``mode=False`` is the fast mode: nothing is checked, deterministic algorithms
are off and cuDNN autotuning (``benchmark``) is on. Seeding still happens.

Every check in the package that can void the guarantee (here, the lock, the
CPU profile, exported variables) ends in :func:`refuse_or_warn`: the one rule
for what each mode does with a problem.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import warnings
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from reprotrain.provenance.toolchain import keyed_cache_dir
from reprotrain.seeding import seed_at_start

if TYPE_CHECKING:
    from types import TracebackType

    from reprotrain.cpu.profile import CpuProfile

Mode = bool | Literal["warn"]

#: The two values cuBLAS accepts for deterministic workspaces; the first is
#: what Lightning and the PyTorch docs use.
CUBLAS_DETERMINISTIC_CONFIGS = (":4096:8", ":16:8")
FIXED_HASH_SEED = "0"
_HASH_PROBE = "reprotrain-hash-probe"
#: Why each setting of ``mode=True`` is as it is (see the module docstring).
SETTING_REASONS = {
    "use_deterministic_algorithms": "kept: ops with a non-deterministic default kernel (the "
    "CUDA embedding and scatter backward, for instance) switch to a deterministic one or raise",
    "CUBLAS_WORKSPACE_CONFIG": "kept: torch refuses cuBLAS calls under deterministic algorithms "
    "without it; :4096:8, the faster of the two values torch accepts",
    "cudnn.deterministic": "kept: deterministic cuDNN kernels (deterministic algorithms already "
    "imply them; the flag is for code that reads it)",
    "cudnn.benchmark": "off: autotuning times kernels at run time, so a rerun may pick another "
    "kernel and other bits",
    "fill_uninitialized_memory": "off unless asked for: changes the bits only of a program that "
    "reads uninitialized memory (verify finds one), and costs a write of every fresh tensor",
}
#: torch's alert for an op without a deterministic kernel under deterministic algorithms.
NONDETERMINISTIC_ALERT = "does not have a deterministic implementation"
#: How the line an uncaught alert adds to the traceback starts (configure_determinism's hook).
EXPLAINED_PREFIX = "reprotrain: DeterminismError: "
#: The CUBLAS_WORKSPACE_CONFIG in force when a call found CUDA not yet started.
_cublas_before_cuda: str | None = None


class DeterminismError(RuntimeError):
    """The process cannot honour the determinism guarantee it was asked for."""


class DeterminismWarning(UserWarning):
    """A problem that voids the guarantee in ``"warn"`` mode: the run goes on; reruns may differ."""


def refuse_or_warn(mode: Mode, problem: str, *, stacklevel: int = 2) -> None:
    """What a mode does with a problem that voids the guarantee.

    ``True`` (a guarantee was asked for): raise :class:`DeterminismError`.
    ``"warn"``: a :class:`DeterminismWarning` and go on. ``False``: nothing;
    no guarantee was asked for, so there is none to void.
    """
    if mode is True:
        raise DeterminismError(problem)
    if mode == "warn":
        warnings.warn(problem, DeterminismWarning, stacklevel=stacklevel + 1)


@dataclass(frozen=True)
class DeterminismSettings:
    """What was actually in force after :func:`configure_determinism`."""

    mode: Mode
    seed: int
    python_hash_seed: str | None
    hash_seed_fixed_at_start: bool
    cublas_workspace_config: str | None
    cuda_initialized_before: bool
    deterministic_algorithms: bool
    deterministic_algorithms_warn_only: bool
    cudnn_deterministic: bool
    cudnn_benchmark: bool
    fill_uninitialized_memory: bool
    seed_workers: bool
    cpu_profile: dict[str, Any] | None
    problems: tuple[str, ...]

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict, stable field order."""
        out = asdict(self)
        out["problems"] = list(self.problems)
        return out

    def reasons(self) -> dict[str, str]:
        """Why each setting is as it is in this mode (:data:`SETTING_REASONS` when on)."""
        if self.mode is False:
            return {"all": "fast mode: no determinism setting, cuDNN autotuning on"}
        return dict(SETTING_REASONS)

    def trainer_flags(self) -> dict[str, Any]:
        """``deterministic`` and ``benchmark`` for ``lightning.Trainer``, matching this mode."""
        return {"deterministic": self.mode, "benchmark": self.cudnn_benchmark}


def hash_seed_fixed_at_start() -> bool:
    """True when the running interpreter's string hashing was seeded by ``PYTHONHASHSEED``.

    Setting ``os.environ["PYTHONHASHSEED"]`` after start does not change the
    interpreter, so the value is checked against the interpreter itself: with
    ``0`` hash randomisation is off (``sys.flags``); for other values a child
    interpreter started with that seed must hash a probe string the same way.
    """
    value = os.environ.get("PYTHONHASHSEED")
    if value is None or not value.isdigit():
        return False
    if value == "0":
        return sys.flags.hash_randomization == 0
    child = subprocess.run(
        [sys.executable, "-c", f"print(hash({_HASH_PROBE!r}))"],
        env={**os.environ, "PYTHONHASHSEED": value},
        capture_output=True,
        text=True,
        check=True,
    )
    return child.stdout.strip() == str(hash(_HASH_PROBE))


def reexec_with_fixed_hash_seed(variables: Mapping[str, str] | None = None) -> None:
    """Restart this process with ``PYTHONHASHSEED`` (and ``variables``) fixed, unless they are.

    Call it before importing torch (the restart repeats everything done so
    far). It also sets ``CUBLAS_WORKSPACE_CONFIG`` for the new process so
    cuBLAS sees it from the first handle on. ``variables`` are others that only
    work from process start, e.g. a :class:`~reprotrain.cpu.profile.CpuProfile`'s
    ``variables()``; they replace exported values. Never returns when it restarts.

    Raises :class:`DeterminismError` where the program cannot be started again: read
    from standard input (``python -``, a pipe), an interactive session or a notebook's
    kernel (a restart would lose it, or run nothing, silently).
    """
    wanted = dict(variables or {})
    if hash_seed_fixed_at_start() and all(os.environ.get(k) == v for k, v in wanted.items()):
        return
    if why := _cannot_restart():
        raise DeterminismError(
            f"reexec_with_fixed_hash_seed: cannot restart this process: {why}; start Python "
            "with the variables set instead (PYTHONHASHSEED=0 python script.py, or "
            "reprotrain run -- python script.py)"
        )
    env = {**os.environ, **wanted, "PYTHONHASHSEED": FIXED_HASH_SEED}
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DETERMINISTIC_CONFIGS[0])
    # sys.orig_argv is the interpreter's own command line (python, -m/script, args...).
    argv = [sys.executable, *sys.orig_argv[1:]]
    if os.environ.get("REPROTRAIN_ZYGOTE"):  # the test suite's warm interpreter
        importlib.import_module("reprotrain._zygote").hand_over(argv, env)  # returns: exec
    os.execve(sys.executable, argv, env)


def _cannot_restart() -> str | None:
    """Why this interpreter's command line would not run this program again, if so."""
    ipython = sys.modules.get("IPython")
    if sys.flags.interactive or getattr(ipython, "get_ipython", lambda: None)() is not None:
        return "it is interactive (a notebook's kernel, IPython, python -i)"
    if sys.argv[:1] in ([""], ["-"]):
        return "it read its program from standard input (a pipe, python -, a prompt)"
    return None


def _cuda_initialized() -> bool:
    import torch

    return torch.cuda.is_initialized()


def _check_preconditions(hash_ok: bool, cuda_up: bool) -> list[str]:
    """The problems that make the guarantee void."""
    problems: list[str] = []
    if not hash_ok:
        problems.append(
            "PYTHONHASHSEED was not fixed when the interpreter started "
            f"(now {os.environ.get('PYTHONHASHSEED')!r}); start Python with "
            "PYTHONHASHSEED=0, or call reexec_with_fixed_hash_seed() first thing"
        )
    cublas = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if cublas is not None and cublas not in CUBLAS_DETERMINISTIC_CONFIGS:
        problems.append(
            f"CUBLAS_WORKSPACE_CONFIG={cublas!r} is not deterministic; "
            f"use one of {', '.join(CUBLAS_DETERMINISTIC_CONFIGS)} or unset it"
        )
    if cuda_up and (cublas is None or cublas != _cublas_before_cuda):
        problems.append(
            "CUDA was initialised before configure_determinism(); cuBLAS may have "
            "started without CUBLAS_WORKSPACE_CONFIG. Call it before any CUDA use "
            "(model.to('cuda'), torch.cuda.* calls, Trainer.fit)"
        )
    return problems


def configure_determinism(
    seed: int,
    mode: Mode = True,
    cpu_profile: CpuProfile | None = None,
    fill_uninitialized_memory: bool = False,
) -> DeterminismSettings:
    """Seed everything and apply the determinism flags for ``mode``; return what is in force.

    ``mode`` is ``True`` (fail closed), ``"warn"`` (same flags, problems and
    non-deterministic ops become warnings) or ``False`` (fast: autotuning on).
    ``cpu_profile`` (:mod:`reprotrain.cpu.profile`) also fixes the CPU kernels and
    threads; its variables must have been exported at process start. None: the profile
    ``reprotrain run --cpu-profile`` started the process under, if it did
    (:func:`~reprotrain.cpu.profile.launched_profile`).
    ``fill_uninitialized_memory``: torch's fill of fresh tensors under deterministic
    algorithms (off by default: :data:`SETTING_REASONS`).
    Raises :class:`DeterminismError` in ``True`` mode when a precondition in
    the module docstring (or of the profile) does not hold.
    """
    if not (mode is True or mode is False or mode == "warn"):
        raise ValueError(f"mode must be True, False or 'warn', got {mode!r}")
    enabled = mode is not False
    hash_ok = hash_seed_fixed_at_start()
    cuda_up = _cuda_initialized()
    if cpu_profile is None:
        from reprotrain.cpu.profile import launched_profile

        cpu_profile = launched_profile()
    problems: list[str] = cpu_profile.apply() if cpu_profile is not None else []
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DETERMINISTIC_CONFIGS[0])
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = keyed_cache_dir()
        problems = _check_preconditions(hash_ok, cuda_up) + problems
        if not cuda_up and not problems:
            global _cublas_before_cuda
            _cublas_before_cuda = os.environ["CUBLAS_WORKSPACE_CONFIG"]
        if problems:
            refuse_or_warn(mode, "cannot guarantee determinism: " + "; ".join(problems))

    import torch

    seed_at_start(seed)
    if enabled:
        _install_explaining_excepthook()
    torch.use_deterministic_algorithms(enabled, warn_only=mode == "warn")
    torch.utils.deterministic.fill_uninitialized_memory = fill_uninitialized_memory
    torch.backends.cudnn.deterministic = enabled
    torch.backends.cudnn.benchmark = not enabled

    return DeterminismSettings(
        mode=mode,
        seed=seed,
        python_hash_seed=os.environ.get("PYTHONHASHSEED"),
        hash_seed_fixed_at_start=hash_ok,
        cublas_workspace_config=os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        cuda_initialized_before=cuda_up,
        deterministic_algorithms=torch.are_deterministic_algorithms_enabled(),
        deterministic_algorithms_warn_only=torch.is_deterministic_algorithms_warn_only_enabled(),
        cudnn_deterministic=torch.backends.cudnn.deterministic,
        cudnn_benchmark=torch.backends.cudnn.benchmark,
        fill_uninitialized_memory=torch.utils.deterministic.fill_uninitialized_memory,
        seed_workers=os.environ.get("PL_SEED_WORKERS") == "1",
        cpu_profile=None if cpu_profile is None else cpu_profile.record(),
        problems=tuple(problems),
    )


def explain_nondeterministic_error(
    err: BaseException, where: str | None = None
) -> DeterminismError | None:
    """A :class:`DeterminismError` naming the op, ``where`` it was called and the choices, if
    ``err`` is torch's alert for an op with no deterministic kernel."""
    message = str(err)
    if NONDETERMINISTIC_ALERT not in message:
        return None
    op = message.split(NONDETERMINISTIC_ALERT)[0].strip() or "an operation"
    at = f" (called at {where})" if where else ""
    return DeterminismError(
        f"{op}{at} has no deterministic implementation on this device, so it cannot run with "
        "deterministic: true. Choices: replace the op (or run it on the CPU), or run it in warn "
        "mode (deterministic: warn, or configure_determinism(mode='warn')) and accept that "
        "reruns may differ"
    )


def user_frame(tb: TracebackType | None) -> str | None:
    """``file:line`` of the innermost frame of ``tb`` outside torch, Lightning and reprotrain."""
    import traceback

    skipped = [
        str(Path(module.__file__).parent)
        for name in ("torch", "lightning", "lightning_fabric", "pytorch_lightning", "reprotrain")
        if (module := sys.modules.get(name)) is not None and module.__file__
    ]
    for frame in reversed(traceback.extract_tb(tb)):
        if not frame.filename.startswith(tuple(skipped)) and not frame.filename.startswith("<"):
            return f"{frame.filename}:{frame.lineno}"
    return None


def _install_explaining_excepthook() -> None:
    """After the traceback of an uncaught alert, one line: :data:`EXPLAINED_PREFIX` and
    :func:`explain_nondeterministic_error`'s text (``reprotrain run`` shows it as the last
    line; ``verify -- CMD`` reads it from the run's log)."""
    previous = sys.excepthook
    if getattr(previous, "explains_nondeterministic_ops", False):
        return

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        previous(kind, value, tb)
        if isinstance(value, RuntimeError):
            explained = explain_nondeterministic_error(value, user_frame(tb))
            if explained is not None:
                print(EXPLAINED_PREFIX + str(explained), file=sys.stderr)

    hook.explains_nondeterministic_ops = True  # type: ignore[attr-defined]
    sys.excepthook = hook
