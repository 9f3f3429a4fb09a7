"""Speedup over tuned AdamW, as marin's "Fantastic Pretraining Optimizers" measures it.

Per model, AdamW's best final loss at each token budget is fitted with L(D) = E + A·D^−α
(`fits.try_fit`; weighted by the seeds' standard errors where every budget has two or
more seeds). A method reaching loss L_m with D_m tokens has speedup D_AdamW(L_m) / D_m, where
D_AdamW(L) = (A/(L − E))^(1/α) is the tokens AdamW would need: 2 means AdamW needs twice the
tokens for the same loss. Its interval is the 95% Student-t interval of the method's seed-mean
loss mapped through D_AdamW (which is monotone); it leaves out the fit's own uncertainty,
shown as the parameters' errors. A loss at or below AdamW's fitted floor E has no finite
speedup: it is said so, not given a number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pandas as pd

from .budgets import baseline_variant, best_sets
from .fits import PowerLaw, min_points, try_fit
from .format import cell
from .stats import format_ci

BASELINE = "full"  # the method label standing for AdamW
FLOOR_NOTE = "beyond AdamW's fitted floor"
SET_COLUMNS = ["model", "budget", "tokens", "chinchilla", "variant", "method", "lr", "tuned",
               "mean", "ci", "n"]  # taken from the best trial sets as they are
POINT_COLUMNS = [*SET_COLUMNS, "tokens_adamw", "speedup", "low", "high", "note"]


@dataclass
class Speedups:
    """The numbers behind the table and figure: a row per (model, budget, method setting),
    AdamW's fit per model, and a line per model for which no fit could be made."""

    points: pd.DataFrame
    fits: dict[str, PowerLaw] = field(default_factory=dict)
    spans: dict[str, tuple[float, float]] = field(default_factory=dict)  # budgets fitted on
    missing: list[str] = field(default_factory=list)
    baseline: str = BASELINE


def speedups(trials: pd.DataFrame, baseline: str = BASELINE) -> Speedups:
    """Fit the baseline per model and place every method's best trial set against it."""
    sets = best_sets(trials)
    result = Speedups(pd.DataFrame(columns=POINT_COLUMNS), baseline=baseline)
    need = min_points(floor=True)
    rows = []
    for model, own in sets.groupby("model", sort=False):
        variant = baseline_variant(own, baseline)
        base = own[own["variant"] == variant].sort_values("budget")
        if len(base) < need:
            result.missing.append(_missing_line(str(model), baseline, base))
            continue
        law = try_fit(base["tokens"], base["mean"], sigma=base["sem"].to_numpy(dtype=float))
        if isinstance(law, str):
            result.missing.append(f"{model}: no speedup: AdamW (`{baseline}`): {law}.")
            continue
        result.fits[str(model)] = law
        span = result.spans[str(model)] = (float(base["tokens"].min()),
                                           float(base["tokens"].max()))
        order = {v: i for i, v in enumerate(dict.fromkeys([variant, *own["variant"]]))}
        own = own.assign(_order=own["variant"].map(order)).sort_values(
            ["_order", "budget"])  # AdamW first, then as they came, budgets rising
        rows += [_point(row, law, span, row["variant"] == variant) for _, row in own.iterrows()]
    if rows:
        result.points = pd.DataFrame(rows, columns=POINT_COLUMNS)
    return result


def tokens_ratio(law: PowerLaw, loss: float, tokens: float) -> float:
    """D_AdamW(loss) / tokens; inf at or below the floor."""
    return law.inverse(loss) / tokens


def _point(row: pd.Series, law: PowerLaw, span: tuple[float, float], baseline: bool) -> dict:
    """One method setting at one budget: its speedup, the interval from its seeds, and a note
    where the number is no plain reading of the fit (none on AdamW's own points, which only
    show how far they lie off its law)."""
    budget, mean, ci = float(row["tokens"]), float(row["mean"]), float(row["ci"])
    speedup, low, high = (tokens_ratio(law, mean, budget), math.nan, math.nan)
    if not math.isnan(ci):
        low, high = tokens_ratio(law, mean + ci, budget), tokens_ratio(law, mean - ci, budget)
    tokens = law.inverse(mean)
    if math.isinf(speedup):
        note, speedup, tokens = FLOOR_NOTE, math.nan, math.nan
    elif baseline:
        note = ""
    elif tokens > span[1] * (1 + 1e-9):
        note = "extrapolated: past AdamW's largest budget"
    elif tokens < span[0] * (1 - 1e-9):
        note = "extrapolated: below AdamW's smallest budget"
    else:
        note = ""
    return {**row[SET_COLUMNS].to_dict(),
            "tokens_adamw": tokens, "speedup": speedup, "low": low, "high": high, "note": note}


def _missing_line(model: str, baseline: str, base: pd.DataFrame) -> str:
    need = f"its fit L(D) = E + A·D^−α needs {min_points(True)}."
    if base.empty:
        return f"{model}: no speedup: AdamW (`{baseline}`) has no finished trial; {need}"
    budgets = ", ".join(f"{b:,.0f}" for b in base["budget"])
    return (f"{model}: no speedup: AdamW (`{baseline}`) finished at {len(base)} token "
            f"budget(s) ({budgets}); {need}")


def speedup_table(result: Speedups) -> pd.DataFrame:
    """The points as strings: model, budget (tokens, or its Chinchilla multiple), tokens
    trained (D), method, best lr, its other tuned settings, final loss (mean ± 95% CI, n), the
    tokens AdamW needs for it, the speedup, its interval and the note."""
    p = result.points
    return pd.DataFrame({
        "model": p["model"].astype(str),
        "budget": [f"{c:g}× Chinchilla" if not math.isnan(c) else cell(b, ",.0f")
                   for b, c in zip(p["budget"], p["chinchilla"].astype(float), strict=True)],
        "tokens": p["tokens"].map(lambda v: cell(v, ",.0f")),
        "method": p["variant"].astype(str),
        "best lr": p["lr"].map(lambda v: f"{v:g}"),
        "tuned": p["tuned"].astype(str),
        "final loss": [format_ci(m, c, int(n), digits=4)
                       for m, c, n in zip(p["mean"], p["ci"], p["n"], strict=True)],
        "AdamW tokens": p["tokens_adamw"].map(lambda v: cell(v, ",.3g")),
        "speedup": p["speedup"].map(lambda v: cell(v, ".2f")),
        "95% interval": [_interval(lo, hi) for lo, hi in zip(p["low"], p["high"], strict=True)],
        "note": p["note"].astype(str),
    })


def fit_lines(result: Speedups) -> list[str]:
    """A line per model: AdamW's fitted law with its errors, or why there is none."""
    lines = [f"{model}: AdamW (`{result.baseline}`) {law.describe('D')}; "
             f"A = {law.A:.3g}, D in tokens, L in nats per token."
             for model, law in result.fits.items()]
    return lines + result.missing


def _interval(low: float, high: float) -> str:
    """"[1.20, 1.71]", "[1.20, ∞)" when the upper loss bound is past the floor; blank without
    a spread (one seed)."""
    if math.isnan(low) and math.isnan(high):
        return ""
    upper = "∞)" if math.isinf(high) else f"{high:.2f}]"
    lower = "∞" if math.isinf(low) else f"{low:.2f}"
    return f"[{lower}, {upper}"
