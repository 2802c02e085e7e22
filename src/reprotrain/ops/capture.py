"""What feeds a :class:`~reprotrain.ops.recording.Recording` while one step runs.

:func:`recording_step` installs a ``TorchDispatchMode`` that sees every aten op
of the thread (forward, backward and the optimizer step) and four global hooks:
module forward pre- and post-hooks (which module runs an op) and optimizer
step pre- and post-hooks (the optimizer phase; Lightning's forward and backward
run in a closure inside ``optimizer.step`` and keep their phase). The step
trace's own fingerprint ops are left out, and profiler markers pass through.

Guarantee: the mode and the hooks are entered on one ``ExitStack``; on every
way out of the step (returned, raised, or closed from outside by a Lightning
hook passing the exception) they are removed and the mode stack is as it was
before. Only a step that returned fetches its fingerprints into the recording.
Limits: ops of other threads (DataLoader workers) are not seen. Under
``torch.compile`` the mode's handler turns Dynamo's frame callback off while it
runs, so Dynamo does not trace the recorder.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch._dynamo
from torch._C._dynamo.eval_frame import set_eval_frame as _set_eval_frame
from torch.nn.modules import module as nn_module
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from reprotrain.ops.recording import Recording

__all__ = ["label_all", "label_batch", "recording_step"]


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
        if not self.recording.next_op(node):
            return func(*args, **kwargs)  # the step trace's own fingerprints
        # The recorder's own tensor calls skip any torch-function mode (a user's).
        with torch._C.DisableTorchFunction():
            self.recording.begin(func, node, args, kwargs)
            out = func(*args, **kwargs)
            self.recording.end(out)
        return out


# Dynamo's callback sees the handler's frame before the handler can turn it off: skip it.
torch._dynamo.eval_frame.skip_code(_Dispatch.__torch_dispatch__.__code__)


def _optimizer_pre(recording: Recording) -> Any:
    def optimizer_pre(optimizer: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        recording.enter_optimizer(optimizer)
        # args[0] is the optimizer itself (the hook sees the wrapped method's arguments)
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is None:
            return None

        def forward_and_backward() -> Any:  # Lightning runs its step inside optimizer.step
            with recording.closure():
                return closure()

        if "closure" in kwargs:
            return args, {**kwargs, "closure": forward_and_backward}
        return (args[0], forward_and_backward, *args[2:]), kwargs

    return optimizer_pre


@contextlib.contextmanager
def recording_step(recording: Recording, step: int) -> Iterator[None]:
    """Record every op of one step into ``recording``; everything installed goes on exit."""
    recording.begin_step(step)
    with contextlib.ExitStack() as installed:
        installed.callback(recording.leave_step)  # last out: no module is left running
        hooks: tuple[tuple[Any, Any], ...] = (
            (nn_module.register_module_forward_pre_hook, lambda m, _: recording.enter_module(m)),
            (nn_module.register_module_forward_hook, lambda _m, _a, o: recording.leave_module(o)),
            (register_optimizer_step_pre_hook, _optimizer_pre(recording)),
            (register_optimizer_step_post_hook, lambda *_: recording.leave_optimizer()),
        )
        for register, hook in hooks:
            installed.callback(register(hook).remove)
        installed.enter_context(_Dispatch(recording))
        yield
    recording.end_step()  # only a step that returned: fetch its fingerprints


def _optimizer_labels(optimizer: Any, names: dict[int, str]) -> Iterator[tuple[str, torch.Tensor]]:
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                yield f"optimizer state {key} of {names.get(id(param), 'a parameter')}", value


def label_all(recording: Recording, model: torch.nn.Module, optimizers: Iterable[Any]) -> None:
    """Name the model's parameters and buffers and the optimizers' state in ``recording``."""
    params = {id(p): n for n, p in model.named_parameters()}
    recording.label((f"parameter {n}", p) for n, p in model.named_parameters())
    recording.label((f"buffer {n}", b) for n, b in model.named_buffers())
    for optimizer in optimizers:
        recording.label(_optimizer_labels(optimizer, params))


def label_batch(recording: Recording, batch: Any) -> None:
    """Name every tensor of ``batch`` as the batch, so an op that reads one says so."""
    recording.label(("batch", t) for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor))
