"""Cell and table formatting shared by the report's tables."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pandas as pd

from harness.config.metrics import BYTES, METRICS, human_bytes

# What tells two configurations of one method apart in every table and figure, with the value
# a trial from before the column existed (or with it unset) gets.
VARIANT_DEFAULTS = {"method": "unknown", "memory": "none", "precision": "32-true"}


def text_table(table: pd.DataFrame) -> str:
    """Markdown (github) table; numbers are pre-formatted, so tabulate must not re-parse them."""
    return table.fillna("").to_markdown(index=False, disable_numparse=True)


def ordered(labels: pd.Series, order: Sequence[str]) -> list[str]:
    """Sweep order first (how the author listed methods), the rest alphabetically."""
    present = set(labels)
    return [m for m in order if m in present] + sorted(present - set(order))


def cell(value: Any, spec: str, unit: str = "") -> str:
    """A number formatted for a table cell; blank where it is missing."""
    return "" if pd.isna(value) else f"{value:{spec}}{unit}"


def metric_cell(name: str, value: Any) -> str:
    """A metric's value as the registry formats it (harness/config/metrics.py)."""
    metric = METRICS[name]
    if pd.isna(value):
        return metric.missing
    return human_bytes(value) if metric.spec == BYTES else cell(value, metric.spec)


def metric_cells(name: str, values: pd.Series) -> pd.Series:
    return values.map(lambda v: metric_cell(name, v))


def with_derived(trials: pd.DataFrame) -> pd.DataFrame:
    """The registry's derived metrics (trial_hours from wall_s) as columns, NaN where their
    source is missing."""
    derived = {m.name: m.derived for m in METRICS.values() if m.derived}
    return trials.assign(**{
        name: pd.to_numeric(trials[key], errors="coerce") * factor if key in trials
        else float("nan") for name, (key, factor) in derived.items()})


def whole(value: Any, missing: str) -> str:
    """A count (a step, a seed, requeues) as a whole number; `missing` where there is none."""
    return missing if pd.isna(value) else str(int(value))


def fill_variants(trials: pd.DataFrame) -> pd.DataFrame:
    """The variant columns filled with their defaults, so grouping on them drops nothing."""
    return trials.assign(**{k: trials[k].fillna(d) for k, d in VARIANT_DEFAULTS.items()})


def variant_label(method: str, memory: str, precision: str) -> str:
    """"galore", or "galore (offload mlp, bf16-mixed)" when it departs from the defaults."""
    extra = [value for value, key in ((memory, "memory"), (precision, "precision"))
             if value != VARIANT_DEFAULTS[key]]
    return f"{method} ({', '.join(extra)})" if extra else method
