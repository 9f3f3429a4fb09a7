"""The same tuning for every method: the settings a method's config marks tunable (`tunable`,
read back by `tunables`), and the sweep's `tuning:` key that tunes each method's learning rate
and those settings by one procedure with one trial budget (harness/sweep/search/tuned.py)."""

from __future__ import annotations

import itertools
import math
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from harness.config.strict import Strict

TUNABLE = "tunable"  # the key of a tunable field's json_schema_extra: its ladder of values
LADDER_FACTOR = 2.0  # coordinate descent's LR ladder: neighbours are 0.5x and 2x
RATIO_TOLERANCE = 1e-6  # YAML's decimal LRs are not exact binary multiples of each other


def tunable(default: Any, *, values: list[Any], source: str, description: str,
            **constraints: Any) -> Any:
    """A config field that a sweep's `tuning:` varies over `values` (ordered: neighbours on the
    list are neighbours on the ladder), its default among them; `source` says where the values
    come from. `harness methods` shows them."""
    if default not in values:
        raise ValueError(f"tunable default {default!r} is not among its values {values!r}")
    return Field(default, description=f"{description}; tuned over {values} ({source})",
                 json_schema_extra={TUNABLE: list(values)}, **constraints)


def tunables(config: type[BaseModel]) -> dict[str, list[Any]]:
    """A config class's tunable fields, each with its ladder, in field order."""
    out = {}
    for name, field in config.model_fields.items():
        extra = field.json_schema_extra
        if isinstance(extra, dict) and TUNABLE in extra:
            out[name] = list(extra[TUNABLE])  # type: ignore[arg-type]
    return out


class TuningConfig(Strict):
    procedure: Literal["grid", "optuna", "coordinate"] = Field(
        description="grid: every LR of `lr`, other settings at their defaults; optuna: TPE over "
        "the LR range and the method's tunables; coordinate: marin's coordinate descent "
        "(arXiv 2509.02046 §3) over the LR ladder and the tunables' ladders")
    trials: int | None = Field(
        None, ge=1, description="configurations per method and budget (each run once per "
        "seed); grid: len(lr), which it defaults to")
    lr: list[float] = Field(
        min_length=1, description="the learning rates, ascending; coordinate: a factor-2 "
        "ladder (each twice the one before); optuna: its lowest and highest bound a log range")

    @model_validator(mode="after")
    def _fits_procedure(self) -> TuningConfig:
        lr = self.lr
        if any(not (math.isfinite(x) and x > 0) for x in lr) or lr != sorted(set(lr)):
            raise ValueError(f"lr: {lr} must be positive, distinct and ascending")
        if self.procedure == "grid":
            if self.trials not in (None, len(lr)):
                raise ValueError(f"trials: {self.trials} with procedure grid, which runs each "
                                 f"LR of lr once (allowed: {len(lr)} or unset)")
        elif self.trials is None:
            raise ValueError(f"trials is required with procedure {self.procedure} (the "
                             "configurations each method gets per budget)")
        if self.procedure == "optuna" and len(lr) < 2:
            raise ValueError("lr: optuna searches between its lowest and highest value: give two")
        if self.procedure == "coordinate":
            for low, high in itertools.pairwise(lr):
                if abs(high / low / LADDER_FACTOR - 1) > RATIO_TOLERANCE:
                    raise ValueError(f"lr: {high} after {low} is not twice it; coordinate "
                                     "descent steps a factor-2 ladder (e.g. [2.5e-4, 5e-4, "
                                     "1e-3, 2e-3])")
        return self
