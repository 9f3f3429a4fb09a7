"""The report's figures: curves over tokens, and where each trial's peak memory goes."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import EngFormatter, LogFormatter

from harness.trials import atomic_write

from .format import VARIANT_DEFAULTS, fill_variants, variant_label, whole
from .styles import legend_outside, method_colors, setting_styles

# Past this many trials a figure draws one mark per method setting, not one per trial (2,000
# bars made a 7.4 MB memory.png no one could read, and 53 of a 58 s report)
PER_TRIAL = 40
# Stacked segments of the memory chart: summary field -> legend text.
SEGMENTS = {
    "param_bytes": "parameters",
    "grad_bytes": "gradients",
    "optimizer_state_bytes": "optimizer state",
    "extra_bytes": "projections, quantization constants",
}


def save_png(figure: Figure, caption: str, path: Path) -> str:
    png = io.BytesIO()
    figure.savefig(png, format="png", dpi=120)
    atomic_write(path, png.getvalue())
    return caption


def curves_plot(steps: pd.DataFrame, trials: pd.DataFrame, name: str) -> tuple[Figure, str]:
    """Eval perplexity per trial; training loss when no eval has run yet, so early runs plot.
    One colour per method, a line style per setting (LR, memory, seed), the legend outside."""
    column, quantity = "eval_ppl", "Eval perplexity"
    points = logged_points(steps, "eval", column)
    if points.empty:
        points, column, quantity = logged_points(steps, "train", "loss"), "loss", "Training loss"
    figure = Figure(figsize=(8, 5), layout="constrained")
    FigureCanvasAgg(figure)
    ax = figure.add_subplot()
    labels = trial_labels(trials)
    keys = zip(trials["run_dir"], trials["trial"], strict=True)
    methods = dict(zip(keys, trials["method"].astype(str), strict=True))
    settings = {key: label.removeprefix(methods[key]).strip() for key, label in labels.items()}
    colors, styles = method_colors(methods.values()), setting_styles(settings.values())
    for key, curve in points.groupby(["run_dir", "trial"], sort=False):
        curve = curve.sort_values("tokens")
        ax.plot(curve["tokens"], curve[column], markersize=3, label=labels[key],
                color=colors[methods[key]], **styles[settings[key]])
    if points.empty:
        ax.text(0.5, 0.5, "no metrics yet", ha="center", va="center", transform=ax.transAxes)
    else:
        plain_log_y(ax)
        legend_outside(ax)
    caption = f"{quantity} vs tokens seen"
    ax.set_title(f"{name}: {caption.lower()}")
    ax.set_xlabel("tokens seen")
    ax.set_ylabel(f"{quantity.lower()} (log scale)")
    ax.xaxis.set_major_formatter(EngFormatter())
    ax.grid(True, which="both", alpha=0.3)
    return figure, caption


def logged_points(steps: pd.DataFrame, kind: str, column: str) -> pd.DataFrame:
    """The metrics lines of one kind that logged `column`; none when no trial logged it yet."""
    if column not in steps:
        return steps.iloc[0:0]
    return steps[steps["kind"] == kind].dropna(subset=["tokens", column])


def plain_log_y(ax: Axes) -> None:
    """Log y with plain numbers ("40", not "4x10^1"); minor labels only while the range is
    narrow."""
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(LogFormatter(labelOnlyBase=False))
    ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.4)))


def trial_labels(trials: pd.DataFrame) -> dict[tuple[str, str], str]:
    """Legend text "<method> lr=<lr>", plus the memory modifiers and the seed only when they
    vary across trials."""
    several_seeds = trials["seed"].nunique() > 1
    memory = trials["memory"].fillna("none") if "memory" in trials else pd.Series("none")
    several_memories = memory.nunique() > 1
    labels = {}
    columns = ["run_dir", "trial", "method", "lr", "seed"]
    rows = trials[columns].itertuples(index=False)
    for (run_dir, trial, method, lr, seed), mem in zip(rows, memory, strict=False):
        label = f"{method} lr={'?' if pd.isna(lr) else format(lr, 'g')}"
        label += f" [{mem}]" if several_memories else ""
        labels[(run_dir, trial)] = label + (f" seed={whole(seed, '?')}" if several_seeds else "")
    return labels

def memory_chart(trials: pd.DataFrame, name: str) -> tuple[Figure, str]:
    """Stacked bars per trial: parameters, gradients, optimizer state and extras as the method
    counted them, and the rest of the peak of live tensors (activations, temporaries) as "other".
    States kept on the host by `optimizer_offload: host` leave a CUDA device's bar. Past
    PER_TRIAL trials, one bar per method setting (method, memory modifiers, precision: learning
    rates and seeds folded, as the tables fold them), the mean of its trials."""
    done = trials[trials["param_bytes"].notna()].reset_index(drop=True)
    parts = pd.DataFrame({k: pd.to_numeric(done[k], errors="coerce") for k in SEGMENTS}).fillna(0)
    on_host = (done.get("memory.optimizer_offload") == "host") & done["device"].astype(
        str).str.startswith("cuda")
    parts.loc[on_host, "optimizer_state_bytes"] = 0
    parts["other"] = (done["peak_memory_bytes"].fillna(0) - parts.sum(axis=1)).clip(lower=0)
    if len(done) > PER_TRIAL:
        keys = fill_variants(done)[list(VARIANT_DEFAULTS)]
        grouped = parts.groupby([keys[k] for k in keys], sort=False)
        parts = grouped.mean()
        names = [f"{variant_label(*key)} ({n} trials)"
                 for key, n in zip(parts.index, grouped.size(), strict=True)]
        caption = "Memory breakdown per method setting"
    else:
        labels = trial_labels(done)
        names = [labels[(r, t)] for r, t in zip(done["run_dir"], done["trial"], strict=True)]
        caption = "Memory breakdown per trial"
    longest = max(map(len, names), default=0)
    size = (max(9.0, 5 + 0.08 * longest), 2.2 + 0.4 * max(1, len(names)))
    figure = Figure(figsize=size, layout="constrained")
    FigureCanvasAgg(figure)
    ax = figure.add_subplot()
    ax.set_title(f"{name}: {caption.lower()}")
    if done.empty:
        ax.text(0.5, 0.5, "no finished trials yet", ha="center", va="center",
                transform=ax.transAxes)
        return figure, caption
    y = np.arange(len(names))
    left = np.zeros(len(names))
    for key, legend in [*SEGMENTS.items(), ("other", "activations / other")]:
        values = parts[key].to_numpy(dtype=float) / 1e9
        ax.barh(y, values, left=left, label=legend)
        left += values
    ax.set_yticks(y, names, fontsize="small")
    ax.invert_yaxis()
    # the bars add up to peak_memory_bytes (harness/cost/tensor_peak.py), not peak_rss_bytes
    ax.set_xlabel("GB (peak of live tensors: allocated on CUDA, profiled on CPU)")
    figure.legend(fontsize="small", loc="outside lower center", ncol=3)
    ax.grid(True, axis="x", alpha=0.3)
    return figure, caption
