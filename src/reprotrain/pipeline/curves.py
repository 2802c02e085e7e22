"""A Lightning logger that keeps metrics in memory for DVC plots and metrics.

Lightning's CSV and TensorBoard loggers write into ``version_N`` folders and
stamp wall-clock times; neither may reach a file whose hash DVC compares. This
one only collects ``(step, name, value)`` and lets the stage write them.
:class:`CurveCheckpoint` keeps the rows in checkpoints, so a resumed run's
curves are those of an uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning as L
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import rank_zero_only


class MemoryLogger(Logger):
    """Collects logged scalars; ``rows(name)`` returns ``[(step, value), ...]``."""

    def __init__(self) -> None:
        super().__init__()
        self._rows: list[tuple[int, str, float]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> str:
        return "0"

    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        """Hyperparameters are recorded by the stage itself, not here."""

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        for name, value in metrics.items():
            if name != "epoch":
                self._rows.append((int(step or 0), name, float(value)))

    def rows(self, name: str) -> list[tuple[int, float]]:
        return [(step, value) for step, metric, value in self._rows if metric == name]


class CurveCheckpoint(L.Callback):
    """Saves a :class:`MemoryLogger`'s rows with each checkpoint and restores them on resume."""

    def __init__(self, logger: MemoryLogger) -> None:
        self.logger = logger

    def state_dict(self) -> dict[str, Any]:
        return {"rows": [list(row) for row in self.logger._rows]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.logger._rows = [(int(s), str(n), float(v)) for s, n, v in state["rows"]]
