"""Everything known about two runs in one report: trace, weights, environment, inputs.

``ComparisonReport`` holds the first diverging step (:mod:`reprotrain.trace.diff`),
the per-tensor weight differences (:mod:`reprotrain.compare.weights`), the
environment fields that differ and whether one voids the bitwise guarantee,
and the run inputs that differ (:mod:`reprotrain.provenance.envdiff`). ``to_text()`` is for
people; ``to_dict()`` is JSON-ready (inf and NaN as strings).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from reprotrain.compare.weights import TensorDiff, weights_table
from reprotrain.provenance.envdiff import EnvDiff, InputDiff
from reprotrain.trace.diff import TraceDiff

__all__ = ["ComparisonReport"]


def _json_safe(row: dict[str, Any]) -> dict[str, Any]:
    """inf / NaN as strings, so strict JSON writers (``canonical_json``) accept the report."""
    return {
        k: str(v) if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()
    }


@dataclass(frozen=True)
class ComparisonReport:
    """Everything known about two runs; ``to_text()`` for people, ``to_dict()`` for JSON."""

    trace: TraceDiff | None = None
    weights: list[TensorDiff] = field(default_factory=list)
    environment: list[EnvDiff] = field(default_factory=list)
    inputs: list[InputDiff] = field(default_factory=list)

    @property
    def guarantee_applies(self) -> bool:
        """False when an environment difference voids the bitwise guarantee."""
        return not any(d.voids for d in self.environment)

    def to_dict(self) -> dict[str, Any]:
        return {
            "trace": None if self.trace is None else self.trace.to_dict(),
            "weights": [_json_safe({**asdict(d), "equal": d.equal}) for d in self.weights],
            "weights_equal": all(d.equal for d in self.weights) if self.weights else None,
            "environment": [{**asdict(d), "voids": d.voids} for d in self.environment],
            "inputs": [asdict(d) for d in self.inputs],
            "guarantee_applies": self.guarantee_applies,
        }

    def to_text(self) -> str:
        parts = []
        if self.inputs:  # first: where the runs had other inputs, they are the explanation
            parts.append(f"run inputs that differ ({len(self.inputs)}), the likely explanation:")
            parts += [f"  {d.to_text()}" for d in self.inputs]
        if self.trace is not None:
            trace = self.trace.to_text()
            if self.inputs and not self.trace.identical:
                trace += "\n  (the diagnosis reads the fingerprints as if the inputs were equal)"
            parts.append(trace)
        if self.weights:
            equal = sum(d.equal for d in self.weights)
            parts.append(f"final weights: {equal}/{len(self.weights)} tensors bitwise equal")
            parts.append(weights_table(self.weights))
        if self.environment:
            verdict = "applies" if self.guarantee_applies else "VOID"
            parts.append(f"environment: {len(self.environment)} differences, guarantee {verdict}")
            parts += [f"  {d.to_text()}" for d in self.environment]
        return "\n".join(parts) or "nothing compared"

    def __str__(self) -> str:
        return self.to_text()
