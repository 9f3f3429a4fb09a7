"""Read run directories written by the trainer into pandas tables.

The trainer may still be running, or may have crashed, while we read: a missing file means a
trial that has not started, and an unparsable line or file is skipped instead of raised on.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from harness.config import memory_label
from harness.trials import read_json, read_jsonl

PathArg = str | os.PathLike
Paths = PathArg | Iterable[PathArg]

# summary.json fields, in the column order the tables use; `params` is flattened to params.*.
SUMMARY_FIELDS = (
    "trial", "status", "method", "method_name", "lr", "seed", "model", "steps", "step",
    "tokens", "eval_loss", "eval_ppl", "tokens_per_s", "mfu", "peak_memory_bytes",
    "param_bytes", "grad_bytes", "optimizer_state_bytes", "trainable_params", "total_params",
    "wall_s", "device", "error", "requeues", "last_loss", "memory", "precision", "extra_bytes",
    "skipped_steps", "offloaded_bytes_per_step",
)  # fmt: skip
NUMERIC_FIELDS = (
    "lr", "steps", "step", "tokens", "eval_loss", "eval_ppl", "tokens_per_s", "mfu",
    "peak_memory_bytes", "param_bytes", "grad_bytes", "optimizer_state_bytes",
    "trainable_params", "total_params", "wall_s", "requeues", "last_loss", "extra_bytes",
    "skipped_steps", "offloaded_bytes_per_step",
)  # fmt: skip
# Where a trial without a summary (or with nulls in it) finds the same fact in its config.
CONFIG_FALLBACKS = {
    "method": ("label", "method.name"),
    "method_name": ("method.name",),
    "lr": ("train.lr",),
    "steps": ("train.steps",),
}
STEP_COLUMNS = ("run_dir", "trial", "method", "kind", "step", "tokens")


def load_runs(paths: Paths) -> pd.DataFrame:
    """One row per trial: summary fields plus the flattened config, to group on any knob."""
    rows = [row for _, row in _trials(paths)]
    if not rows:
        return pd.DataFrame(columns=["run_dir", *SUMMARY_FIELDS])
    frame = pd.DataFrame(rows)
    for column in NUMERIC_FIELDS:
        frame[column] = pd.to_numeric(frame[column], errors="coerce")
    return frame


def load_steps(paths: Paths) -> pd.DataFrame:
    """One row per metrics.jsonl line, tagged with its trial and method label for plotting."""
    rows = [
        {"run_dir": row["run_dir"], "trial": row["trial"], "method": row["method"], **record}
        for trial_dir, row in _trials(paths)
        for record in read_jsonl(trial_dir / "metrics.jsonl")
    ]
    return pd.DataFrame(rows) if rows else pd.DataFrame(columns=list(STEP_COLUMNS))


def read_sweep(run_dir: PathArg) -> dict[str, Any]:
    """The resolved sweep.yaml, or {} for a single run that has none."""
    return _read_yaml(Path(run_dir) / "sweep.yaml")


def check_runs_dir(run_dir: Path) -> None:
    """Fail early with a one-line message instead of reporting an empty sweep."""
    if not run_dir.is_dir():
        raise FileNotFoundError(f"runs directory not found: {run_dir}")
    if not (run_dir / "trials").is_dir():
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




def _trials(paths: Paths) -> Iterator[tuple[Path, dict[str, Any]]]:
    """Yield (trial dir, row) for every trial, run dirs in the given order, trials by id."""
    for run_dir in run_dirs(paths):
        trial_dirs = [p for p in (run_dir / "trials").iterdir() if p.is_dir()]
        for trial_dir in sorted(trial_dirs, key=lambda p: _natural_key(p.name)):
            yield trial_dir, _trial_row(run_dir, trial_dir)


def run_dirs(paths: Paths) -> list[Path]:
    """Accept one path or many, checking each before any is read."""
    items = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    run_dirs = [Path(item) for item in items]
    for run_dir in run_dirs:
        check_runs_dir(run_dir)
    return run_dirs


def _trial_row(run_dir: Path, trial_dir: Path) -> dict[str, Any]:
    """Merge config and summary; the summary wins since it records what actually ran."""
    raw = _read_yaml(trial_dir / "config.yaml")
    config = flatten(raw)
    summary = read_json(trial_dir / "summary.json")
    row: dict[str, Any] = {"run_dir": str(run_dir), **dict.fromkeys(SUMMARY_FIELDS), **config}
    row["memory"] = memory_label(raw.get("memory") or {})
    row["precision"] = (raw.get("train") or {}).get("precision", "fp32")
    row.update(flatten(summary or {}))
    # The folder name is what a user types to find the trial's files, so it is the id.
    row["trial"] = trial_dir.name
    if summary is None:
        row["status"] = "pending"
    row.update(_progress(trial_dir, row))
    for field, keys in CONFIG_FALLBACKS.items():
        if row[field] is None:
            row[field] = next((config[k] for k in keys if config.get(k) is not None), None)
    return row


def _progress(trial_dir: Path, row: dict[str, Any]) -> dict[str, Any]:
    """The last logged losses: the summary of a running trial is only rewritten at its end."""
    try:
        with (trial_dir / "metrics.jsonl").open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 16384))
            tail = f.read().decode("utf-8", "replace").splitlines()[1:]
    except OSError:
        return {}
    rows = [r for r in (_json_line(line) for line in tail) if isinstance(r, dict)]
    train = [r for r in rows if r.get("kind") == "train"]
    evals = [r for r in rows if r.get("kind") == "eval"]
    out: dict[str, Any] = {}
    if train:
        out["last_loss"] = train[-1].get("loss")
        if row.get("status") == "running":
            out["step"] = train[-1].get("step")
            out["tokens_per_s"] = train[-1].get("tokens_per_s")
    if evals and row.get("status") == "running":
        out["eval_ppl"] = evals[-1].get("eval_ppl")
    return out


def _json_line(line: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None


def _natural_key(name: str) -> list[int | str]:
    """Sort trial ids so that t2 comes before t10."""
    parts = re.split(r"([0-9]+)", name)
    return [int(part) if i % 2 else part for i, part in enumerate(parts)]


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}
