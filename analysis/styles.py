"""How a figure with many lines stays readable: one colour per method, a line style per
setting of it (learning rate, memory modifiers, precision, seed), the legend outside the axes.

Ten methods fit matplotlib's default cycle; up to twenty take tab20, more are spread evenly
around the hue circle, so no two methods share a colour.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.legend import Legend

# Line styles a reader tells apart at a glance, then markers on them for further settings.
LINESTYLES: tuple[Any, ...] = ("-", "--", ":", "-.", (0, (5, 1)), (0, (3, 1, 1, 1, 1, 1)),
                               (0, (1, 3)), (0, (8, 3, 2, 3)))
MARKERS = ("o", "s", "^", "v", "D", "x")
LEGEND_ROWS = 24  # entries per legend column


def method_colors(methods: Iterable[str]) -> dict[str, Any]:
    """A distinct colour per method, in first-seen order."""
    names = list(dict.fromkeys(methods))
    if len(names) <= 10:
        return {m: f"C{i}" for i, m in enumerate(names)}
    if len(names) <= 20:
        tab20 = colormaps["tab20"]
        return {m: tab20(i) for i, m in enumerate(names)}
    hsv = colormaps["hsv"]
    return {m: hsv(i / len(names)) for i, m in enumerate(names)}


def setting_styles(settings: Iterable[str]) -> dict[str, dict[str, Any]]:
    """Line style (and past eight settings, a marker) per setting, in first-seen order; the
    same setting gets the same style under every method."""
    names = list(dict.fromkeys(settings))
    return {s: {"linestyle": LINESTYLES[i % len(LINESTYLES)],
                "marker": MARKERS[(i // len(LINESTYLES)) % len(MARKERS)]}
            for i, s in enumerate(names)}


def legend_outside(ax: Axes) -> Legend | None:
    """The legend to the right of the axes, never over a curve; None when nothing is labelled."""
    handles = ax.get_legend_handles_labels()[0]
    if not handles:
        return None
    columns = -(-len(handles) // LEGEND_ROWS)
    return ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0,
                     fontsize="small", ncols=columns)
