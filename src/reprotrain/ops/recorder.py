"""Record every aten op of chosen optimizer steps, to name the first op two runs disagree on.

For each step in a window (``steps``, optimizer steps counted from 0 like the
trace's ``step``), every aten op that runs in forward, backward and the
optimizer step is recorded: its name, the module that ran it, the user's
source line, and an integer fingerprint of every output and of every input
that no recorded op produced: CRC-32 of the bytes for a CPU tensor (3.7 GB/s
on one core here, the memory read being most of it), and on another device
:mod:`reprotrain.fingerprint` computed there and fetched once per step. Both
runs of a comparison fingerprint a tensor on the same kind of device, so the
two kinds never meet; the file names them (``hash``). An input that a recorded op
produced keeps that op's index, so :mod:`reprotrain.ops.align` can tell "same
inputs, different output" (the kernel) from "the inputs already differed"
(and where they came from: a parameter, the batch, optimizer state, the RNG
state of a random op, a Python value, or a tensor made outside torch ops).

Backward ops carry the module and line of the forward op that made their
autograd node (nodes are numbered as autograd makes them, and an op's node
is made just before the op reaches the dispatch mode; a module's forward
hook tags the nodes of custom ``autograd.Function``s, which no op makes).
Under Lightning the forward and backward run in a closure inside
``optimizer.step``; they keep their phase. View ops' outputs
are recorded by layout only (their bits are their input's), and the step
trace's own fingerprint ops are left out.
One file per rank, in the format of :mod:`reprotrain.ops.opfile`, written when the
window's last step ends.

Use it with one line: ``OpRecorder()`` as a Lightning callback, or ``with
record_step(model, step, optimizer):`` around each step of a plain loop. With
no window given, both read ``REPROTRAIN_RECORD_OPS`` ("3" or "3-5") and
``REPROTRAIN_OPS_DIR`` (default ``ops``), which ``reprotrain verify -- CMD``
sets; when neither asks for a step they install nothing and cost nothing.

Limits: ops of other threads than the one that runs the step (DataLoader
workers) are not seen; their effect shows as a differing batch. A recorded
step is slower, every op being fingerprinted and located: see
``benchmarks/op_record_overhead.py`` and docs/any-script.md for the cost.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
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
import torch._dynamo
from lightning.pytorch import Callback
from torch._C._dynamo.eval_frame import set_eval_frame as _set_eval_frame
from torch.autograd.function import BackwardCFunction
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from reprotrain.fingerprint import fingerprints, tensor_bytes
from reprotrain.ops.opfile import (
    ALLOCATING,
    DIR_VARIABLE,
    LABELLED,
    OUTSIDE,
    PYTHON_VALUE,
    RNG_STATE,
    WINDOW_VARIABLE,
    recording_dir,
    recording_path,
    write_recording,
)

__all__ = ["DIR_VARIABLE", "WINDOW_VARIABLE", "OpRecorder", "Recording", "parse_window",
           "record_step"]  # fmt: skip
_NODE_KEY = "reprotrain.ops.recorder"
_LIBRARY_DIR = Path(__file__).resolve().parent
#: Files whose ops are bookkeeping, not the step's computation: the step trace's fingerprints.
#: Left out, so a recording does not depend on whether (or how often) a trace ran.
_BOOKKEEPING = frozenset(
    str(Path(__file__).parent / n)
    for n in ("trace.py", "tracerows.py", "rngstate.py", "devicehash.py")
)


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


@functools.cache
def _skipped_dirs() -> tuple[str, ...]:
    dirs = [Path(torch.__file__).parent, Path(lightning.__file__).parent]
    dirs.append(Path(sysconfig.get_paths()["stdlib"]))
    return tuple(f"{d.resolve()}{os.sep}" for d in dirs)


_skipped_files: dict[str, bool] = {}  # file name -> not the user's (torch, stdlib, ...)
_shown_lines: dict[tuple[str, int], str] = {}  # (file name, line) -> "file:line" as shown


def _user_line() -> str:
    """``file:line`` of the innermost frame outside torch, Lightning, stdlib and this library.

    "" when the call comes from the step trace (a _BOOKKEEPING file on the way out).
    """
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name in _BOOKKEEPING:
            return ""
        skip = _skipped_files.get(name)
        if skip is None:
            path = Path(name).resolve()
            skip = str(path).startswith(_skipped_dirs()) or path.parent == _LIBRARY_DIR
            _skipped_files[name] = skip
        if not skip:
            where = (name, frame.f_lineno)
            if (line := _shown_lines.get(where)) is None:
                shown = os.path.relpath(name)
                line = f"{name if shown.startswith('..') else shown}:{where[1]}"
                _shown_lines[where] = line
            return line
        frame = frame.f_back
    return "?"


def _key(t: torch.Tensor, version: int | None = None) -> tuple[Any, ...]:
    """What identifies a tensor's bits while the step runs: its memory, layout and version."""
    return (t.data_ptr(), t._version if version is None else version, t.dtype, t.shape, t.stride())


