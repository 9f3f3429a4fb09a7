"""analysis/front.py: the Pareto front of a sweep's trials, the hypervolume of a study, and the
report's front table and labels that do not print over each other."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.text import Text
from test_plots import write_runs

from harness.analysis import load_runs, write_report
from harness.analysis.figures import best_lr_trials, label_points, pareto_plot
from harness.analysis.front import (
    DEFAULT,
    front_table,
    hypervolume_history,
    non_dominated,
    objectives_of,
)


def test_non_dominated_keeps_ties_and_drops_what_another_beats_everywhere():
    values = np.array([[1, 5, 3],   # on the front
                       [2, 4, 3],   # on the front (better on the second)
                       [2, 5, 3],   # dominated by both above
                       [1, 5, 3],   # equal to the first: stays
                       [3, 1, 9]])  # on the front (best second)
    assert non_dominated(values).tolist() == [True, True, False, True, True]


def trials_frame() -> pd.DataFrame:
    """Five ok trials and a failed one; ppl, memory (bytes), tok/s and wall time."""
    rows = [("a", "ok", 30.0, 10e9, 900.0, 3600.0), ("b", "ok", 25.0, 20e9, 800.0, 7200.0),
            ("c", "ok", 35.0, 20e9, 950.0, 3600.0), ("d", "ok", 25.0, 25e9, 700.0, 9000.0),
            ("e", "ok", 40.0, 8e9, 500.0, 1800.0), ("f", "failed", 1.0, 1e9, 9e9, 1.0)]
    frame = pd.DataFrame(rows, columns=["trial", "status", "eval_ppl", "peak_memory_bytes",
                                        "tokens_per_s", "wall_s"])
    return frame.assign(method=frame["trial"], memory="none", precision="32-true", lr=1e-3,
                        seed=0)


def test_front_table_lists_the_non_dominated_trials_best_first():
    """Default objectives (ppl, memory, hours, all lower): d is beaten by b (equal ppl, less
    memory, fewer hours) and c by a; the failed trial is never on it. With tok/s maximized
    instead of hours, c (fastest) joins and d stays out."""
    trials = trials_frame()
    table = front_table(trials, list(DEFAULT))
    assert table["trial"].tolist() == ["b", "a", "e"]
    assert table.columns.tolist() == ["trial", "method", "lr", "seed", "eval ppl",
                                      "peak memory", "trial-hours"]
    assert table["trial-hours"].tolist() == ["2.000", "1.000", "0.500"]
    fast = front_table(trials, [("eval_ppl", "minimize"), ("peak_memory_bytes", "minimize"),
                                ("tokens_per_s", "maximize")])
    assert fast["trial"].tolist() == ["b", "a", "c", "e"]


def test_objectives_are_the_searchs_own_or_those_the_trials_recorded():
    search = {"search": {"objectives": [{"metric": "eval_ppl"},
                                        {"metric": "tokens_per_s", "direction": "maximize"}]}}
    assert objectives_of(search, trials_frame()) == [("eval_ppl", "minimize"),
                                                     ("tokens_per_s", "maximize")]
    assert objectives_of({}, trials_frame()) == list(DEFAULT)
    no_wall = trials_frame().drop(columns="wall_s")
    assert objectives_of({}, no_wall) == list(DEFAULT[:2])


def test_hypervolume_grows_as_trials_widen_the_front():
    """Scaled to [0, 1] with reference 1.1: (0, 1) and (1, 0) dominate 0.1·1.1 + 1.1·0.1 -
    0.1·0.1 = 0.21; adding (0.5, 0.5) makes the staircase 0.5·0.1 + 0.5·0.6 + 0.1·1.1 = 0.46; a
    dominated (0.9, 0.9) adds nothing."""
    counts, volumes = hypervolume_history(np.array([[0, 1], [1, 0], [0.5, 0.5], [0.9, 0.9]]))
    assert counts.tolist() == [1, 2, 3, 4]
    assert volumes[1:] == pytest.approx([0.21, 0.46, 0.46])


def test_labels_of_coinciding_points_do_not_overlap(tmp_path):
    """Three methods at nearly the same memory and perplexity (lora, relora and lowrank in the
    quickstart) get three label boxes that do not intersect once the figure is drawn."""
    trials = [(f"{m}-1", m, None, 1e-3, 0, "ok", ppl, 1000, peak) for m, ppl, peak in
              (("lora", 300.0, 1.000), ("relora", 301.0, 1.001), ("lowrank", 299.0, 1.002),
               ("full", 200.0, 2.0))]
    best = best_lr_trials(load_runs(write_runs(tmp_path / "runs", trials)))
    figure, _ = pareto_plot(best, "demo")
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    boxes = [Text.get_window_extent(t, renderer) for t in figure.axes[0].texts]  # no leaders
    assert len(boxes) == 4
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])


def test_labels_of_points_apart_within_a_narrow_range_stay_beside_them():
    """Four points at one height, spread across an x range 0.5% wide far from 0 (the wall
    hours of like trials), get their labels beside them, none moved up: measured before the
    axes were scaled to the points, all four fell on one spot and climbed over each other
    (the report's cost figure). A fifth point, unlabelled, makes the y range wide."""
    figure = Figure(figsize=(6, 4))
    FigureCanvasAgg(figure)
    ax = figure.subplots()
    xs = pd.Series([0.05556, 0.05565, 0.05574, 0.05583])
    ys = pd.Series([40.0, 40.01, 40.02, 40.03])
    ax.scatter([*xs, 0.0557], [*ys, 50.0])
    label_points(ax, xs, ys, pd.Series(["a", "b", "c", "d"]))
    assert [t.xyann for t in ax.texts] == [(6, 4)] * 4  # where a label is first put
    assert all(t.arrow_patch is None for t in ax.texts)  # no leader line: none moved


def test_the_report_has_the_front_table(tmp_path):
    trials = [("full-1", "full", None, 1e-3, 0, "ok", 30.0, 1000, 2.0),
              ("lora-1", "lora", None, 1e-3, 0, "ok", 40.0, 1200, 1.0),
              ("galore-1", "galore", None, 1e-3, 0, "ok", 45.0, 900, 1.5)]
    runs = write_runs(tmp_path / "runs", trials)
    write_report([runs], tmp_path / "report")
    page = (tmp_path / "report" / "report.md").read_text()
    front = page.split("## Pareto front", 1)[1].split("##", 1)[0]
    assert "full-1" in front and "lora-1" in front and "galore-1" not in front
    assert "2 of the 3 finished trials are on the Pareto front of eval ppl" in front
