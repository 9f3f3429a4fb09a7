"""Each method's best trials per (model, token budget): what the speedup and scaling fits read.

A trial is compared at its own end: its final eval loss (nats per token; ln of the eval
perplexity for a summary without it). Per (model, budget, method setting) the best trial set
is the seeds of the configuration (its LR and the values of the settings its method marks
tunable) whose seed-mean final loss is lowest (`stats.best_lr` per tuned values).
"""

from __future__ import annotations

import ast
import math
from typing import Any

import numpy as np
import pandas as pd

from harness.config.tuning import tunables
from harness.errors import UserError
from harness.methods import get_method

from .format import VARIANT_DEFAULTS, fill_variants, variant_label
from .stats import best_lr, finished

# The sweep's recorded token budget per trial; a sweep from before budgets has none, and its
# trials' budget is the tokens each one saw (steps × tokens per step at a normal end).
BUDGET_COLUMN = "budget_tokens"
LOSS = "final_loss"
KEYS = ["model", "budget", "variant"]
TUNED = "tuned"  # a trial's tunable settings besides its LR, as text ("" where none)
SET_COLUMNS = [*KEYS, "method", "lr", TUNED, "mean", "ci", "n", "sem", "losses", "tokens",
               "chinchilla", "total_params"]
CHINCHILLA_COLUMN = "chinchilla"  # the budget's Chinchilla multiple, where the sweep gave one


def budget_tokens(trials: pd.DataFrame) -> pd.Series:
    """Each trial's token budget: the recorded one where the sweep states budgets, else the
    tokens its summary counts."""
    tokens = pd.to_numeric(trials.get("tokens", pd.Series(np.nan, index=trials.index)),
                           errors="coerce")
    if BUDGET_COLUMN in trials:
        return pd.to_numeric(trials[BUDGET_COLUMN], errors="coerce").fillna(tokens)
    return tokens


def final_loss(trials: pd.DataFrame) -> pd.Series:
    """The final eval loss, ln(eval perplexity) where a summary records only the perplexity."""
    nan = pd.Series(np.nan, index=trials.index)
    loss = pd.to_numeric(trials.get("eval_loss", nan), errors="coerce")
    ppl = pd.to_numeric(trials.get("eval_ppl", nan), errors="coerce")
    return loss.fillna(np.log(ppl.where(ppl > 0)))


def tuned_keys(method_name: str, trials: pd.DataFrame) -> list[str]:
    """The config columns of the method's tunable settings that its trials record."""
    try:
        marked = tunables(get_method(method_name).Config)
    except UserError:  # a method this install no longer registers: its LR alone
        return []
    return [f"method.{name}" for name in marked if f"method.{name}" in trials]


def plain(value: Any) -> Any:
    """A setting as a hashable cell: a tuple comes back from the config as a list, which
    `load_runs` gives as its text."""
    if isinstance(value, str) and value.startswith("["):
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            return value
    return tuple(value) if isinstance(value, list) else value


def tuned_values(trials: pd.DataFrame) -> pd.Series:
    """Each trial's tunable settings besides its LR, as "name=value, ..." ("" for none)."""
    names = trials.get("method_name", trials.get("method", pd.Series("", index=trials.index)))
    out = pd.Series("", index=trials.index, dtype=object)
    for name, group in trials.groupby(names.astype(str), sort=False):
        keys = tuned_keys(name, group)
        out[group.index] = [", ".join(f"{k.removeprefix('method.')}={plain(v)}"
                                      for k, v in zip(keys, row, strict=True))
                            for row in group[keys].itertuples(index=False)]
    return out


def with_budgets(trials: pd.DataFrame) -> pd.DataFrame:
    """The trials with `budget`, `final_loss`, `variant` (method plus any memory modifiers
    and precision, as the summary table names it) and `tuned` (its tunable settings)."""
    filled = fill_variants(trials)
    labels = [variant_label(*row) for row in
              filled[list(VARIANT_DEFAULTS)].astype(str).itertuples(index=False)]
    return filled.assign(budget=budget_tokens(filled), **{LOSS: final_loss(filled)},
                         variant=labels, **{TUNED: tuned_values(filled)})


def best_sets(trials: pd.DataFrame) -> pd.DataFrame:
    """One row per (model, budget, variant) with a finished trial: the best LR, the seed-mean
    final loss with its 95% t half-width (`ci`), n, the standard error of the mean (`sem`), the
    seeds' losses, the tokens they trained on (D: whole steps within the budget, the budget
    itself where a summary counts none), the budget's Chinchilla multiple (NaN for a budget
    in tokens) and the largest parameter count recorded."""
    ready = with_budgets(trials)
    ready = ready[ready["budget"].notna() & ready["model"].notna()]
    picks = best_lr(ready, [*KEYS, TUNED], metric=LOSS)
    if picks.empty:
        return pd.DataFrame(columns=SET_COLUMNS)
    # the best LR of each tuned configuration, then the best configuration (first of equals)
    picks = picks.loc[picks.groupby(KEYS, sort=False)["mean"].idxmin()]
    groups = finished(ready, LOSS).groupby([*KEYS, TUNED, "lr"], sort=False)
    rows = []
    for _, pick in picks.iterrows():
        at = groups.get_group(tuple(pick[[*KEYS, TUNED, "lr"]]))
        losses = tuple(float(v) for v in at[LOSS])
        sem = float(np.std(losses, ddof=1) / math.sqrt(len(losses))) if len(losses) > 1 \
            else math.nan
        params = pd.to_numeric(at["total_params"], errors="coerce").max() \
            if "total_params" in at else math.nan
        tokens = pd.to_numeric(at["tokens"], errors="coerce").mean() if "tokens" in at \
            else math.nan
        multiple = pd.to_numeric(at[CHINCHILLA_COLUMN], errors="coerce").max() \
            if CHINCHILLA_COLUMN in at else math.nan
        rows.append({**pick[[*KEYS, "lr", TUNED, "mean", "ci", "n"]].to_dict(),
                     "method": str(at["method"].iloc[0]), "sem": sem, "losses": losses,
                     "tokens": pick["budget"] if pd.isna(tokens) else float(tokens),
                     "chinchilla": float(multiple), "total_params": float(params)})
    return pd.DataFrame(rows, columns=SET_COLUMNS)


def baseline_variant(sets: pd.DataFrame, baseline: str) -> str | None:
    """The variant standing for the baseline method label: the label itself (its default
    memory and precision) where run, else its first other variant; None where not run."""
    variants = list(dict.fromkeys(sets.loc[sets["method"] == baseline, "variant"]))
    if baseline in variants:
        return baseline
    return variants[0] if variants else None
