"""Figures of the fits: speedup over tuned AdamW (loss against tokens with AdamW's law, and the
speedup read off it) and scaling across model sizes (loss against parameters with each method's
law run out to LLaMA-7B dashed, and against compute).

Every figure function returns (Figure, caption), like those in plots.py, for `save_png`.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import EngFormatter, NullFormatter

from .fits import PowerLaw
from .plots import plain_log_y
from .scaling import LLAMA_7B, Scaling
from .speedup import Speedups
from .styles import legend_outside, method_colors

EXTRAPOLATED = "extrapolated"  # in the label of every line drawn past the points fitted
CURVE_POINTS = 200


def speedup_figure(result: Speedups, name: str) -> tuple[Figure, str]:
    """Per model: final loss against tokens, AdamW's law solid over its budgets and dashed
    past them, each method's points (95% bars over seeds) and a dotted line from each to the
    tokens AdamW needs for that loss; beside it, the speedup per budget with its interval."""
    models = list(result.fits)
    figure = Figure(figsize=(12, 1 + 4 * max(1, len(models))), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(max(1, len(models)), 2, squeeze=False)
    colors = method_colors(result.points["method"].astype(str))
    for (loss_ax, speed_ax), model in zip(axes, models, strict=False):
        points = result.points[result.points["model"] == model]
        law = result.fits[model]
        _loss_panel(loss_ax, points, law, result.spans[model], colors)
        _speedup_panel(speed_ax, points, colors)
        loss_ax.set_title(f"{model}: final loss vs tokens", fontsize="medium")
        speed_ax.set_title(f"{model}: speedup over tuned AdamW", fontsize="medium")
    legend_outside(axes[0][1])
    figure.suptitle(f"{name}: speedup over tuned AdamW")
    return figure, ("Final eval loss vs tokens with AdamW's fitted law (dashed: extrapolated), "
                    "and each method's speedup D_AdamW(L)/D with its 95% interval over seeds")


def _loss_panel(ax: Axes, points: pd.DataFrame, law: PowerLaw, span: tuple[float, float],
                colors: dict) -> None:
    budgets = points["tokens"].to_numpy(dtype=float)
    reach = np.nan_to_num(points["tokens_adamw"].to_numpy(dtype=float), nan=budgets.max())
    drawn = (budgets.min() / 1.3, max(budgets.max(), reach.max()) * 1.3)
    _law_lines(ax, law, span, drawn, "AdamW's law", "0.3")
    ax.axhline(law.E, color="0.5", linestyle=":", linewidth=1, label="AdamW's fitted floor E")
    for variant, own in points.groupby("variant", sort=False):
        color = colors[str(own["method"].iloc[0])]
        ax.errorbar(own["tokens"], own["mean"], yerr=own["ci"].fillna(0), fmt="o", ms=4,
                    capsize=3, color=color, label=str(variant))
        reads = own.dropna(subset=["tokens_adamw"])
        for budget, mean, tokens in zip(reads["tokens"], reads["mean"], reads["tokens_adamw"],
                                        strict=True):
            ax.plot([budget, tokens], [mean, mean], ":", color=color, linewidth=0.9)
    ax.set_xscale("log")
    ax.set_xlabel("tokens D")
    ax.set_ylabel("final eval loss (nats/token)")
    ax.xaxis.set_major_formatter(EngFormatter())
    ax.grid(True, which="both", alpha=0.3)


def _speedup_panel(ax: Axes, points: pd.DataFrame, colors: dict) -> None:
    for variant, own in points.groupby("variant", sort=False):
        own = own.dropna(subset=["speedup"])
        if own.empty:
            continue
        low = (own["speedup"] - own["low"]).where(np.isfinite(own["low"]), 0).fillna(0)
        high = (own["high"] - own["speedup"]).where(np.isfinite(own["high"]), 0).fillna(0)
        ax.errorbar(own["tokens"], own["speedup"], yerr=[low, high], fmt="o-", ms=4, capsize=3,
                    color=colors[str(own["method"].iloc[0])], label=str(variant))
    ax.axhline(1.0, color="0.3", linewidth=1, linestyle="--", label="AdamW (1×)")
    ax.set_xlabel("tokens D")
    ax.set_ylabel("speedup: D_AdamW(L) / D (log scale)")
    plain_log_y(ax)
    _token_ticks(ax, points["tokens"])
    ax.grid(True, which="both", alpha=0.3)


def _token_ticks(ax: Axes, budgets: pd.Series) -> None:
    """Log x with a tick at each budget, in engineering notation ("4 M")."""
    ax.set_xscale("log")
    ax.set_xticks(sorted(set(budgets.astype(float))))
    ax.xaxis.set_major_formatter(EngFormatter())
    ax.xaxis.set_minor_formatter(NullFormatter())


def scaling_figure(result: Scaling, name: str) -> tuple[Figure, str]:
    """Final loss against parameters N (each method's law solid over its sizes, dashed from
    its largest size to LLaMA-7B, labelled extrapolated) and against compute C = 6·N·D."""
    figure = Figure(figsize=(13, 5), layout="constrained")
    FigureCanvasAgg(figure)
    by_n, by_c = figure.subplots(1, 2, sharey=True)
    colors = method_colors(result.points["method"].astype(str))
    for variant, own in result.points.groupby("variant", sort=False):
        color = colors[str(own["method"].iloc[0])]
        by_n.errorbar(own["params"], own["mean"], yerr=own["ci"].fillna(0), fmt="o", ms=4,
                      capsize=3, color=color, label=str(variant))
        by_c.plot(own["compute"], own["mean"], "o-", ms=4, color=color, label=str(variant))
        law = result.fits.get(str(variant))
        if law is not None:
            span = (float(own["params"].min()), float(own["params"].max()))
            _law_lines(by_n, law, span, (span[0], LLAMA_7B), str(variant), color)
            by_n.plot([LLAMA_7B], [float(law.loss(LLAMA_7B))], "o", mfc="none", color=color)
    by_n.axvline(LLAMA_7B, color="0.4", linestyle=":", linewidth=1,
                 label=f"LLaMA-7B ({LLAMA_7B / 1e9:.2f}B): {EXTRAPOLATED}")
    by_n.set_xlabel("parameters N (total)")
    by_n.set_ylabel("final eval loss (nats/token)")
    by_c.set_xlabel("compute C = 6·N·D (FLOPs)")
    for ax in (by_n, by_c):
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(EngFormatter())
        ax.grid(True, which="both", alpha=0.3)
    figure.legend(*by_n.get_legend_handles_labels(), loc="outside lower center", ncols=4,
                  fontsize="small")
    figure.suptitle(f"{name}: scaling across model sizes (dashed: {EXTRAPOLATED})")
    return figure, ("Final eval loss vs parameters with each method's power law (dashed: "
                    "extrapolated to LLaMA-7B, not measured) and vs compute 6·N·D")


def _law_lines(ax: Axes, law: PowerLaw, fitted: tuple[float, float], drawn: tuple[float, float],
               label: str, color: str) -> None:
    """The law solid over the range it was fitted on, dashed (labelled extrapolated) on either
    side of it within `drawn`."""
    inside = np.geomspace(*fitted, CURVE_POINTS)
    ax.plot(inside, law.loss(inside), "-", color=color, linewidth=1.2, label=f"{label} (fit)")
    for lo, hi in ((drawn[0], fitted[0]), (fitted[1], drawn[1])):
        if hi > lo * (1 + 1e-9):
            outside = np.geomspace(lo, hi, CURVE_POINTS)
            ax.plot(outside, law.loss(outside), "--", color=color, linewidth=1.2,
                    label=f"{label} ({EXTRAPOLATED})")
