"""Record every aten op of chosen optimizer steps, to name the first op two runs disagree on.

For each step in a window (``steps``, optimizer steps counted from 0 like the
trace's ``step``), every aten op that runs in forward, backward and the
optimizer step is recorded: its name, the module that ran it, the user's
source line, and an integer fingerprint (:mod:`reprotrain.devicehash`,
computed on the tensor's device, fetched once per step) of every output and
of every input that no recorded op produced. An input that a recorded op
produced keeps that op's index, so :mod:`reprotrain.opalign` can tell "same
inputs, different output" (the kernel) from "the inputs already differed"
(and where they came from: a parameter, the batch, optimizer state, the RNG
state of a random op, a Python value, or a tensor made outside torch ops).

Backward ops carry the module and line of the forward call that created
their autograd node (a torch-function mode tags each node as it is made; a
module's forward hook tags the nodes of custom ``autograd.Function``s, which
no torch function makes). Under Lightning the forward and backward run in a
closure inside ``optimizer.step``; they keep their phase. View ops' outputs
are recorded by layout only (their bits are their input's), and the step
trace's own fingerprint ops are left out.
One file per rank: ``ops-rank<R>.safetensors``, written atomically when the
window's last step ends.

Use it with one line: ``OpRecorder()`` as a Lightning callback, or ``with
record_step(model, step, optimizer):`` around each step of a plain loop. With
no window given, both read ``REPROTRAIN_RECORD_OPS`` ("3" or "3-5") and
``REPROTRAIN_OPS_DIR`` (default ``ops``), which ``reprotrain verify -- CMD``
sets; when neither asks for a step they install nothing and cost nothing.

Limits: ops of other threads than the one that runs the step (DataLoader
workers) are not seen; their effect shows as a differing batch. A recorded
step is slower (every op is fingerprinted): 8x a plain step for the
pipeline's network, 39x for a 10M-parameter MLP on one CPU thread
(``benchmarks/op_record_overhead.py``, docs/any-script.md).
"""

from __future__ import annotations

import contextlib
import os
import sys
import sysconfig
import weakref
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import lightning
import torch
from lightning.pytorch import Callback
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from reprotrain.atomic import atomic_write_safetensors
from reprotrain.devicehash import fingerprints
from reprotrain.hashing import safetensors_metadata

__all__ = ["OpRecorder", "Recording", "parse_window", "record_step"]

FORMAT = "reprotrain-ops"
VERSION = 1
WINDOW_VARIABLE = "REPROTRAIN_RECORD_OPS"
DIR_VARIABLE = "REPROTRAIN_OPS_DIR"
PHASES = ("forward", "backward", "optimizer")
#: Origins of an input no recorded op produced (a producer op's index is >= 0).
OUTSIDE, PYTHON_VALUE, RNG_STATE, LABELLED = -1, -2, -3, -4
#: Ops whose output holds whatever the memory held; opdiff blames who reads it unwritten.
ALLOCATING = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})
_NODE_KEY = "reprotrain.oprecord"
_LIBRARY_DIR = Path(__file__).resolve().parent
#: Files whose ops are bookkeeping, not the step's computation: the step trace's fingerprints.
#: Left out, so a recording does not depend on whether (or how often) a trace ran.
_BOOKKEEPING = frozenset(str(Path(__file__).parent / n) for n in ("trace.py", "devicehash.py"))


def parse_window(text: str) -> tuple[int, int]:
    """``"3"`` -> (3, 3); ``"3-5"`` -> (3, 5). ValueError names the variable on bad text."""
    first, _, last = text.strip().partition("-")
    try:
        window = (int(first), int(last or first))
    except ValueError:
        raise ValueError(f"{WINDOW_VARIABLE}={text!r}: give a step or FIRST-LAST") from None
    if window[0] < 0 or window[1] < window[0]:
        raise ValueError(f"{WINDOW_VARIABLE}={text!r}: give 0 <= FIRST <= LAST")
    return window


def _skipped_dirs() -> tuple[str, ...]:
    dirs = [Path(torch.__file__).parent, Path(lightning.__file__).parent]
    dirs.append(Path(sysconfig.get_paths()["stdlib"]))
    return tuple(f"{d.resolve()}{os.sep}" for d in dirs)


def _in_bookkeeping() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename in _BOOKKEEPING:
            return True
        frame = frame.f_back
    return False