def _leaves(tree: Any, out: list[Any]) -> list[Any]:
    """The leaves of an op's arguments (tuples, lists and dicts of them), in order."""
    if not isinstance(tree, (tuple, list, dict)):
        out.append(tree)
        return out
    for item in tree.values() if isinstance(tree, dict) else tree:
        if isinstance(item, (tuple, list, dict)):
            _leaves(item, out)
        else:
            out.append(item)
    return out


def _crc(value: str | torch.Tensor) -> int:
    """CRC-32 of a text, or of a CPU tensor's bits (row-major, as ``tensor_bytes``)."""
    if isinstance(value, str):
        return zlib.crc32(value.encode())
    if value.layout != torch.strided:  # sparse and other layouts: compared by description
        return zlib.crc32(repr((value.layout, value.shape, value.dtype)).encode())
    if value.is_contiguous() and not (value.is_conj() or value.is_neg()):
        # Its bytes in place, read without a torch call: a few microseconds less per tensor.
        size = value.numel() * value.element_size()
        return zlib.crc32((ctypes.c_char * size).from_address(value.data_ptr())) if size else 0
    return zlib.crc32(tensor_bytes(value.resolve_conj().resolve_neg()).numpy())


class _OpKind:
    """What the recorder needs of one aten overload, worked out once."""

    __slots__ = ("allocating", "flat", "name", "random", "view", "written")

    def __init__(self, func: Any) -> None:
        self.name = str(func)
        # No list among its arguments: the positional arguments are the leaves.
        self.flat = not any("List" in str(a.type) for a in func._schema.arguments)
        self.allocating = func._overloadpacket.__name__ in ALLOCATING
        self.view = func.is_view
        self.random = torch.Tag.nondeterministic_seeded in func.tags
        # Which returns the op writes in place (add_, out=): they leave it one version on.
        self.written = [bool(r.alias_info and r.alias_info.is_write) for r in func._schema.returns]


