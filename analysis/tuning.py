"""How each method was tuned (a sweep's `tuning:`), per model and budget: its tuned values, the
trials it got, the sensitivity around its best learning rate (the loss at 0.5x and 2x it, with
its other settings as tuned) and how many of its trials diverged."""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from harness.trials import Status

from .budgets import TUNED, budget_tokens, tuned_values
from .format import text_table
from .html import Block, Heading, Paragraph, Table
from .stats import format_ci, mean_ci

TITLE = "Tuning: tuned values and sensitivity"
COLUMNS = ["model", "budget", "method", "tuned", "configurations", "trials", "diverged",
           "best", "at 0.5x lr", "at 2x lr"]
SAME_LR = 1e-6  # relative: the LRs of a factor-2 ladder read back from YAML
NOTE = ("Each method's LR and the settings its config marks tunable (`harness methods`), tuned "
        "by the sweep's `tuning:`, per model and budget. best: the mean over seeds of the tuned "
        "configuration; at 0.5x / 2x lr: the same configuration at half and twice its LR "
        "(\"not run\" where the tuning never ran it); diverged: trials that ended nan or "
        "without a finite metric.")


def diverged(trials: pd.DataFrame, metric: str) -> pd.Series:
    values = pd.to_numeric(trials[metric], errors="coerce")
    ok = trials["status"] == Status.OK
    return (trials["status"] == Status.NAN) | (ok & ~values.map(
        lambda v: isinstance(v, float) and math.isfinite(v)))


def method_row(trials: pd.DataFrame, metric: str) -> dict[str, Any]:
    """One method's row at one model and budget: configurations are its LR and tuned values."""
    frame = trials.assign(lr=trials["lr"].astype(float), **{TUNED: tuned_values(trials)})
    bad = diverged(frame, metric)
    done = frame[(frame["status"] == Status.OK) & ~bad]
    row = {"trials": len(frame), "diverged": int(bad.sum()),
           "configurations": len(frame.drop_duplicates(["lr", TUNED]))}
    if done.empty:
        return {**row, "tuned": "", "best": "no trial finished", "at 0.5x lr": "", "at 2x lr": ""}
    lr, tuned = done.groupby(["lr", TUNED])[metric].mean().idxmin()
    at = {"lr": lr, TUNED: tuned}
    best_values = pd.to_numeric(matching(done, at)[metric], errors="coerce")
    return {**row, "tuned": ", ".join([f"lr={lr}", *filter(None, [tuned])]),
            "best": format_ci(*mean_ci(best_values)),
            "at 0.5x lr": at_lr(frame, at, 0.5, metric, bad),
            "at 2x lr": at_lr(frame, at, 2.0, metric, bad)}


def matching(frame: pd.DataFrame, at: dict[str, Any]) -> pd.DataFrame:
    """The trials of one configuration (LRs equal to a relative 1e-6, the rest as text)."""
    return frame[((frame["lr"] / at["lr"] - 1).abs() < SAME_LR) & (frame[TUNED] == at[TUNED])]


def at_lr(frame: pd.DataFrame, at: dict[str, Any], factor: float, metric: str,
          bad: pd.Series) -> str:
    """The metric at `factor` x the best LR, the other settings as tuned: its mean over
    seeds, "diverged" when every such trial did, "not run" when there is none."""
    there = matching(frame, {**at, "lr": at["lr"] * factor})
    if there.empty:
        return "not run"
    ok = there[(there["status"] == Status.OK) & ~bad[there.index]]
    if ok.empty:
        return "diverged" if bad[there.index].any() else "no result"
    return format_ci(*mean_ci(pd.to_numeric(ok[metric], errors="coerce")))


def tuning_table(trials: pd.DataFrame, metric: str = "eval_loss") -> pd.DataFrame:
    """A row per model, method and budget (pretraining trials, `load_runs`' frame): models
    and methods in the order they came, budgets rising."""
    if trials.empty or metric not in trials:
        return pd.DataFrame(columns=COLUMNS)
    frame = trials.assign(_budget=budget_tokens(trials))
    frame = frame.sort_values("_budget", kind="stable")  # groups below: first seen, in budgets
    order = {k: {v: i for i, v in enumerate(dict.fromkeys(trials[k]))} for k in ("model", "method")}
    groups = sorted(frame.groupby(["model", "method", "_budget"], sort=False, dropna=False),
                    key=lambda kg: (order["model"][kg[0][0]], order["method"][kg[0][1]]))
    rows = []
    for (model, method, budget), group in groups:
        tokens = "" if pd.isna(budget) else f"{int(budget):,} tokens"
        rows.append({"model": model, "budget": tokens, "method": method,
                     **method_row(group, metric)})
    return pd.DataFrame(rows, columns=COLUMNS)


def tuning_section(pretraining: pd.DataFrame,
                   sweep: dict[str, Any]) -> tuple[list[Block], list[str]]:
    """The report's blocks and the terminal's text; nothing for a sweep without `tuning:`."""
    if not sweep.get("tuning"):
        return [], []
    table = tuning_table(pretraining)
    if table.empty:
        line = f"{TITLE}: no pretraining trial with an eval_loss yet."
        return [Heading(TITLE), Paragraph(line)], [line]
    return [Heading(TITLE), Table(table), Paragraph(NOTE)], [f"{TITLE}\n{text_table(table)}"]