def _user_line(skipped: tuple[str, ...], cache: dict[str, bool]) -> str:
    """``file:line`` of the innermost frame outside torch, Lightning, stdlib and this library."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        skip = cache.get(name)
        if skip is None:
            path = Path(name).resolve()
            skip = cache[name] = str(path).startswith(skipped) or path.parent == _LIBRARY_DIR
        if not skip:
            shown = os.path.relpath(name)
            return f"{name if shown.startswith('..') else shown}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def _key(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), t._version)


class Recording:
    """The ops of one window, in the order they ran, with their fingerprints."""

    def __init__(self, root: torch.nn.Module | None, rank: int = 0, world_size: int = 1) -> None:
        self.rank, self.world_size = rank, world_size
        self.names = {id(m): n or "(root)" for n, m in (root.named_modules() if root else [])}
        self.signature = _model_signature(root)
        self.strings: dict[str, int] = {}
        self.ops: list[tuple[int, ...]] = []  # step, phase, op, module, line
        self.inputs: list[tuple[int, int, int, int]] = []  # op, fingerprint, origin, label
        self.outputs: list[tuple[int, int]] = []  # op, fingerprint
        self.steps: list[int] = []
        self._values: list[torch.Tensor] = []  # fingerprints per op, on the device
        self._count = 0
        self._known: dict[tuple[Any, ...], tuple[int, int, Any]] = {}  # fingerprint, op, ref
        self._labels: dict[tuple[Any, ...], str] = {}
        self._modules: list[str] = []
        self._phase = 0
        self._allocating = self._view = False
        self.step = -1
        self._skipped = _skipped_dirs()
        self._cache: dict[str, bool] = {}

    def text(self, value: str) -> int:
        return self.strings.setdefault(value, len(self.strings))

    def label(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Name tensors no recorded op makes (parameters, the batch, optimizer state)."""
        for name, tensor in tensors:
            self._labels[_key(tensor)] = name

    # --- called by the modes -------------------------------------------------------------
    def where(self) -> str:
        return _user_line(self._skipped, self._cache)

    def module(self) -> str:
        return self._modules[-1] if self._modules else "-"

    def _accumulation(self, node: Any) -> tuple[str, str]:
        variable = getattr(node, "variable", None)
        label = self._labels.get(_key(variable)) if isinstance(variable, torch.Tensor) else None
        return f"gradient of {label or 'a leaf tensor'}", "-"

    def _keep(self, values: list[torch.Tensor]) -> int:
        """Fingerprint ``values`` now (on the first one's device); index of the first."""
        first = self._count
        if values:
            device = values[0].device
            self._values.append(fingerprints([v.to(device) for v in values], device))
            self._count += len(values)
        return first

    def begin(self, func: Any, args: tuple, kwargs: dict) -> None:
        """Before an op runs: link inputs a recorded op made, fingerprint the others now."""
        index = len(self.ops)
        node = torch._C._current_autograd_node()
        phase, module, line = self._phase, self.module(), ""
        if node is not None:
            phase = 1
            module, line = node.metadata.get(_NODE_KEY) or self._accumulation(node)
        name = str(func)
        self._allocating = func._overloadpacket.__name__ in ALLOCATING
        self._view = func.is_view
        self.ops.append(
            (self.step, phase, self.text(name), self.text(module), self.text(line or self.where()))
        )
        leaves = tree_flatten((args, kwargs))[0]
        fresh: list[tuple[torch.Tensor, int, int]] = []
        values = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                key = _key(leaf)
                known = self._known.get(key)
                if known is not None and known[2]() is not None:  # alive: memory not reused
                    self.inputs.append((index, known[0], known[1], -1))
                elif (label := self._labels.get(key)) is not None:
                    fresh.append((leaf.detach(), LABELLED, self.text(label)))
                else:
                    fresh.append((leaf.detach(), OUTSIDE, -1))
            elif not isinstance(leaf, torch.Generator):  # its repr holds an address
                values.append(repr(leaf))
        if values:
            digest = zlib.crc32(" ".join(values).encode())
            fresh.append((torch.tensor(digest, dtype=torch.int64), PYTHON_VALUE, -1))
        if torch.Tag.nondeterministic_seeded in func.tags:
            fresh.append((_generator_state(leaves), RNG_STATE, -1))
        first = self._keep([t for t, _, _ in fresh])
        for position, (_, origin, label) in enumerate(fresh):
            self.inputs.append((index, first + position, origin, label))

    def end(self, out: Any) -> None:
        """After the op ran: fingerprint its outputs; later ops reading them link here."""
        index = len(self.ops) - 1
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        kept = outs
        if self._allocating:  # the bits are whatever the memory held: only the shape counts
            kept = [torch.tensor(zlib.crc32(repr(t.shape).encode())) for t in outs]
        elif self._view:  # its bits are its input's, compared already: only the layout counts
            layouts = [(t.shape, t.stride(), t.storage_offset()) for t in outs]
            kept = [torch.tensor(zlib.crc32(repr(layout).encode())) for layout in layouts]
        first = self._keep(kept)
        for position, t in enumerate(outs):
            self.outputs.append((index, first + position))
            self._known[_key(t)] = (first + position, index, weakref.ref(t))

    def end_step(self) -> None:
        """Fetch the step's fingerprints from the device in one go."""
        if self._values:
            self._values = [torch.cat([v.cpu() for v in self._values])]
        if not self.steps or self.steps[-1] != self.step:
            self.steps.append(self.step)

    def tensors(self) -> dict[str, torch.Tensor]:
        values = torch.cat([v.cpu() for v in self._values]) if self._values else torch.zeros(0)
        return {
            "ops": torch.tensor(self.ops, dtype=torch.int64).reshape(-1, 5),
            "inputs": torch.tensor(self.inputs, dtype=torch.int64).reshape(-1, 4),
            "outputs": torch.tensor(self.outputs, dtype=torch.int64).reshape(-1, 2),
            "fingerprints": values.to(torch.int64),
        }

    def write(self, path: str | Path) -> None:
        metadata = {
            "format": FORMAT,
            "version": VERSION,
            "rank": self.rank,
            "world_size": self.world_size,
            "steps": self.steps,
            "model": self.signature,
            "strings": list(self.strings),
            "torch": torch.__version__,
        }
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_safetensors(path, self.tensors(), safetensors_metadata(metadata))