_KINDS: dict[Any, _OpKind] = {}  # aten overload -> what the recorder needs of it


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
        self._values: list[int] = []  # fingerprints; a device's are filled in at the step's end
        self._pending: dict[torch.device, tuple[list[int], list[torch.Tensor]]] = {}
        self._known: dict[tuple[Any, ...], tuple[int, int, Any]] = {}  # fingerprint, op, ref
        # Tensors no recorded op made, read this step: fingerprint, origin, label, ref. A
        # parameter is read in forward, backward and the optimizer: hashed once. Per step,
        # as a write that bypasses the version counter (through .data) may come between.
        self._read: dict[tuple[Any, ...], tuple[int, int, int, Any]] = {}
        self._labels: dict[tuple[Any, ...], str] = {}
        self._modules: list[str] = []
        self._phase = 0
        self._kind: _OpKind | None = None
        self._base_version = 0  # a view op's input's version: its output shares the counter
        self.step = -1
        # The user's line of the op running now ("": the trace's), None till asked.
        self._line: str | None = None
        # Autograd nodes by sequence number -> (module, line) of the forward op that made them.
        self._made: dict[int, tuple[str, str]] = {}
        self._next_node = torch._C._autograd._get_sequence_nr()  # first number not yet seen
        self._last_made = ("-", "?")  # the previous forward op's (module, line)

    def text(self, value: str) -> int:
        return self.strings.setdefault(value, len(self.strings))

    def label(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Name tensors no recorded op makes (parameters, the batch, optimizer state)."""
        for name, tensor in tensors:
            self._labels[_key(tensor)] = name

    # --- called by the modes -------------------------------------------------------------
    def where(self) -> str:
        if self._line is None:
            self._line = _user_line()
        return self._line

    def module(self) -> str:
        return self._modules[-1] if self._modules else "-"

    def _note_nodes(self, made: tuple[str, str]) -> None:
        """Before a forward op runs: name the autograd nodes made since the previous one.

        Autograd numbers nodes in the order it makes them, and makes an op's node
        just before the op reaches this mode. So with grad on, the newest number
        is this op's node (when it made one; if not, that number is named
        already), and older new ones were made after the previous op
        (``CopySlices`` after an in-place op on a view): the previous op's. With
        grad off no op makes a node: a new one is a custom ``autograd.Function``'s,
        made before its forward's first op, named here by that op; the module
        hooks tag it with the module's call, and the tag wins (:meth:`_maker`).
        """
        newest = torch._C._autograd._get_sequence_nr()
        first, self._next_node = self._next_node, newest
        if newest > first:
            earlier = made
            if torch.is_grad_enabled():
                self._made.setdefault(newest - 1, made)
                newest, earlier = newest - 1, self._last_made
            for number in range(first, newest):
                self._made.setdefault(number, earlier)
        self._last_made = made

    def _maker(self, node: Any) -> tuple[str, str]:
        """(module, line) of the forward op that made autograd ``node``."""
        tag = node.metadata.get(_NODE_KEY) if isinstance(node, BackwardCFunction) else None
        return tag or self._made.get(node._sequence_nr()) or self._accumulation(node)

    def _accumulation(self, node: Any) -> tuple[str, str]:
        variable = getattr(node, "variable", None)
        label = self._labels.get(_key(variable)) if isinstance(variable, torch.Tensor) else None
        return f"gradient of {label or 'a leaf tensor'}", "-"

    def _keep(self, values: list[torch.Tensor | int]) -> int:
        """Fingerprint ``values`` (ints are kept as they are); index of the first.

        A CPU tensor is fingerprinted now, by CRC-32; a tensor on another device there,
        fetched with the rest of the step's at its end.
        """
        first = len(self._values)
        elsewhere: dict[torch.device, list[torch.Tensor]] = {}
        for value in values:
            if isinstance(value, int):
                self._values.append(value)
            elif value.is_cpu:
                self._values.append(_crc(value))
            else:
                positions, _ = self._pending.setdefault(value.device, ([], []))
                positions.append(len(self._values))
                elsewhere.setdefault(value.device, []).append(value)
                self._values.append(0)
        for device, tensors in elsewhere.items():
            self._pending[device][1].append(fingerprints(tensors, device))
        return first

    def begin(self, func: Any, node: Any, args: tuple, kwargs: dict) -> None:
        """Before an op runs (``node``: the autograd node running it in backward, else None):
        link inputs a recorded op made, fingerprint the others now."""
        index = len(self.ops)
        phase = self._phase
        if node is not None:
            phase = 1
            module, line = self._maker(node)
        else:
            module, line = self._modules[-1] if self._modules else "-", self.where()
            self._note_nodes((module, line))
        if (kind := _KINDS.get(func)) is None:
            kind = _KINDS[func] = _OpKind(func)
        self._kind = kind
        viewed = args[0] if kind.view and args else None
        self._base_version = viewed._version if isinstance(viewed, torch.Tensor) else 0
        strings = self.strings
        self.ops.append(
            (self.step, phase, strings.setdefault(kind.name, len(strings)),
             strings.setdefault(module, len(strings)), strings.setdefault(line, len(strings)))
        )  # fmt: skip
        leaves = _leaves(kwargs, _leaves(args, [])) if kwargs or not kind.flat else args
        fresh: list[torch.Tensor | int] = []
        origins: list[tuple[int, int]] = []
        values = []
        inputs, known_tensors, read, labels = self.inputs, self._known, self._read, self._labels
        read_now: list[tuple[int, Any, torch.Tensor]] = []  # position in fresh, key, tensor
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                key = _key(leaf)
                known = known_tensors.get(key)
                if known is not None and known[2]() is not None:  # alive: memory not reused
                    inputs.append((index, known[0], known[1], -1))
                    continue
                seen = read.get(key)
                if seen is not None and seen[3]() is not None:  # read already this step
                    inputs.append((index, seen[0], seen[1], seen[2]))
                    continue
                read_now.append((len(fresh), key, leaf))
                fresh.append(leaf)
                label = labels.get(key)
                origins.append((OUTSIDE, -1) if label is None else (LABELLED, self.text(label)))
            elif not isinstance(leaf, torch.Generator):  # its repr holds an address
                values.append(repr(leaf))
        if values:
            fresh.append(_crc(" ".join(values)))
            origins.append((PYTHON_VALUE, -1))
        if kind.random:
            fresh.append(_generator_state(leaves))
            origins.append((RNG_STATE, -1))
        if fresh:
            first = self._keep(fresh)
            for position, (origin, label) in enumerate(origins):
                inputs.append((index, first + position, origin, label))
            for position, key, leaf in read_now:
                read[key] = (first + position, *origins[position], weakref.ref(leaf))

    def end(self, out: Any) -> None:
        """After the op ran: fingerprint its outputs; later ops reading them link here."""
        index = len(self.ops) - 1
        kind = self._kind
        if isinstance(out, torch.Tensor) and out.is_cpu and not (kind.allocating or kind.view):
            # The common case, shortened: one computed CPU tensor.
            position = len(self._values)
            self._values.append(_crc(out))
            self.outputs.append((index, position))
            version = out._version + (1 if kind.written and kind.written[0] else 0)
            self._known[_key(out, version)] = (position, index, weakref.ref(out))
            return
        if isinstance(out, torch.Tensor):
            outs = [out]
        else:
            outs = [t for t in _leaves(out, []) if isinstance(t, torch.Tensor)]
        kept: list[torch.Tensor | int] = list(outs)
        if self._kind.allocating:  # the bits are whatever the memory held: only the shape counts
            kept = [_crc(repr(t.shape)) for t in outs]
        elif self._kind.view:  # its bits are its input's, compared already: only the layout
            kept = [_crc(repr((t.shape, t.stride(), t.storage_offset()))) for t in outs]
        first = self._keep(kept)
        # Versions as later readers see them: the mode runs below the layer that counts
        # versions, so an in-place op's bump and a view's sharing of its base's counter
        # have not happened yet.
        written = self._kind.written if len(self._kind.written) == len(outs) else ()
        for position, t in enumerate(outs):
            self.outputs.append((index, first + position))
            if self._kind.view:
                version = self._base_version
            else:
                version = t._version + (1 if written and written[position] else 0)
            self._known[_key(t, version)] = (first + position, index, weakref.ref(t))

    def end_step(self) -> None:
        """Fetch the step's fingerprints from each device in one go."""
        for positions, tensors in self._pending.values():
            for position, value in zip(positions, torch.cat(tensors).tolist(), strict=True):
                self._values[position] = value
        self._pending.clear()
        if not self.steps or self.steps[-1] != self.step:
            self.steps.append(self.step)

    def write(self, path: str | Path) -> None:
        """Write the window's tables to ``path`` (:func:`.opfile.write_recording`)."""
        write_recording(
            path,
            {"ops": self.ops, "inputs": self.inputs, "outputs": self.outputs},
            self._values,
            rank=self.rank,
            world_size=self.world_size,
            steps=self.steps,
            model=self.signature,
            strings=list(self.strings),
        )


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

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in torch._dynamo.disable unless this says
        # no: several microseconds per op. The handler turns Dynamo's frame callback off
        # itself, which costs a tenth of that (and its code is marked skipped, below).
        # Needed: while the handler runs, torch has popped the mode, so under torch.compile
        # Dynamo would trace the recorder's frames.
        return False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        callback = _set_eval_frame(None)
        try:
            return self._run(func, args, kwargs or {})
        finally:
            _set_eval_frame(callback)

    def _run(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if func.namespace == "profiler":  # markers
            return func(*args, **kwargs)
        node = torch._C._current_autograd_node()
        self.recording._line = None
        if node is None and self.recording.where() == "":
            return func(*args, **kwargs)  # the step trace's own fingerprints
        # The recorder's own tensor calls skip any torch-function mode (a user's).
        with torch._C.DisableTorchFunction():
            self.recording.begin(func, node, args, kwargs)
            out = func(*args, **kwargs)
            self.recording.end(out)
        return out


# Dynamo's callback sees the handler's frame before the handler can turn it off: skip it.
torch._dynamo.eval_frame.skip_code(_Dispatch.__torch_dispatch__.__code__)


def _tag_new_nodes(nodes: list[Any], tag: Any, named: dict[int, Any]) -> None:
    """Tag the custom ``autograd.Function`` nodes reachable from ``nodes`` by new nodes.

    The walk stops at a tagged node and at a node ``named`` by its sequence
    number (a built-in op's, named as it was made).
    """
    value = None
    todo = [n for n in nodes if n is not None]
    while todo:
        node = todo.pop()
        if not hasattr(node, "next_functions") or _NODE_KEY in node.metadata:
            continue
        if not isinstance(node, BackwardCFunction) and (
            node._sequence_nr() in named or node.name().endswith("AccumulateGrad")
        ):
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
        # A custom autograd.Function's nodes (no op made them) belong to this module's call.
        if torch.is_grad_enabled():
            recording._line = None
            if isinstance(out, torch.Tensor):
                nodes = [out.grad_fn]
            else:
                nodes = [t.grad_fn for t in _leaves(out, []) if isinstance(t, torch.Tensor)]
            tag = lambda: (recording.module(), recording.where())  # noqa: E731
            _tag_new_nodes(nodes, tag, recording._made)
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
    recording._read.clear()
    recording._next_node = torch._C._autograd._get_sequence_nr()  # older nodes: not this step's
    hooks = [
        nn_module.register_module_forward_pre_hook(enter),
        nn_module.register_module_forward_hook(leave),
        register_optimizer_step_pre_hook(optimizer_pre),
        register_optimizer_step_post_hook(optimizer_post),
    ]
    try:
        with _Dispatch(recording):
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
        recording.write(recording_path(recording_dir(out), 0))
        _plain.clear()


class OpRecorder(Callback):
    """Lightning callback: records the ops of the window's optimizer steps, per rank."""

    def __init__(self, steps: tuple[int, int] | None = None, out: str | Path | None = None):
        self.window = _window_from_env(steps)
        self.out = recording_dir(out)
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
            self.recording.write(recording_path(self.out, self.recording.rank))
        self.recording = None
