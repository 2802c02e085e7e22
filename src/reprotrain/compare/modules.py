"""Name the module that makes one training step non-deterministic.

``locate_divergence`` runs one forward and backward pass twice on the same
batch, from the same parameters and buffers, seeding python, numpy and torch
identically before each run. Forward hooks keep every submodule's output;
full backward hooks keep each submodule's gradient output and input; each
parameter's ``.grad`` is kept after backward. The answer is the first module
whose forward output differs (in completion order, so an inner module comes
before the module that contains it); else the loss; else the first module,
in backward execution order, whose gradients differ; else "identical".

Guarantee: seeded randomness (dropout, random augmentation inside the model)
draws the same numbers in both runs, so only behaviour that is
non-deterministic for a fixed seed is reported. Comparisons are bitwise (NaN
payloads and -0.0 count), and the caller's RNG states are restored afterwards.

Limits: one step only, so non-determinism that starts later, lives in the
optimizer, or depends on state the step changes is out of reach (a trace from
:class:`reprotrain.trace.callback.TraceCallback` finds the step first). A gradient that
already differs where it reaches a module (``grad_output``) points at code
between modules: functional operations in a parent's ``forward`` or the loss.
Modules' ``inplace`` flags are switched off during the check, because full
backward hooks forbid in-place changes of a hooked output; in-place tensor
methods called inside ``forward`` still make torch raise. Both runs are kept in
memory (every activation and gradient), so use a small batch.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from reprotrain.fingerprint import tensor_bytes
from reprotrain.seeding import seed_all

__all__ = ["LocateResult", "locate_divergence"]

Tensors = list[torch.Tensor | None]


@dataclass(frozen=True)
class LocateResult:
    """The first place two identical-seeming steps part; ``identical`` if they never do."""

    identical: bool
    phase: Literal["forward", "loss", "backward"] | None = None
    module: str | None = None
    module_type: str | None = None
    what: str | None = None
    call: int = 0
    max_abs_diff: float | None = None

    def __str__(self) -> str:
        if self.identical:
            return "identical: forward outputs, loss and gradients have the same bits"
        where = "the loss function" if self.module is None else self.module or "<root>"
        kind = f" ({self.module_type})" if self.module_type else ""
        return (
            f"{self.phase} differs first at {where}{kind}: {self.what}, call {self.call}, "
            f"max |a-b| {self.max_abs_diff:.3g}"
        )


@dataclass
class _Run:
    forward: list[tuple[str, int, Tensors]] = field(default_factory=list)
    backward: list[tuple[str, int, Tensors, Tensors]] = field(default_factory=list)
    grads: dict[str, torch.Tensor | None] = field(default_factory=dict)
    loss: torch.Tensor | None = None


def _tensors(value: Any) -> Iterator[torch.Tensor | None]:
    if isinstance(value, torch.Tensor) or value is None:
        yield None if value is None else value.detach().clone()
    elif isinstance(value, Mapping):
        for key in sorted(value, key=str):
            yield from _tensors(value[key])
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _run_once(
    module: nn.Module,
    state: Mapping[str, torch.Tensor],
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], Any],
    seed: int,
) -> _Run:
    module.load_state_dict(state)
    module.train()
    for param in module.parameters():
        param.grad = None
    run, forward_calls, backward_calls = _Run(), {}, {}
    names = {id(m): name for name, m in module.named_modules()}

    def on_forward(mod: nn.Module, _: Any, output: Any) -> None:
        name = names[id(mod)]
        forward_calls[name] = forward_calls.get(name, -1) + 1
        run.forward.append((name, forward_calls[name], list(_tensors(output))))

    def on_backward(mod: nn.Module, grad_input: Any, grad_output: Any) -> None:
        name = names[id(mod)]
        backward_calls[name] = backward_calls.get(name, -1) + 1
        run.backward.append(
            (name, backward_calls[name], list(_tensors(grad_output)), list(_tensors(grad_input)))
        )

    handles = []
    for mod in module.modules():
        handles.append(mod.register_forward_hook(on_forward))
        handles.append(mod.register_full_backward_hook(on_backward))
    try:
        seed_all(seed)
        out = loss_fn(module, batch)
        loss = out["loss"] if isinstance(out, Mapping) else out
        run.loss = loss.detach().clone()
        with warnings.catch_warnings():
            # Expected for modules whose inputs need no gradient (the first layer): their
            # hook still reports grad_output, which is all we need there.
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            loss.backward()
    finally:
        for handle in handles:
            handle.remove()
    run.grads = {
        n: None if p.grad is None else p.grad.clone() for n, p in module.named_parameters()
    }
    return run


def _difference(a: Tensors, b: Tensors) -> tuple[int, float] | None:
    """(index, max abs diff) of the first tensor whose bits differ; None when all agree."""
    for index in range(max(len(a), len(b))):
        ta = a[index] if index < len(a) else None
        tb = b[index] if index < len(b) else None
        if ta is None and tb is None:
            continue
        if ta is None or tb is None or ta.shape != tb.shape or ta.dtype != tb.dtype:
            return index, float("inf")
        if not torch.equal(tensor_bytes(ta), tensor_bytes(tb)):
            delta = (ta.double() - tb.double()).abs()
            return index, float(delta.max()) if delta.numel() else 0.0
    return None


def _compare(root: nn.Module, a: _Run, b: _Run) -> LocateResult:
    types = {name: type(m).__name__ for name, m in root.named_modules()}

    def found(phase: Any, name: str | None, what: str, call: int, diff: float) -> LocateResult:
        kind = None if name is None else types.get(name)
        return LocateResult(False, phase, name, kind, what, call, diff)

    for (name, call, out_a), (name_b, _, out_b) in zip(a.forward, b.forward, strict=False):
        if name != name_b:
            return found("forward", name, f"control flow differs: then {name_b!r}", call, 0.0)
        if hit := _difference(out_a, out_b):
            return found("forward", name, f"output {hit[0]}", call, hit[1])
    if len(a.forward) != len(b.forward):
        return found("forward", None, "number of module calls differs", 0, 0.0)
    if hit := _difference([a.loss], [b.loss]):
        return found("loss", None, "loss_fn output (outside every module)", 0, hit[1])
    checked: set[str] = set()
    for (name, call, go_a, gi_a), (_, _, go_b, gi_b) in zip(a.backward, b.backward, strict=False):
        if hit := _difference(go_a, go_b):
            what = f"grad_output {hit[0]} (differs on arrival: code after this module)"
            return found("backward", name, what, call, hit[1])
        if hit := _difference(gi_a, gi_b):
            return found("backward", name, f"grad_input {hit[0]}", call, hit[1])
        if name not in checked:
            checked.add(name)
            if result := _param_grads(root, name, a, b, found):
                return result
    for name in types:  # parameters whose module's backward hook never fired
        if name not in checked and (result := _param_grads(root, name, a, b, found)):
            return result
    return LocateResult(identical=True)


def _param_grads(
    root: nn.Module, name: str, a: _Run, b: _Run, found: Callable[..., LocateResult]
) -> LocateResult | None:
    prefix = f"{name}." if name else ""
    for param_name, _ in root.get_submodule(name).named_parameters(recurse=False):
        full = prefix + param_name
        if hit := _difference([a.grads.get(full)], [b.grads.get(full)]):
            return found("backward", name, f"gradient of parameter {param_name!r}", 0, hit[1])
    return None


def locate_divergence(
    make_module: Callable[[], nn.Module],
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], Any],
    *,
    seed: int,
) -> LocateResult:
    """Run one training step twice and name the first module whose results differ.

    ``make_module()`` builds the model (called twice; the second copy is loaded
    with the first one's state, so initialisation need not be seeded).
    ``loss_fn(module, batch)`` returns the loss tensor or a mapping with
    ``"loss"``; for a LightningModule, ``lambda m, b: m.training_step(b, 0)``.
    """
    saved = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    saved_cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        first = make_module()
        state = {k: v.detach().clone() for k, v in first.state_dict().items()}
        second = make_module()
        inplace = [m for m in (*first.modules(), *second.modules()) if _inplace(m)]
        for mod in inplace:
            mod.inplace = False
        try:
            run_a = _run_once(first, state, batch, loss_fn, seed)
            run_b = _run_once(second, state, batch, loss_fn, seed)
        finally:
            for mod in inplace:
                mod.inplace = True
        return _compare(first, run_a, run_b)
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch.set_rng_state(saved[2])
        if saved_cuda is not None:
            torch.cuda.set_rng_state_all(saved_cuda)


def _inplace(module: nn.Module) -> bool:
    return getattr(module, "inplace", None) is True
