"""GLUE fine-tuning results in the format of GaLore's Table 4: one row per method, one column
per task, each cell the method's score on that task at its own best learning rate.

The protocol the papers report: each task keeps its best epoch (`best_eval_score`), the LR is
tuned per task (highest mean over seeds), and the row's average is over its tasks.
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd

from harness.config.metrics import METRICS, human_bytes

from .format import ordered
from .paper import task_kind
from .stats import at_best_lr

# GaLore Table 4's column order, then the embedded task; keys are `task.glue_task` values.
TASKS = {
    "cola": "CoLA", "stsb": "STS-B", "mrpc": "MRPC", "rte": "RTE", "sst2": "SST-2",
    "mnli": "MNLI", "qnli": "QNLI", "qqp": "QQP", "sample": "Sample",
}  # fmt: skip
GLUE_TITLE = "GLUE (GaLore Table 4 format)"
GLUE_NOTE = (
    "Each cell: the task's GLUE score (%) at its best epoch, at the LR (chosen per method and "
    "task) with the highest mean over seeds; avg: over the tasks with a value; memory: the "
    "highest peak memory among the chosen trials; tok/s: their mean training throughput."
)


def has_glue(trials: pd.DataFrame) -> bool:
    """Whether any trial fine-tuned on GLUE, so pretraining-only reports stay as they were."""
    return bool((task_kind(trials) == "glue").any())


def glue_table(trials: pd.DataFrame, order: Sequence[str] = ()) -> pd.DataFrame:
    """Methods as rows (those named in `order` first), tasks in the paper's order as columns,
    then `avg`, `memory` and `tok/s` (mean over the chosen trials); cells are formatted
    strings, blank where nothing finished."""
    glue = trials[task_kind(trials) == "glue"]
    glue = glue.assign(score=_scores(glue), method=glue["method"].astype(str))
    present = set(glue.get("task.glue_task", pd.Series(dtype=str)))
    tasks = [task for task in TASKS if task in present]
    rows = [
        _method_row(label, glue[glue["method"] == label], tasks)
        for label in ordered(glue["method"], order)
    ]
    columns = ["method", *(TASKS[t] for t in tasks), "avg", "memory", "tok/s"]
    return pd.DataFrame(rows, columns=columns)


def _scores(trials: pd.DataFrame) -> pd.Series:
    """The best epoch's score; the final one for a trial that recorded no best."""
    return _numeric(trials, "best_eval_score").fillna(_numeric(trials, "eval_score"))


def _numeric(trials: pd.DataFrame, column: str) -> pd.Series:
    """A summary key only trials of some kinds write: NaN where (or when) it is missing."""
    if column not in trials:
        return pd.Series(float("nan"), index=trials.index)
    return pd.to_numeric(trials[column], errors="coerce")


def _method_row(label: str, group: pd.DataFrame, tasks: list[str]) -> dict[str, str]:
    """One method's cells; a task without a finished trial stays blank and out of the avg."""
    picks = {task: _best_lr(group[group["task.glue_task"] == task]) for task in tasks}
    chosen = pd.DataFrame([pick for pick in picks.values() if pick is not None])
    row = {"method": label}
    row.update({TASKS[t]: "" if p is None else f"{p['mean']:.2f}" for t, p in picks.items()})
    row["avg"] = "" if chosen.empty else f"{chosen['mean'].mean():.2f}"
    row["memory"] = "" if chosen.empty else human_bytes(chosen["peak"].max())
    row["tok/s"] = "" if chosen.empty else f"{chosen['rate'].mean():,.0f}"
    return row


def _best_lr(group: pd.DataFrame) -> pd.Series | None:
    """Mean score, max peak memory and mean tok/s at the LR with the highest mean score."""
    return at_best_lr(group, "score", minimize=False, peak=_folded("peak_memory_bytes"),
                      rate=_folded("tokens_per_s"))


def _folded(metric: str) -> tuple[str, str]:
    """The metric's column and how the registry folds its seeds."""
    return metric, METRICS[metric].across_seeds
