"""The trials table `harness status` prints, and its --json records: it needs no figure, so a
status process (and a sweep, which counts its trials' statuses at its end) loads neither
matplotlib nor scipy for it: their imports would be most of its start-up. Its metric columns
are the registry's marked `status` (harness/config/metrics.py)."""

from __future__ import annotations

import pandas as pd

from harness.config.metrics import METRICS, STATUS

from .format import metric_cells, text_table, whole
from .unreadable import unreadable_lines

# `harness status --json`: one record per trial with these keys (null where not reported).
STATUS_KEYS = ["trial", "method", "memory", "status", "step", "steps", *STATUS,
               "final_model_dropped", "error"]


def status_table(trials: pd.DataFrame) -> str:
    """Per-trial progress for `harness status`, readable while a sweep is still running; then
    one line for each trial whose summary.json cannot be read, naming the file and why."""
    table = pd.DataFrame(
        {
            "id": trials["trial"],
            "method": trials["method"],
            "memory": trials["memory"].fillna("none"),
            "status": trials["status"],
            "step": [
                f"{whole(step, '0')}/{whole(steps, '?')}"
                for step, steps in zip(trials["step"], trials["steps"], strict=True)
            ],
            **{METRICS[name].header: metric_cells(name, trials[name]) for name in STATUS},
        }
    )
    if "final_model_dropped" in trials:  # its sweep's keep_models dropped it: not missing
        why, header = trials["final_model_dropped"], METRICS["final_model_bytes"].header
        table[header] = table[header].where(why.isna(), "dropped (" + why.astype(str) + ")")
    return "\n".join([text_table(table), *unreadable_lines(trials)])


def status_records(trials: pd.DataFrame) -> str:
    """The trials as JSON records of STATUS_KEYS; pandas writes a missing value as null."""
    return trials.reindex(columns=STATUS_KEYS).to_json(orient="records", indent=2)
