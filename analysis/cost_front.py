"""Perplexity per GB and per hour, the question the harness exists for: each method at its best
learning rate placed against its peak memory and its compute time (wall time × processes:
GPU-hours on GPUs, CPU-process-hours on CPUs), the Pareto front of the three, and a table
ranking the methods by each.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from harness.config.metrics import METRICS

from .caveats import SHARED, conditioned, numbers, shared
from .figures import best_lr_trials, label_points, variant_colors
from .format import cell, metric_cells, text_table
from .front import non_dominated
from .html import Block, Heading, Image, Paragraph, Table
from .plots import plain_log_y, save_png

TITLE = "Perplexity per GB and per hour"
OBJECTIVES = ("eval_ppl", "peak_gb", "hours")  # each lower is better
FILE = "cost.png"


def process_hours(trials: pd.DataFrame) -> pd.Series:
    """Each trial's wall time × the processes (GPUs) it ran on, in hours; a trial from before
    the summary recorded `processes` counts one."""
    return numbers(trials, "wall_s") * numbers(trials, "processes").fillna(1) / 3600


def hours_unit(trials: pd.DataFrame) -> str:
    """What the hours count, by where the trials ran: GPU-hours only when every trial ran on
    CUDA, CPU-process-hours when every one ran on CPU, else process-hours."""
    devices = trials.get("device", pd.Series(dtype=object)).dropna().astype(str)
    if len(devices) and devices.str.startswith("cuda").all():
        return "GPU-hours"
    if len(devices) and (devices == "cpu").all():
        return "CPU-process-hours"
    return "process-hours"


def cost_points(best: pd.DataFrame) -> pd.DataFrame:
    """One row per variant of `best` (`figures.best_lr_trials`): mean eval ppl and hours over
    seeds, the largest peak memory in GB, and whether any seed's time was measured shared."""
    best = best.assign(hours=process_hours(best), peak_gb=best["peak_memory_bytes"] / 1e9,
                       shared=shared(best).to_numpy())
    points = best.groupby("variant", sort=False).agg(  # seeds folded as the registry says
        method=("method", "first"), eval_ppl=("eval_ppl", METRICS["eval_ppl"].across_seeds),
        peak_gb=("peak_gb", METRICS["peak_memory_bytes"].across_seeds),
        hours=("hours", METRICS["wall_s"].across_seeds), shared=("shared", "any"))
    points["front"] = front_of(points, [c for c in OBJECTIVES if points[c].notna().any()])
    return points.reset_index()


def front_of(points: pd.DataFrame, columns: Sequence[str]) -> pd.Series:
    """Rows no other row is at least as good on every column and better on one (lower is
    better); False for rows missing one of them."""
    complete = points[list(columns)].notna().all(axis=1)
    on = pd.Series(False, index=points.index)
    if complete.any() and columns:
        on[complete] = non_dominated(points.loc[complete, list(columns)].to_numpy(dtype=float))
    return on


def cost_table(points: pd.DataFrame, unit: str) -> pd.DataFrame:
    """Each method's eval ppl, peak memory and hours with its rank by each (1 = lowest; ties
    share a rank) and whether it is on the front of the three; ordered by perplexity."""
    ranks = {c: points[c].rank(method="min") for c in OBJECTIVES}
    order = points.assign(_r=ranks["eval_ppl"]).sort_values(["_r", "peak_gb"], kind="stable")
    table = pd.DataFrame({
        "method": order["variant"],
        METRICS["eval_ppl"].header: metric_cells("eval_ppl", order["eval_ppl"]),
        "peak GB": order["peak_gb"].map(lambda v: cell(v, ".3g")),
        unit: [cell(h, ".3g") + (f" {SHARED}" if s and not pd.isna(h) else "")
               for h, s in zip(order["hours"], order["shared"], strict=True)],
    })
    for column, header in zip(OBJECTIVES, ("ppl", "memory", "hours"), strict=True):
        table[f"rank: {header}"] = ranks[column][order.index].map(lambda v: cell(v, ".0f"))
    table["front"] = np.where(order["front"], "yes", "")
    return table.reset_index(drop=True)


def cost_figure(points: pd.DataFrame, best: pd.DataFrame, unit: str,
                name: str) -> tuple[Figure, str]:
    """Eval perplexity against peak memory and against hours, side by side on one perplexity
    axis; the methods on the front of all three ringed."""
    figure = Figure(figsize=(11, 5), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, 2, sharey=True)
    colors = variant_colors(best)
    caption = (f"Eval perplexity vs peak memory and vs {unit}, each method at its best LR; "
               "ringed: the Pareto front of all three")
    for ax, column, label in zip(axes, ("peak_gb", "hours"),
                                 ("peak memory (GB)", f"{unit} (wall time × processes)"),
                                 strict=True):
        ax.set_xlabel(label)
        ax.grid(True, which="both", alpha=0.3)
        shown = points.dropna(subset=[column, "eval_ppl"])
        if shown.empty:
            ax.text(0.5, 0.5, "not recorded", ha="center", va="center", transform=ax.transAxes)
            continue
        on = shown[shown["front"]]
        ax.scatter(on[column], on["eval_ppl"], s=160, facecolors="none", edgecolors="0.2",
                   linewidths=1.5, label="on the front of ppl, memory and hours")
        ax.scatter(shown[column], shown["eval_ppl"], s=40, zorder=3,
                   color=[colors[v] for v in shown["variant"]])
        plain_log_y(ax)
        label_points(ax, shown[column], shown["eval_ppl"], shown["variant"])
    axes[0].set_ylabel("eval perplexity (log scale)")
    figure.suptitle(f"{name}: perplexity per GB and per hour")
    if points["front"].any():  # one ring in the legend, for both panels
        figure.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center",
                      fontsize="small")
    return figure, caption


def front_line(points: pd.DataFrame, unit: str) -> str:
    on = points[points["front"]]["variant"].tolist()
    measured = [c for c in OBJECTIVES if points[c].notna().any()]
    names = {"eval_ppl": "eval perplexity", "peak_gb": "peak memory", "hours": unit}
    goals = ", ".join(names[c] for c in measured)
    text = (f"On the Pareto front of {goals} (no other method at its best LR is at least as "
            f"good on all and better on one): {', '.join(on) or 'none'}.")
    if "hours" not in measured:
        text += " Hours are left out: these trials record no wall time."
    return (text + f" {unit}: each trial's wall time (build, training, evaluation) × its "
            "processes, the mean over seeds; memory: the peak of live tensors (1 GB = 10^9 "
            f"bytes). Ranks: 1 is the lowest. {SHARED}: measured on a shared or loaded machine.")


def cost_section(pretraining: pd.DataFrame, order: Sequence[str], name: str,
                 out: Path) -> tuple[list[Block], str]:
    """The report's blocks (heading, table, note, cost.png) and the terminal's text; nothing
    when no pretraining trial finished."""
    best = best_lr_trials(conditioned(pretraining), order)
    if best.empty:
        return [], ""
    unit = hours_unit(best)
    points = cost_points(best)
    table, note = cost_table(points, unit), front_line(points, unit)
    figure = cost_figure(points, best, unit, name)
    image = Image(out / FILE, save_png(*figure, out / FILE))
    blocks: list[Block] = [Heading(TITLE), Table(table), Paragraph(note), image]
    return blocks, f"{TITLE}\n{text_table(table)}\n{note}"
