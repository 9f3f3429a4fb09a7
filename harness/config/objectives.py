"""What a search optimizes: one or several objectives read from a trial's summary, and the
constraints a trial must meet to count as feasible (Optuna's constrained sampling)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field

from harness.config.metrics import EVALUATED, METRICS, OBJECTIVES, Direction
from harness.config.strict import Strict

ObjectiveName = Literal[OBJECTIVES]  # type: ignore[valid-type]  # the registry's metrics
EvaluatedName = Literal[EVALUATED]  # type: ignore[valid-type]  # known at each evaluation
UNITS = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20,
         "gib": 2**30, "tib": 2**40}  # fmt: skip


class Objective(Strict):
    metric: ObjectiveName = Field(description="trial_hours: the trial's wall time in hours")
    direction: Direction = "minimize"


def size(text: str, bare: bool = True) -> float | None:
    """'24GB', '24 GB', '24GiB', '16000MB' -> bytes (GB = 1e9, GiB = 2**30), and a bare
    number as itself when `bare`; None when it is not one (or is infinite: 400 digits)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = (1 if bare else None) if match and not match.group(2) else \
        UNITS.get(match.group(2).lower()) if match else None
    value = float(match.group(1)) * unit if match and unit else None
    return value if value is not None and math.isfinite(value) else None


@dataclass(frozen=True)
class Constraint:
    """`metric op limit`: feasible when the metric is at or below (`<=`) or at or above (`>=`)
    the limit."""

    metric: str
    op: str
    limit: float
    value: str  # the limit as written: the constraint's name in the study ("24GB")

    @classmethod
    def parse(cls, text: str, where: str) -> Constraint:
        match = re.fullmatch(r"\s*(\w+)\s*(<=|>=)\s*(.+?)\s*", text)
        if not match or match.group(1) not in OBJECTIVES or size(match.group(3)) is None:
            raise ValueError(f"{where}: {text!r} is not a constraint (allowed: METRIC <= VALUE or "
                             f"METRIC >= VALUE, METRIC one of {', '.join(OBJECTIVES)}, VALUE a "
                             "number or a size such as 24GB)")
        metric, op, value = match.groups()
        return cls(metric, op, size(value), value)  # type: ignore[arg-type]

    @property
    def key(self) -> str:
        return f"{self.metric} {self.op} {self.value}"

    def violation(self, value: float) -> float:
        """Optuna's convention: at or below 0 when the trial meets it, by how much it misses."""
        return value - self.limit if self.op == "<=" else self.limit - value


def objective_value(summary: dict[str, Any], metric: str) -> float | None:
    """The metric of a finished trial's summary; a derived one (trial_hours) from its source."""
    key, factor = METRICS[metric].derived or (metric, 1.0)
    value = summary.get(key)
    return None if value is None else float(value) * factor
