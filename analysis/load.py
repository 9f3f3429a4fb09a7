"""Read run directories written by the trainer into pandas tables.

The trainer may still be running, or may have crashed, while we read: a missing file means a
trial that has not started, and an unparsable metrics line is skipped instead of raised on. A
summary.json that is there but cannot be read makes its row `unreadable`, `error` the file and
why (never `pending`: it may hide a result).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pandas as pd

from harness.config import PRECISION_ALIASES, memory_label
from harness.config.metrics import REGISTRY
from harness.trials import RunsDir, Status, Summary, TrialDir, read_jsonl, read_jsonl_tail

PathArg = str | os.PathLike
Paths = PathArg | Iterable[PathArg]

# The summary's fields, in the column order the tables use (the model is the one list);
# `params` is flattened to params.* after the config's columns.
SUMMARY_FIELDS = Summary.columns()
NUMERIC_FIELDS = Summary.numeric_columns()
# Where a trial without a summary (or with nulls in it) finds the same fact in its config.
CONFIG_FALLBACKS = {
    "method": ("label", "method.name"),
    "method_name": ("method.name",),
    "lr": ("train.lr",),
    "steps": ("train.steps",),
}
STEP_COLUMNS = ("run_dir", "trial", "method", "kind", "step", "tokens")
# The token budget a trial belongs to (a sweep's `budget:`), None for one from a sweep without.
BUDGET_COLUMNS = {"budget_tokens": "train.budget.tokens", "chinchilla": "train.budget.chinchilla"}


def load_runs(paths: Paths) -> pd.DataFrame:
    """One row per trial: summary fields plus the flattened config, to group on any knob."""
    rows = [row for _, row in _trials(paths)]
    if not rows:
        return pd.DataFrame(columns=["run_dir", *SUMMARY_FIELDS])
    frame = pd.DataFrame(rows)
    for column in NUMERIC_FIELDS:
        frame[column] = pd.to_numeric(frame[column], errors="coerce")
    return frame


def load_steps(paths: Paths, trials: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per metrics.jsonl line, tagged with its trial and method label for plotting.
    Given `load_runs`' table of the same paths, the configs and summaries are not read again."""
    if trials is None:
        trials = load_runs(paths)
    rows = [
        {"run_dir": run_dir, "trial": trial, "method": method, **record}
        for run_dir, trial, method in trials[["run_dir", "trial", "method"]].itertuples(
            index=False)
        for record in read_jsonl(RunsDir(run_dir).trial(trial).metrics)
    ]
    return pd.DataFrame(rows) if rows else pd.DataFrame(columns=list(STEP_COLUMNS))


def read_sweep(run_dir: PathArg) -> dict[str, Any]:
    """The resolved sweep.yaml, or {} for a single run that has none."""
    return RunsDir(run_dir).read_sweep()


def check_runs_dir(run_dir: Path) -> None:
    """Fail early with a one-line message instead of reporting an empty sweep."""
    if not run_dir.is_dir():
        raise FileNotFoundError(f"runs directory not found: {run_dir}")
    if not RunsDir(run_dir).is_runs_dir():
        raise FileNotFoundError(f"no trials/ folder in {run_dir}: not a runs directory")


def flatten(mapping: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts become dotted keys; lists become their repr so every cell is a scalar."""
    flat: dict[str, Any] = {}
    for key, value in mapping.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}."))
        elif isinstance(value, (list, tuple)):
            flat[name] = repr(list(value))
        else:
            flat[name] = value
    return flat


def _trials(paths: Paths) -> Iterator[tuple[TrialDir, dict[str, Any]]]:
    """Yield (trial dir, row) for every trial, run dirs in the given order, trials by id."""
    for run_dir in run_dirs(paths):
        for trial_dir in RunsDir(run_dir).trial_dirs():
            yield trial_dir, _trial_row(run_dir, trial_dir)


def run_dirs(paths: Paths) -> list[Path]:
    """Accept one path or many, checking each before any is read."""
    items = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    run_dirs = [Path(item) for item in items]
    for run_dir in run_dirs:
        check_runs_dir(run_dir)
    return run_dirs


def _trial_row(run_dir: Path, trial_dir: TrialDir) -> dict[str, Any]:
    """Merge config and summary; the summary wins since it records what actually ran."""
    raw = trial_dir.read_config()
    config = flatten(raw)
    summary = trial_dir.read_summary()
    row: dict[str, Any] = {"run_dir": str(run_dir), **dict.fromkeys(SUMMARY_FIELDS), **config}
    row["memory"] = memory_label(raw.get("memory") or {})
    row["precision"] = (raw.get("train") or {}).get("precision", "32-true")
    row.update(flatten(summary.to_dict() if summary is not None else {}))
    for key in ("precision", "train.precision"):  # earlier runs wrote fp32, bf16, fp16
        if isinstance(row.get(key), str):
            row[key] = PRECISION_ALIASES.get(row[key], row[key])
    # The folder name is what a user types to find the trial's files, so it is the id.
    row["trial"] = trial_dir.name
    if summary is None:
        row["status"] = Status.PENDING
    row.update(_progress(trial_dir, row))
    for field, keys in CONFIG_FALLBACKS.items():
        if row[field] is None:
            row[field] = next((config[k] for k in keys if config.get(k) is not None), None)
    row.update({column: config.get(key) for column, key in BUDGET_COLUMNS.items()})
    return row


def _progress(trial_dir: TrialDir, row: dict[str, Any]) -> dict[str, Any]:
    """The last logged loss; a running trial's step and `live` metrics from its last lines of
    their kind: the summary of a running trial is only rewritten at its end."""
    rows = read_jsonl_tail(trial_dir.metrics)
    last = {kind: next((r for r in reversed(rows) if r.get("kind") == kind), None)
            for kind in ("train", "eval")}
    out: dict[str, Any] = {}
    if last["train"]:
        out["last_loss"] = last["train"].get("loss")
    if row.get("status") != Status.RUNNING:
        return out
    if last["train"]:
        out["step"] = last["train"].get("step")
    for metric in REGISTRY:
        line = last[metric.live] if metric.live else None
        if line:
            out[metric.name] = line.get(metric.name)
    return out
