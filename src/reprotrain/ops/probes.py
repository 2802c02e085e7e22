"""Which torch operations repeat bit for bit on this device, and what determinism does to them.

:func:`probe_op` measures one operation (an :class:`OpCase`; the catalog of
ops with non-deterministic default paths is :data:`reprotrain.ops.catalog.CATALOG`)
on the current device, with nothing taken from a table:

* default mode (``use_deterministic_algorithms(False)``): ``repeats`` calls on
  the same inputs; identical bits every time or not, and the largest difference
  from the first call;
* deterministic mode (``use_deterministic_algorithms(True)``): torch raises
  (its message is kept), or it runs, twice, identical or not; when it raises,
  the op is run once more with ``warn_only=True`` to keep torch's warning;
* the time ratio deterministic / default (median of ``repeats`` calls).

Limits: a few calls say "identical" when the bits matched those times; a
rare race can hide (on a 2-core CPU, ``put_(accumulate=True)`` differed in
only some probes). Inputs are modest (the catalog must run in
seconds on a CPU), so a GPU kernel that only goes non-deterministic at
large sizes can look identical here. The global determinism flags are
restored after each probe.
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

Thunk = Callable[[], Sequence[torch.Tensor]]
Builder = Callable[[torch.device, torch.Generator], Thunk]


@dataclass(frozen=True)
class OpCase:
    """One catalog entry: ``build(device, generator)`` makes inputs and returns the call."""

    name: str
    build: Builder


@dataclass
class OpResult:
    """What :func:`probe_op` measured for one op on one device."""

    name: str
    device: str
    default: str  # "identical", "differs" or "error"
    default_max_abs_diff: float | None = None
    deterministic: str = ""  # "raises", "warns", "runs, identical", "runs, differs", "error"
    message: str | None = None  # torch's raise text, or its warning
    warning: str | None = None  # torch's warning with warn_only=True
    default_s: float | None = None
    deterministic_s: float | None = None
    time_ratio: float | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _call(thunk: Thunk, device: torch.device) -> tuple[tuple[torch.Tensor, ...], float]:
    _sync(device)
    start = time.perf_counter()
    out = tuple(t.detach() for t in thunk())
    _sync(device)
    return out, time.perf_counter() - start


def _max_abs_diff(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    diffs = [
        float((x.double() - y.double()).abs().max()) if x.numel() else 0.0
        for x, y in zip(a, b, strict=True)
    ]
    return max(diffs, default=0.0)


def _same(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _repeat(thunk: Thunk, device: torch.device, repeats: int) -> tuple[list[Any], float]:
    """The outputs of ``max(repeats, 2)`` calls and their median time."""
    outs, times = [], []
    for _ in range(max(repeats, 2)):
        out, seconds = _call(thunk, device)
        outs.append(out)
        times.append(seconds)
    return outs, statistics.median(times)


def _all_same(outs: list[Any]) -> bool:
    return all(_same(outs[0], other) for other in outs[1:])


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else text


def probe_op(case: OpCase, device: torch.device, repeats: int = 5, seed: int = 0) -> OpResult:
    """Measure ``case`` on ``device`` in default and deterministic mode (module docstring)."""
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    result = OpResult(case.name, str(device), default="error")
    try:
        torch.use_deterministic_algorithms(False)
        thunk = case.build(device, torch.Generator().manual_seed(seed))
        try:
            outs, result.default_s = _repeat(thunk, device, repeats)
        except RuntimeError as err:
            result.message = _first_line(str(err))
            result.deterministic = "error"
            result.notes.append("the op fails on this device even in default mode")
            return result
        result.default = "identical" if _all_same(outs) else "differs"
        result.default_max_abs_diff = max(_max_abs_diff(outs[0], o) for o in outs[1:])

        torch.use_deterministic_algorithms(True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                outs, result.deterministic_s = _repeat(thunk, device, repeats)
            except RuntimeError as err:
                result.deterministic = "raises"
                result.message = _first_line(str(err))
        if result.deterministic != "raises":
            alerts = [str(w.message) for w in caught if "determinis" in str(w.message)]
            same = _all_same(outs)
            result.deterministic = (
                "warns" if alerts else f"runs, {'identical' if same else 'differs'}"
            )
            result.message = _first_line(alerts[0]) if alerts else None
            result.time_ratio = (
                result.deterministic_s / result.default_s if result.default_s else None
            )
            return result
        torch.use_deterministic_algorithms(True, warn_only=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _call(thunk, device)
        alerts = [str(w.message) for w in caught if "determinis" in str(w.message)]
        result.warning = _first_line(alerts[0]) if alerts else None
        return result
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])


def probe_catalog(
    device: torch.device, cases: Sequence[OpCase], repeats: int = 5
) -> list[OpResult]:
    """:func:`probe_op` for every case, in order."""
    return [probe_op(case, device, repeats) for case in cases]
