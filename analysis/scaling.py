"""Scaling across model sizes: each method's best final loss per size, against parameters N
and compute C = 6·N·D, a power law in N per method, and the gap to AdamW at LLaMA-7B.

Which run per size: each model's largest token budget with a finished trial, the same budget
for every method of that size (a method without a result there has no point for that size).
N is the model's total parameter count as the summaries record it (`total_params`; embeddings
included, as Chinchilla counts), read from the baseline's trials, which train every weight,
and else from the model's trials' largest count. D is the tokens those trials trained on.

The law per method is L = E + A·N^−α where it has at least FLOOR_SIZES sizes (three
parameters and one degree of freedom), else L = A·N^−α (two sizes suffice; with two it passes
through both points, without an error). Its value at 6.74B parameters is an extrapolation far
past the sizes run and is marked so everywhere it is shown.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pandas as pd

from .budgets import baseline_variant, best_sets
from .fits import PowerLaw, min_points, try_fit
from .format import cell
from .speedup import BASELINE

LLAMA_7B = 6.74e9  # LLaMA-7B's parameters (Touvron et al. 2023, Table 2: 6.7B; 6,738,415,616)
FLOOR_SIZES = 4  # sizes from which the law gets a floor E
POINT_COLUMNS = ["variant", "method", "model", "params", "budget", "tokens", "compute", "mean",
                 "ci", "n", "sem"]


@dataclass
class Scaling:
    """A point per (method setting, size), a law per method setting with enough sizes, and a
    line per method setting without."""

    points: pd.DataFrame
    fits: dict[str, PowerLaw] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    baseline: str | None = BASELINE


def scaling(trials: pd.DataFrame, baseline: str = BASELINE) -> Scaling:
    """Each method setting's best set at each model's largest budget, and its law in N."""
    sets = best_sets(trials)
    result = Scaling(pd.DataFrame(columns=POINT_COLUMNS), baseline=baseline_variant(sets, baseline))
    if sets.empty:
        return result
    largest = sets.groupby("model")["budget"].transform("max")
    points = sets[sets["budget"] == largest].copy()
    points["params"] = points["model"].map(_model_params(points, result.baseline))
    points = points[points["params"].notna()]
    points["compute"] = 6 * points["params"] * points["tokens"]
    result.points = points[POINT_COLUMNS].sort_values("params", kind="stable")
    for variant, own in result.points.groupby("variant", sort=False):
        floor = own["params"].nunique() >= FLOOR_SIZES
        if own["params"].nunique() < min_points(floor):
            result.missing.append(f"{variant}: no fit: 1 model size ({own['model'].iloc[0]}); "
                                  f"a power law in N needs {min_points(False)}.")
            continue
        law = try_fit(own["params"], own["mean"], own["sem"].to_numpy(dtype=float), floor)
        if isinstance(law, str):
            result.missing.append(f"{variant}: no fit: {law}.")
            continue
        result.fits[str(variant)] = law
    return result


def _model_params(points: pd.DataFrame, baseline: str | None) -> dict[str, float]:
    """N per model: the baseline's recorded total parameters, else the largest recorded."""
    params = {}
    for model, own in points.groupby("model"):
        base = own.loc[own["variant"] == baseline, "total_params"].dropna()
        counts = base if len(base) else own["total_params"].dropna()
        params[str(model)] = float(counts.max()) if len(counts) else math.nan
    return params


def gap_at_7b(result: Scaling) -> dict[str, float]:
    """Each fitted method's extrapolated loss at 7B minus the baseline's (NaN without one)."""
    base = result.fits.get(result.baseline or "")
    reference = float(base.loss(LLAMA_7B)) if base else math.nan
    return {variant: float(law.loss(LLAMA_7B)) - reference for variant, law in result.fits.items()}


def scaling_table(result: Scaling) -> pd.DataFrame:
    """A row per method setting: sizes, the law and its parameters, its loss at 7B and the gap
    to AdamW there, both marked as extrapolation."""
    gaps = gap_at_7b(result)
    rows = []
    for variant, own in result.points.groupby("variant", sort=False):
        law = result.fits.get(str(variant))
        sizes = ", ".join(f"{m} ({n / 1e6:.3g}M)" for m, n in zip(own["model"], own["params"],
                                                                    strict=True))
        rows.append({
            "method": str(variant), "sizes": sizes,
            "law": "" if law is None else law.describe("N"),
            "α": "" if law is None else f"{law.alpha:.3g}",
            "loss at 7B (extrapolated)": "" if law is None else f"{float(law.loss(LLAMA_7B)):.3f}",
            "gap to AdamW at 7B (extrapolated)": cell(gaps.get(str(variant), math.nan), "+.3f"),
        })
    return pd.DataFrame(rows)


def fit_note(result: Scaling) -> str:
    """What the table's laws are and what they are not."""
    forms = {law.floor for law in result.fits.values()}
    form = " and ".join(["L = E + A·N^−α" if f else "L = A·N^−α (no floor: fewer than "
                         f"{FLOOR_SIZES} sizes)" for f in sorted(forms, reverse=True)])
    return (f"Each method's best final eval loss (nats per token) at each model's largest "
            f"budget, fitted in N (total parameters) as {form}. The loss and gap at LLaMA-7B "
            f"({LLAMA_7B / 1e9:.2f}B parameters) extrapolate far past the sizes run, at these "
            "budgets' tokens per parameter: they show where the fitted trends point, not a "
            "7B result. Gap: the method's minus AdamW's; negative is better.")
