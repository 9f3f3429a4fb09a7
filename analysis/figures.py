"""Figures that compare methods, each at its own best learning rate: curves over tokens with a
band over seeds, the perplexity / peak-memory trade-off, throughput, and an Optuna sweep's
history and parameter importances.

Every figure function returns (Figure, caption), like those in plots.py, for `save_png`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import EngFormatter, MaxNLocator
from scipy import stats

from harness.config.metrics import METRICS
from harness.trials import RunsDir, Status

from .caveats import SHARED, shared
from .format import VARIANT_DEFAULTS, fill_variants, variant_label
from .front import hypervolume_plot
from .load import PathArg, read_sweep
from .plots import logged_points, plain_log_y
from .stats import at_best_lr
from .styles import legend_outside, method_colors, setting_styles

if TYPE_CHECKING:
    import optuna

CONFIDENCE = 0.95
# What one line, point or bar compares (as in the summary table), and the value of a blank.
CURVES = {  # kind -> (metrics column, axis text, log scale)
    "eval": ("eval_ppl", "Eval perplexity", True),
    "train": ("loss", "Training loss", False),
}


def best_lr_trials(trials: pd.DataFrame, order: Sequence[str] = ()) -> pd.DataFrame:
    """The ok trials (all seeds) of each method and memory variant at its own best LR, the one
    with the lowest mean final eval ppl, so that every figure compares what the summary table
    compares. Adds `variant`, the legend text; methods named in `order` come first."""
    trials = fill_variants(trials)
    ok = trials[(trials["status"] == Status.OK) & trials["eval_ppl"].notna() & trials["lr"].notna()]
    picks = [
        group[group["lr"] == at_best_lr(group, "eval_ppl").name].assign(
            variant=variant_label(*key)
        )
        for key, group in ok.groupby(list(VARIANT_DEFAULTS), sort=False)
    ]
    if not picks:
        return ok.assign(variant=pd.Series(dtype=str))
    best = pd.concat(picks)
    rank = best["method"].map({m: i for i, m in enumerate(order)}).fillna(len(order))
    ordered = best.assign(_rank=rank).sort_values(["_rank", "method"], kind="stable")
    return ordered.drop(columns="_rank").reset_index(drop=True)


def variant_colors(best: pd.DataFrame) -> dict[str, Any]:
    """Each variant in its method's colour (one per method, in `best` order), so a method looks
    the same in every figure; its settings differ by line style (`variant_styles`)."""
    colors = method_colors(best["method"].astype(str))
    return dict(zip(best["variant"], best["method"].astype(str).map(colors), strict=True))


def variant_styles(best: pd.DataFrame) -> dict[str, dict[str, Any]]:
    """A line style per setting (memory modifiers, precision) shared across methods."""
    settings = {v: v.removeprefix(str(m)).strip()
                for v, m in zip(best["variant"], best["method"], strict=True)}
    styles = setting_styles(settings.values())
    return {v: styles[s] for v, s in settings.items()}


def half_width(std: pd.Series, count: pd.Series) -> pd.Series:
    """Half the Student-t 95% interval of a mean: with the 2-5 seeds a sweep affords, the
    normal quantile would make it far too narrow. NaN where a single seed gives no spread."""
    t = stats.t.ppf(0.5 + CONFIDENCE / 2, count.where(count > 1) - 1)
    return pd.Series(t, index=std.index) * std / np.sqrt(count)


def seed_band(curves: pd.DataFrame, x: str, y: str) -> pd.DataFrame:
    """Mean of `y` over the seeds at each `x`, with the bounds of its 95% interval."""
    agg = curves.groupby(x)[y].agg(["mean", "std", "count"])
    half = half_width(agg["std"], agg["count"])
    return pd.DataFrame(
        {x: agg.index, "mean": agg["mean"], "low": agg["mean"] - half,
         "high": agg["mean"] + half, "n": agg["count"]}
    ).reset_index(drop=True)


def method_points(best: pd.DataFrame) -> pd.DataFrame:
    """One row per variant: mean eval ppl and tok/s over seeds (with the tok/s interval), and
    the largest peak memory, as the summary table counts it."""
    points = best.groupby("variant", sort=False).agg(
        **{m: (m, METRICS[m].across_seeds) for m in ("eval_ppl", "peak_memory_bytes",
                                                     "tokens_per_s")},
        rate_std=("tokens_per_s", "std"),
        rate_n=("tokens_per_s", "count"),
    )
    points["rate_half"] = half_width(points["rate_std"], points["rate_n"])
    return points.drop(columns=["rate_std", "rate_n"]).reset_index()


def pareto_front(points: pd.DataFrame, x: str, y: str) -> pd.DataFrame:
    """The rows no other row beats, lower being better on both columns: a row is dominated when
    another is no worse on both and better on one. Equal rows do not dominate each other, so
    ties on the front all stay; rows missing x or y are left out. Sorted by x, then y."""
    valid = points.dropna(subset=[x, y])
    xs, ys = valid[x].to_numpy(dtype=float), valid[y].to_numpy(dtype=float)
    # [i, j]: row j is at most row i on both columns, and below it on at least one.
    no_worse = (xs[None, :] <= xs[:, None]) & (ys[None, :] <= ys[:, None])
    better = (xs[None, :] < xs[:, None]) | (ys[None, :] < ys[:, None])
    dominated = (no_worse & better).any(axis=1)
    return valid[~dominated].sort_values([x, y], kind="stable")


def eval_curves(steps: pd.DataFrame, best: pd.DataFrame, name: str) -> tuple[Figure, str]:
    """Eval perplexity vs tokens, one line per method at its best LR."""
    return _method_curves(steps, best, name, "eval")


def loss_curves(steps: pd.DataFrame, best: pd.DataFrame, name: str) -> tuple[Figure, str]:
    """Training loss vs tokens, one line per method at its best LR."""
    return _method_curves(steps, best, name, "train")


def _method_curves(
    steps: pd.DataFrame, best: pd.DataFrame, name: str, kind: str
) -> tuple[Figure, str]:
    """The mean over seeds, shaded with its 95% interval where two or more seeds logged; a
    colour per method, a line style per memory/precision setting, the legend outside."""
    column, quantity, log = CURVES[kind]
    figure, ax = _figure((8, 5))
    points = logged_points(steps, kind, column).drop(columns=["lr"], errors="ignore").merge(
        best[["run_dir", "trial", "variant", "lr"]], on=["run_dir", "trial"])  # the trial's LR
    banded = False
    styles = variant_styles(best)
    for variant, color in variant_colors(best).items():
        curve = points[points["variant"] == variant]
        if curve.empty:
            continue
        band = seed_band(curve, "tokens", column)
        seeds = curve["trial"].nunique()
        label = f"{variant} lr={curve['lr'].iloc[0]:g}" + (f" ({seeds} seeds)" if seeds > 1 else "")
        ax.plot(band["tokens"], band["mean"], markersize=3, color=color, label=label,
                **styles[variant])
        if seeds > 1:
            ax.fill_between(band["tokens"], band["low"], band["high"], where=band["n"] > 1,
                            color=color, alpha=0.2, linewidth=0)
            banded = True
    caption = f"{quantity} vs tokens seen, each method at its best LR"
    caption += f" (mean over seeds, {CONFIDENCE:.0%} CI band)" if banded else ""
    ax.set_title(f"{name}: {quantity.lower()} vs tokens seen")
    ax.set_xlabel("tokens seen")
    ax.set_ylabel(quantity.lower() + (" (log scale)" if log else ""))
    ax.xaxis.set_major_formatter(EngFormatter())
    if points.empty:
        _empty(ax, "no finished trials yet")
        return figure, caption
    if log:
        plain_log_y(ax)
    legend_outside(ax)
    ax.grid(True, which="both", alpha=0.3)
    return figure, caption


def pareto_plot(best: pd.DataFrame, name: str) -> tuple[Figure, str]:
    """Eval ppl against peak memory, one point per method; the frontier (no other method is
    both smaller and better) is ringed and joined by the staircase bounding what it beats."""
    figure, ax = _figure((8, 5))
    caption = "Eval perplexity vs peak memory, each method at its best LR; line: Pareto frontier"
    ax.set_title(f"{name}: eval perplexity vs peak memory")
    ax.set_xlabel("peak memory (GB)")
    ax.set_ylabel("eval perplexity (log scale)")
    points = method_points(best).dropna(subset=["eval_ppl", "peak_memory_bytes"])
    if points.empty:
        _empty(ax, "no finished trials yet")
        return figure, caption
    front = pareto_front(points, "peak_memory_bytes", "eval_ppl")
    ax.step(front["peak_memory_bytes"] / 1e9, front["eval_ppl"], where="post", color="0.4",
            linestyle="--", label="Pareto frontier")
    ax.scatter(front["peak_memory_bytes"] / 1e9, front["eval_ppl"], s=160, facecolors="none",
               edgecolors="0.2", linewidths=1.5)
    colors = variant_colors(best)
    for row in points.itertuples(index=False):
        ax.scatter(row.peak_memory_bytes / 1e9, row.eval_ppl, s=40, color=colors[row.variant],
                   zorder=3)
    plain_log_y(ax)
    label_points(ax, points["peak_memory_bytes"] / 1e9, points["eval_ppl"], points["variant"])
    ax.legend(fontsize="small")
    ax.grid(True, which="both", alpha=0.3)
    return figure, caption


MAX_RISE = 40  # lines a label may move up before it is left where it overlaps


def label_points(ax: Axes, xs: pd.Series, ys: pd.Series, labels: pd.Series) -> None:
    """Each label beside its point, moved up in steps of a line's height until its box clears
    every label placed before it (points that nearly coincide, as lora, relora and lowrank at
    llama_tiny, would otherwise print over each other); a moved label keeps a leader line."""
    figure = ax.get_figure()
    assert figure is not None
    renderer = figure.canvas.get_renderer()  # type: ignore[attr-defined]
    # the limits the plotted points will get, now: matplotlib applies them only when drawn,
    # and boxes measured against the old ones put points of a narrow range on one spot
    ax.autoscale_view()
    placed: list[Any] = []
    step = 1.2 * 0.833 * 10  # points: one line of "small" text (10 pt x 0.833)
    for x, y, text in sorted(zip(xs, ys, labels, strict=True), key=lambda p: (p[1], p[0])):
        for lines in range(MAX_RISE):
            note = ax.annotate(str(text), (x, y), xytext=(6, 4 + lines * step),
                               textcoords="offset points", fontsize="small")
            box = note.get_window_extent(renderer).expanded(1.02, 1.1)
            if lines == MAX_RISE - 1 or not any(box.overlaps(other) for other in placed):
                break  # clear, or as high as it goes: left there
            note.remove()
        placed.append(box)
        if lines:  # moved: a leader line back to its point
            note.remove()
            ax.annotate(str(text), (x, y), xytext=(6, 4 + lines * step), fontsize="small",
                        textcoords="offset points",
                        arrowprops={"arrowstyle": "-", "color": "0.6", "lw": 0.6})


def throughput_chart(best: pd.DataFrame, name: str) -> tuple[Figure, str]:
    """Training tokens per second per method at its best LR, with the 95% interval over seeds
    where there are several; † after a method measured on a shared or loaded machine."""
    points = method_points(best).dropna(subset=["tokens_per_s"])
    figure, ax = _figure((8, 1.6 + 0.45 * max(1, len(points))))
    caption = "Training throughput, each method at its best LR"
    ax.set_title(f"{name}: tokens per second")
    ax.set_xlabel("tokens / s")
    if points.empty:
        _empty(ax, "no finished trials yet")
        return figure, caption
    y = np.arange(len(points))
    colors = variant_colors(best)
    ax.barh(y, points["tokens_per_s"], color=[colors[v] for v in points["variant"]])
    spread = points["rate_half"].notna().to_numpy()
    if spread.any():
        ax.errorbar(points["tokens_per_s"][spread], y[spread], xerr=points["rate_half"][spread],
                    fmt="none", ecolor="black", capsize=4)
        caption += f" (mean over seeds, {CONFIDENCE:.0%} CI)"
    marked = set(best.loc[shared(best).to_numpy(), "variant"])
    if marked:
        caption += f"; {SHARED} measured on a shared or loaded machine, not comparable"
    ax.set_yticks(y, [f"{v} {SHARED}" if v in marked else v for v in points["variant"]],
                  fontsize="small")
    ax.invert_yaxis()
    ax.xaxis.set_major_formatter(EngFormatter())
    ax.grid(True, axis="x", alpha=0.3)
    return figure, caption


def optuna_figures(runs_dir: PathArg) -> list[tuple[Figure, str]]:
    """An Optuna sweep's history and, where the trials allow, parameter importances; [] for a
    grid sweep or when no study has been stored yet."""
    sweep = read_sweep(runs_dir)
    studies = load_studies(sweep, Path(runs_dir))
    if not studies:
        return []
    name = str(sweep.get("name") or Path(runs_dir).resolve().name)
    search = sweep.get("search") or {}
    objectives = search.get("objectives") or [{"metric": search.get("metric") or "eval_ppl"}]
    figures = [history_plot(studies, name, str(objectives[0]["metric"]))]
    if (volume := hypervolume_plot(studies, name)) is not None:
        figures.append(volume)
    importances = {label: imp for label, study in studies.items()
                   if (imp := param_importances(study))}
    if importances:
        figures.append(importance_chart(importances, name))
    return figures


def load_studies(sweep: dict[str, Any], runs_dir: Path) -> dict[str, optuna.Study]:
    """Each method's study (named `<sweep>/<label>`) from the storage of `sweep` (sweep.yaml),
    in sweep order. A missing journal file means nothing ran yet; reading does not create it."""
    if (sweep.get("search") or {}).get("sampler", "grid") == "grid":
        return {}
    target = str(sweep.get("storage") or RunsDir(runs_dir).journal)
    if "://" not in target and not Path(target).is_file():
        return {}
    import optuna

    from harness.sweep.search.study import open_storage

    storage = open_storage(target)
    stored = set(optuna.study.get_all_study_names(storage))
    names = {label: f"{sweep.get('name')}/{label}" for label in sweep.get("methods") or {}}
    return {label: optuna.load_study(study_name=study, storage=storage)
            for label, study in names.items() if study in stored}


def param_importances(study: optuna.Study) -> dict[str, float]:
    """fANOVA importances over the params that varied among complete trials (for the first
    objective of several); {} when fewer than two trials completed, nothing varied or every
    value was equal (nothing to explain)."""
    from optuna.importance import FanovaImportanceEvaluator, get_param_importances
    from optuna.trial import TrialState

    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    keys = {key for t in complete for key in t.params}
    varying = sorted(k for k in keys if len({repr(t.params.get(k)) for t in complete}) > 1)
    if len(complete) < 2 or not varying or len({t.values[0] for t in complete}) < 2:
        return {}
    return get_param_importances(study, evaluator=FanovaImportanceEvaluator(seed=0),
                                 target=lambda t: t.values[0],
                                 params=varying)


def history_plot(studies: dict[str, optuna.Study], name: str, metric: str) -> tuple[Figure, str]:
    """Every complete trial's value by trial number, and the best so far, per method (of a
    multi-objective study: its first objective's)."""
    from optuna.study import StudyDirection
    from optuna.trial import TrialState

    figure, ax = _figure((8, 5))
    caption = "Optuna optimization history: each complete trial, and the best so far"
    ax.set_title(f"{name}: Optuna optimization history")
    ax.set_xlabel("trial number")
    ax.set_ylabel(metric)
    plotted = False
    for i, (label, study) in enumerate(studies.items()):
        trials = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        if not trials:
            continue
        numbers = np.array([t.number for t in trials])
        values = np.array([t.values[0] for t in trials], dtype=float)
        running = np.minimum if study.directions[0] == StudyDirection.MINIMIZE else np.maximum
        ax.scatter(numbers, values, s=20, alpha=0.5, color=f"C{i}")
        ax.step(numbers, running.accumulate(values), where="post", color=f"C{i}",
                label=f"{label} (best so far)")
        plotted = True
    if not plotted:
        _empty(ax, "no complete trials yet")
        return figure, caption
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize="small")
    ax.grid(True, alpha=0.3)
    return figure, caption


def importance_chart(
    importances: dict[str, dict[str, float]], name: str
) -> tuple[Figure, str]:
    """One panel per method: how much of the metric's variance each searched key explains."""
    rows = sum(len(imp) for imp in importances.values())
    figure = Figure(figsize=(8, 1.2 + 0.9 * len(importances) + 0.3 * rows), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(importances), 1, squeeze=False)[:, 0]
    for ax, (label, imp) in zip(axes, importances.items(), strict=True):
        y = np.arange(len(imp))
        ax.barh(y, list(imp.values()), color="tab:green")
        ax.set_yticks(y, list(imp), fontsize="small")
        ax.invert_yaxis()
        ax.set_xlim(0, 1)
        ax.set_title(label, fontsize="medium")
        ax.grid(True, axis="x", alpha=0.3)
    axes[-1].set_xlabel("importance (fANOVA, share of variance)")
    figure.suptitle(f"{name}: Optuna parameter importances")
    return figure, "Optuna parameter importances per method"


def _figure(size: tuple[float, float]) -> tuple[Figure, Axes]:
    figure = Figure(figsize=size, layout="constrained")
    FigureCanvasAgg(figure)
    return figure, figure.add_subplot()


def _empty(ax: Axes, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes)