def _model_signature(root: torch.nn.Module | None) -> str:
    if root is None:
        return "-"
    shapes = ";".join(f"{n}:{tuple(p.shape)}" for n, p in root.named_parameters())
    return f"{zlib.crc32(shapes.encode()):08x}"


def _generator_state(leaves: list[Any]) -> torch.Tensor:
    given = [x for x in leaves if isinstance(x, torch.Generator)]
    if given:
        return given[0].get_state()
    device = next((x.device for x in leaves if isinstance(x, torch.Tensor)), None)
    if device is not None and device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.default_generator.get_state()


class _Dispatch(TorchDispatchMode):
    def __init__(self, recording: Recording) -> None:
        super().__init__()
        self.recording = recording

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = kwargs or {}
        if func.namespace == "profiler" or _in_bookkeeping():  # markers; the trace's own ops
            return func(*args, **kwargs)
        self.recording.begin(func, args, kwargs)
        out = func(*args, **kwargs)
        self.recording.end(out)
        return out


class _Lines(TorchFunctionMode):
    """Tags each autograd node with the module and source line of the call that made it."""

    def __init__(self, recording: Recording) -> None:
        super().__init__()
        self.recording = recording

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        out = func(*args, **(kwargs or {}))
        if torch.is_grad_enabled():
            nodes = [t.grad_fn for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            _tag_new_nodes(nodes, lambda: (self.recording.module(), self.recording.where()))
        return out


def _tag_new_nodes(nodes: list[Any], tag: Any) -> None:
    """Tag untagged autograd nodes reachable from ``nodes`` (those the call just made)."""
    value = None
    todo = [n for n in nodes if n is not None]
    while todo:
        node = todo.pop()
        if _NODE_KEY in node.metadata or not hasattr(node, "next_functions"):
            continue
        if node.name().endswith("AccumulateGrad"):
            continue
        value = value or tag()
        node.metadata[_NODE_KEY] = value
        todo.extend(n for n, _ in node.next_functions if n is not None)


@contextlib.contextmanager
def _recording_step(recording: Recording, step: int) -> Iterator[None]:
    """Record every op of one step into ``recording``."""
    stack = recording._modules

    def enter(module: torch.nn.Module, _args: Any) -> None:
        stack.append(recording.names.get(id(module), type(module).__name__))

    def leave(module: torch.nn.Module, _args: Any, out: Any) -> None:
        # Nodes no torch function made (a custom autograd.Function's) belong to this module.
        if torch.is_grad_enabled():
            nodes = [t.grad_fn for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            _tag_new_nodes(nodes, lambda: (recording.module(), recording.where()))
        if stack:
            stack.pop()

    def optimizer_pre(optimizer: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        recording._phase = 2
        stack.append(f"optimizer {type(optimizer).__name__}")
        # args[0] is the optimizer itself (the hook sees the wrapped method's arguments)
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is None:
            return None

        def forward_and_backward() -> Any:  # Lightning runs its step inside optimizer.step
            recording._phase, entry = 0, stack.pop()
            try:
                return closure()
            finally:
                stack.append(entry)
                recording._phase = 2

        if "closure" in kwargs:
            return args, {**kwargs, "closure": forward_and_backward}
        return (args[0], forward_and_backward, *args[2:]), kwargs

    def optimizer_post(*_: Any) -> None:
        recording._phase = 0
        if stack:
            stack.pop()

    from torch.nn.modules import module as nn_module
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    recording.step = step
    hooks = [
        nn_module.register_module_forward_pre_hook(enter),
        nn_module.register_module_forward_hook(leave),
        register_optimizer_step_pre_hook(optimizer_pre),
        register_optimizer_step_post_hook(optimizer_post),
    ]
    try:
        with _Lines(recording), _Dispatch(recording):
            yield
    finally:
        for hook in hooks:
            hook.remove()
        stack.clear()
        recording._phase = 0
        recording.end_step()


def _optimizer_labels(optimizer: Any, names: dict[int, str]) -> Iterator[tuple[str, torch.Tensor]]:
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                yield f"optimizer state {key} of {names.get(id(param), 'a parameter')}", value


def _label_all(recording: Recording, model: torch.nn.Module, optimizers: Iterable[Any]) -> None:
    params = {id(p): n for n, p in model.named_parameters()}
    recording.label((f"parameter {n}", p) for n, p in model.named_parameters())
    recording.label((f"buffer {n}", b) for n, b in model.named_buffers())
    for optimizer in optimizers:
        recording.label(_optimizer_labels(optimizer, params))


def _window_from_env(steps: tuple[int, int] | None) -> tuple[int, int] | None:
    if steps is not None:
        return steps
    text = os.environ.get(WINDOW_VARIABLE)
    return None if not text else parse_window(text)


def _out_dir(out: str | Path | None) -> Path:
    return Path(out if out is not None else os.environ.get(DIR_VARIABLE, "ops"))


def _rank_file(out: Path, rank: int) -> Path:
    return out / f"ops-rank{rank}.safetensors"


_plain: dict[str, Any] = {}


@contextlib.contextmanager
def record_step(
    model: torch.nn.Module,
    step: int,
    optimizer: Any = None,
    steps: tuple[int, int] | None = None,
    out: str | Path | None = None,
    batch: Any = None,
) -> Iterator[None]:
    """Around one step of a plain PyTorch loop: records it when ``step`` is in the window.

    The window and folder default to ``REPROTRAIN_RECORD_OPS`` / ``REPROTRAIN_OPS_DIR``;
    outside the window this is a null context. The file is written after the last step.
    """
    window = _window_from_env(steps)
    if window is None or not window[0] <= step <= window[1]:
        yield
        return
    recording = _plain.get("recording")
    if recording is None or recording.step >= step:
        recording = _plain["recording"] = Recording(model)
    _label_all(recording, model, [optimizer] if optimizer is not None else [])
    if batch is not None:
        recording.label(("batch", t) for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor))
    with _recording_step(recording, step):
        yield
    if step == window[1]:
        recording.write(_rank_file(_out_dir(out), 0))
        _plain.clear()


class OpRecorder(Callback):
    """Lightning callback: records the ops of the window's optimizer steps, per rank."""

    def __init__(self, steps: tuple[int, int] | None = None, out: str | Path | None = None):
        self.window = _window_from_env(steps)
        self.out = _out_dir(out)
        self.recording: Recording | None = None
        self._context: Any = None

    def _active(self, trainer: Any) -> bool:
        return self.window is not None and self.window[0] <= trainer.global_step <= self.window[1]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self._active(trainer):
            return
        if self.recording is None:
            self.recording = Recording(pl_module, trainer.global_rank, trainer.world_size)
        _label_all(self.recording, pl_module, trainer.optimizers)
        tensors = [t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)]
        self.recording.label(("batch", t) for t in tensors)
        self._context = _recording_step(self.recording, trainer.global_step)
        self._context.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._context is None:
            return
        self._context.__exit__(None, None, None)
        self._context = None
        if trainer.global_step > self.window[1]:  # the window's last optimizer step is done
            self._write()

    def on_train_end(self, trainer, pl_module) -> None:
        self._write()

    def _write(self) -> None:
        if self.recording is not None and self.recording.ops:
            self.recording.write(_rank_file(self.out, self.recording.rank))
        self.recording = None
