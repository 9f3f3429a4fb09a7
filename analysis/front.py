"""The trade-off a sweep measured: the trials no other trial beats on every objective at once
(the Pareto front), as a table for grid and search sweeps alike, and for a multi-objective
study the hypervolume its trials dominate, trial by trial.

The objectives are a search's own (`search.objectives`, two or more); otherwise the question
the harness answers: eval perplexity, peak memory and trial-hours, each lower being better.
Headers, formats and directions are the metric registry's (harness/config/metrics.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from optuna._hypervolume import compute_hypervolume  # Optuna's own (its plot_hypervolume uses it)

from harness.config.metrics import METRICS
from harness.trials import Status

from .format import cell, fill_variants, metric_cells, variant_label, with_derived

DEFAULT = tuple((m, METRICS[m].direction) for m in ("eval_ppl", "peak_memory_bytes",
                                                     "trial_hours"))
HISTORY_POINTS = 60  # hypervolume evaluated at most this many times along a study


def objectives_of(sweep: dict[str, Any], trials: pd.DataFrame) -> list[tuple[str, str]]:
    """(metric, direction) pairs: the search's objectives when it has several, else those of
    DEFAULT that some trial recorded (trial-hours need `wall_s`, which older runs lack)."""
    goals = (sweep.get("search") or {}).get("objectives") or []
    if len(goals) > 1:
        return [(str(g["metric"]), str(g.get("direction", "minimize"))) for g in goals]
    recorded = with_derived(trials)
    return [(m, d) for m, d in DEFAULT if m in recorded and recorded[m].notna().any()]


def non_dominated(values: np.ndarray) -> np.ndarray:
    """Rows of `values` (n × k, lower better in every column) that no other row is at most on
    every column and below on one; equal rows all stay."""
    no_worse = (values[None, :, :] <= values[:, None, :]).all(axis=2)
    better = (values[None, :, :] < values[:, None, :]).any(axis=2)
    return ~(no_worse & better).any(axis=1)


def _oriented(frame: pd.DataFrame, objectives: list[tuple[str, str]]) -> np.ndarray:
    """Each objective's column, negated where it is maximized: lower is better in all."""
    return np.column_stack([frame[m].to_numpy(dtype=float) * (-1 if d == "maximize" else 1)
                            for m, d in objectives])


def front_table(trials: pd.DataFrame, objectives: list[tuple[str, str]]) -> pd.DataFrame:
    """The ok trials with every objective on the Pareto front, best first by the first
    objective: trial, method variant, LR, seed and each objective's value."""
    ok = with_derived(fill_variants(trials))
    ok = ok[ok["status"] == Status.OK].dropna(subset=[m for m, _ in objectives])
    columns = ["trial", "method", "lr", "seed", *(METRICS[m].header for m, _ in objectives)]
    if ok.empty or not objectives:
        return pd.DataFrame(columns=columns)
    on_front = ok[non_dominated(_oriented(ok, objectives))]
    first, direction = objectives[0]
    on_front = on_front.sort_values(first, ascending=direction == "minimize", kind="stable")
    table = pd.DataFrame({
        "trial": on_front["trial"],
        "method": [variant_label(*k) for k in
                   on_front[["method", "memory", "precision"]].itertuples(index=False)],
        "lr": on_front["lr"].map(lambda v: cell(v, "g")),
        "seed": on_front.get("seed", pd.Series(index=on_front.index, dtype=object)),
    })
    for metric, _ in objectives:
        table[METRICS[metric].header] = metric_cells(metric, on_front[metric])
    return table.reset_index(drop=True)


def front_line(trials: pd.DataFrame, table: pd.DataFrame,
               objectives: list[tuple[str, str]]) -> str:
    goals = ", ".join(f"{METRICS[m].header} ({'lower' if d == 'minimize' else 'higher'} is better)"
                      for m, d in objectives)
    finished = int((trials["status"] == Status.OK).sum()) if len(trials) else 0
    return (f"{len(table)} of the {finished} finished trials are on the Pareto front of {goals}: "
            "no other trial is at least as good on all of them and better on one.")


def hypervolume_history(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Trial counts and the hypervolume the first that many trials dominate, each objective
    scaled to [0, 1] between the best and worst value seen, against the reference point 1.1
    in each (so the figure compares a study with itself as it goes, whatever the units)."""
    low, high = values.min(axis=0), values.max(axis=0)
    scaled = (values - low) / np.where(high > low, high - low, 1.0)
    counts = np.unique(np.linspace(1, len(values), min(HISTORY_POINTS, len(values))).astype(int))
    reference = np.full(values.shape[1], 1.1)
    volumes = [compute_hypervolume(front[non_dominated(front)], reference)
               for front in (scaled[:n] for n in counts)]
    return counts, np.array(volumes)


def hypervolume_plot(studies: dict[str, Any], name: str) -> tuple[Figure, str] | None:
    """Each multi-objective study's hypervolume by trial (None when no study has several
    objectives and two complete trials)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from optuna.study import StudyDirection
    from optuna.trial import TrialState

    figure = Figure(figsize=(8, 5), layout="constrained")
    FigureCanvasAgg(figure)
    ax = figure.subplots()
    drawn = False
    for i, (label, study) in enumerate(studies.items()):
        trials = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        if len(study.directions) < 2 or len(trials) < 2:
            continue
        signs = np.array([1 if d == StudyDirection.MINIMIZE else -1 for d in study.directions])
        counts, volumes = hypervolume_history(np.array([t.values for t in trials]) * signs)
        ax.plot(counts, volumes, marker="o", markersize=3, color=f"C{i}", label=label)
        drawn = True
    if not drawn:
        return None
    ax.set_title(f"{name}: hypervolume of the Pareto front by trial")
    ax.set_xlabel("complete trials")
    ax.set_ylabel("hypervolume (objectives scaled to [0, 1], reference 1.1)")
    ax.legend(fontsize="small")
    ax.grid(True, alpha=0.3)
    return figure, "Hypervolume dominated by each study's complete trials as they finish"
