"""The in-memory recording of a window: every op's row and fingerprints, as the steps run.

A :class:`Recording` is fed by the dispatch mode and hooks of
:mod:`reprotrain.ops.capture`, one event at a time (a step begins, a module
is entered, an op begins and ends, ...), and writes its tables with
:func:`reprotrain.ops.opfile.write_recording` when the window ends. Every
output and every input that no recorded op produced is fingerprinted: CRC-32
of the bytes for a CPU tensor (3.7 GB/s on one core here, the memory read
being most of it), and on another device :mod:`reprotrain.fingerprint`
computed there and fetched once per step. An input that a recorded op
produced keeps that op's index (its origin), so two recordings tell "same
inputs, different output" from "the inputs already differed". View ops'
outputs are fingerprinted by layout only (their bits are their input's),
allocating ops' by shape (their bits are whatever the memory held).

Limits: a tensor is recognised by its memory, layout and version counter; a
write that bypasses the counter (through ``.data``) between two reads in one
step is not seen, and a tensor whose memory is reused after it died is
fingerprinted again (its producer is checked to be alive).
"""

from __future__ import annotations

import contextlib
import ctypes
import weakref
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from reprotrain.fingerprint import fingerprints, tensor_bytes
from reprotrain.ops.location import Maker, NodeMakers, user_line
from reprotrain.ops.opfile import (
    LABELLED,
    OUTSIDE,
    PHASES,
    PYTHON_VALUE,
    RNG_STATE,
    holds_unwritten_memory,
    write_recording,
)

__all__ = ["Recording"]

FORWARD, BACKWARD, OPTIMIZER = (PHASES.index(p) for p in ("forward", "backward", "optimizer"))


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
        self.allocating = holds_unwritten_memory(self.name)
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
        self._modules: list[str] = []  # the modules (and optimizer) running now, innermost last
        self._phase = FORWARD
        self._kind: _OpKind | None = None
        self._base_version = 0  # a view op's input's version: its output shares the counter
        self.step = -1
        # The user's line of the op running now ("": the trace's), None till asked.
        self._line: str | None = None
        self._nodes = NodeMakers()

    def text(self, value: str) -> int:
        return self.strings.setdefault(value, len(self.strings))

    def label(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Name tensors no recorded op makes (parameters, the batch, optimizer state)."""
        for name, tensor in tensors:
            self._labels[_key(tensor)] = name

    # --- events, from the dispatch mode and hooks (reprotrain.ops.capture) --------------
    def begin_step(self, step: int) -> None:
        self.step = step
        self._read.clear()
        self._nodes.begin_step()  # older nodes: not this step's

    def enter_module(self, module: torch.nn.Module) -> None:
        self._modules.append(self.names.get(id(module), type(module).__name__))

    def leave_module(self, out: Any) -> None:
        # A custom autograd.Function's nodes (no op made them) belong to this module's call.
        if torch.is_grad_enabled():
            self._line = None
            if isinstance(out, torch.Tensor):
                nodes = [out.grad_fn]
            else:
                nodes = [t.grad_fn for t in _leaves(out, []) if isinstance(t, torch.Tensor)]
            self._nodes.tag_new(nodes, lambda: (self.module(), self.where()))
        if self._modules:
            self._modules.pop()

    def enter_optimizer(self, optimizer: Any) -> None:
        self._phase = OPTIMIZER
        self._modules.append(f"optimizer {type(optimizer).__name__}")

    @contextlib.contextmanager
    def closure(self) -> Iterator[None]:
        """Around the forward and backward that Lightning runs inside ``optimizer.step``."""
        self._phase, entry = FORWARD, self._modules.pop()
        try:
            yield
        finally:
            self._modules.append(entry)
            self._phase = OPTIMIZER

    def leave_optimizer(self) -> None:
        self._phase = FORWARD
        if self._modules:
            self._modules.pop()

    def leave_step(self) -> None:
        """The step is over, or failed: no module or optimizer is running."""
        self._modules.clear()
        self._phase = FORWARD

    def next_op(self, node: Any) -> bool:
        """An op reaches the mode (``node``: the autograd node running it in backward, else
        None). False when it is the step trace's own: left out."""
        self._line = None
        return node is not None or self.where() != ""

    def where(self) -> str:
        """The user's source line of the op running now ("": the step trace's)."""
        if self._line is None:
            self._line = user_line()
        return self._line

    def module(self) -> str:
        return self._modules[-1] if self._modules else "-"

    def _maker(self, node: Any) -> Maker:
        """(module, line) of the forward op that made autograd ``node``."""
        return self._nodes.maker(node) or self._accumulation(node)

    def _accumulation(self, node: Any) -> Maker:
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
            phase = BACKWARD
            module, line = self._maker(node)
        else:
            module, line = self._modules[-1] if self._modules else "-", self.where()
            self._nodes.before_forward_op((module, line))
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
            elif isinstance(leaf, torch.UntypedStorage | torch.TypedStorage):
                # Its repr prints its bytes, which may be memory never written (a deep-copied
                # metric state set_ onto a fresh storage): its size is what the op takes; the
                # bytes count where a tensor reads them.
                values.append(f"{type(leaf).__name__}(nbytes={leaf.nbytes()})")
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
