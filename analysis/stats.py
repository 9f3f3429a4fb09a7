"""Seed statistics and learning-rate selection for the report's tables.

A trial's result is one draw: several seeds of the same configuration become a mean with a
95% confidence interval (Student's t, since seeds are few), and each method is compared at
the LR whose seed-mean is best, the protocol of the papers this harness compares.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np
import pandas as pd
from scipy import stats

from harness.trials import Status

STAT_COLUMNS = ["mean", "ci", "n"]


def mean_ci(values: Iterable[float]) -> tuple[float, float, int]:
    """(mean, 95% CI half-width, n) of the non-missing values; the half-width is NaN below two
    values, where the spread cannot be estimated."""
    array = np.asarray([v for v in values if not pd.isna(v)], dtype=float)
    n = len(array)
    if n == 0:
        return math.nan, math.nan, 0
    if n < 2:
        return float(array[0]), math.nan, 1
    half = stats.t.ppf(0.975, n - 1) * array.std(ddof=1) / math.sqrt(n)
    return float(array.mean()), float(half), n


def finished(trials: pd.DataFrame, value: str) -> pd.DataFrame:
    """Trials that ended normally with a value: a failed or diverged trial's last number is no
    result, and a trial without an LR cannot take part in the LR choice."""
    if value not in trials:
        return trials.iloc[0:0]
    values = pd.to_numeric(trials[value], errors="coerce")
    keep = (trials["status"] == Status.OK) & values.notna() & trials["lr"].notna()
    return trials[keep].assign(**{value: values[keep]})


def seed_stats(trials: pd.DataFrame, keys: Sequence[str], value: str) -> pd.DataFrame:
    """One row per configuration (`keys`, e.g. method, memory, precision, model, lr): the mean,
    CI half-width and count of `value` over its finished seeds."""
    keys = list(keys)
    done = finished(trials, value)
    rows = [
        (*(key if isinstance(key, tuple) else (key,)), *mean_ci(group[value]))
        for key, group in done.groupby(keys, sort=False, dropna=False)
    ]
    return pd.DataFrame(rows, columns=[*keys, *STAT_COLUMNS])


def best_lr(
    trials: pd.DataFrame, keys: Sequence[str], metric: str = "eval_ppl", minimize: bool = True
) -> pd.DataFrame:
    """Per group of `keys` (without lr): the LR whose seed-mean of `metric` is best, with its
    mean, ci, n, and `others`, the other LRs that finished (sorted), to say what it beat."""
    keys = list(keys)
    by_lr = seed_stats(trials, [*keys, "lr"], metric)
    columns = [*keys, "lr", *STAT_COLUMNS, "others"]
    if by_lr.empty:
        return pd.DataFrame(columns=columns)
    rows = []
    for _, group in by_lr.groupby(keys, sort=False, dropna=False):
        best = group.loc[group["mean"].idxmin() if minimize else group["mean"].idxmax()]
        others = tuple(sorted(lr for lr in group["lr"] if lr != best["lr"]))
        rows.append({**best[[*keys, "lr", *STAT_COLUMNS]].to_dict(), "others": others})
    picks = pd.DataFrame(rows, columns=columns)
    return picks.astype({"n": int})


def at_best(
    trials: pd.DataFrame, picks: pd.DataFrame, keys: Sequence[str], value: str, how: str
) -> pd.Series:
    """`value` aggregated (`how`: "max", "mean", …) over the finished trials of each pick's
    chosen LR, aligned with `picks`: memory and speed are read where the metric was best."""
    at = [*keys, "lr"]
    done = finished(trials, value)
    if done.empty:
        return pd.Series(math.nan, index=picks.index)
    agg = done.groupby(at, dropna=False)[value].agg(how).rename("_value").reset_index()
    merged = picks[at].merge(agg, on=at, how="left")
    return pd.Series(merged["_value"].to_numpy(), index=picks.index)


def at_best_lr(trials: pd.DataFrame, metric: str, minimize: bool = True,
               **aggs: tuple[str, str]) -> pd.Series | None:
    """Among one configuration's ok trials: the seed-mean of `metric` (`mean`) and each of
    `aggs` (name=(column, how)) at the LR whose mean is best; the Series is named by that LR.
    None when no trial finished with a value and an LR."""
    done = trials[(trials["status"] == Status.OK) & trials[metric].notna() & trials["lr"].notna()]
    if done.empty:
        return None
    by_lr = done.groupby("lr").agg(mean=(metric, "mean"), **aggs)
    return by_lr.loc[by_lr["mean"].idxmin() if minimize else by_lr["mean"].idxmax()]


def format_ci(mean: float, ci: float, n: int, digits: int = 2) -> str:
    """"34.06 ± 0.12 (n=3)", or "34.06" for one seed (no interval to give), "" for none."""
    if pd.isna(mean):
        return ""
    text = f"{mean:.{digits}f}"
    if n < 2 or pd.isna(ci):
        return text
    return f"{text} ± {ci:.{digits}f} (n={n})"
