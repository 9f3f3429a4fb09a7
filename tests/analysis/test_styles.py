"""Figures with many lines stay readable: one colour per method, a line style per setting (the
learning rate; memory modifiers), the legend outside the axes. Checked on the drawn artists."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from matplotlib.colors import to_rgba

from harness.analysis import load_runs, load_steps
from harness.analysis.figures import best_lr_trials, eval_curves
from harness.analysis.plots import curves_plot

METHODS = ["full", "adam8bit", "lora", "relora", "qlora", "galore"]
LRS = [1e-3, 3e-3, 1e-2]


def write_runs(root: Path, methods: list[str], lrs: list[float],
               memory: dict[str, dict] | None = None) -> Path:
    """One trial per method (and memory setting) and LR, with two evals each."""
    (root / "trials").mkdir(parents=True)
    (root / "sweep.yaml").write_text(yaml.safe_dump(
        {"name": "many", "methods": {m: {} for m in methods}}))
    settings = memory or {"": {}}
    for i, (method, lr, (tag, mem)) in enumerate(
            (m, lr, s) for m in methods for lr in lrs for s in settings.items()):
        folder = root / "trials" / f"{method}{tag}-{i}"
        folder.mkdir()
        (folder / "config.yaml").write_text(yaml.safe_dump(
            {"label": method, "seed": 0, "method": {"name": method}, "train": {"lr": lr},
             "memory": mem}))
        ppl = 100.0 + i
        (folder / "summary.json").write_text(json.dumps(
            {"trial": folder.name, "status": "ok", "method": method, "lr": lr, "seed": 0,
             "eval_ppl": ppl, "tokens_per_s": 1.0, "peak_memory_bytes": 1e9}))
        lines = [{"kind": "eval", "step": s, "tokens": s * 100, "eval_ppl": ppl * f}
                 for s, f in ((10, 2), (20, 1))]
        (folder / "metrics.jsonl").write_text("\n".join(map(json.dumps, lines)) + "\n")
    return root


def legend_outside_axes(figure, ax) -> bool:
    """The legend's box right of the axes' box and inside the figure, once drawn."""
    figure.canvas.draw()
    legend, axes = ax.get_legend().get_window_extent(), ax.get_window_extent()
    return legend.x0 >= axes.x1 and legend.x1 <= figure.bbox.x1 and not legend.overlaps(axes)


def test_eighteen_trial_curves_one_colour_per_method_one_style_per_lr(tmp_path):
    runs = write_runs(tmp_path / "runs", METHODS, LRS)
    trials = load_runs(runs)
    figure, _ = curves_plot(load_steps(runs, trials), trials, "many")
    ax = figure.axes[0]
    lines = ax.get_lines()
    assert len(lines) == 18
    colours: dict[str, set] = {}
    styles: dict[str, set] = {}
    for line in lines:
        method, lr = line.get_label().split(" ")
        colours.setdefault(method, set()).add(to_rgba(line.get_color()))
        styles.setdefault(lr, set()).add(line.get_linestyle())
    assert all(len(c) == 1 for c in colours.values())  # a method: one colour
    assert len(set.union(*colours.values())) == len(METHODS)  # methods: all different
    assert all(len(s) == 1 for s in styles.values())  # an LR: one style, whatever the method
    assert len(set.union(*styles.values())) == len(LRS)
    assert legend_outside_axes(figure, ax)


def test_twelve_methods_get_twelve_colours(tmp_path):
    methods = [f"m{i:02d}" for i in range(12)]  # past the 10 of matplotlib's default cycle
    runs = write_runs(tmp_path / "runs", methods, [1e-3])
    trials = load_runs(runs)
    figure, _ = curves_plot(load_steps(runs, trials), trials, "many")
    assert len({to_rgba(line.get_color()) for line in figure.axes[0].get_lines()}) == 12


def test_method_curves_colour_the_method_and_style_its_memory_setting(tmp_path):
    runs = write_runs(tmp_path / "runs", ["full", "galore"], [1e-3],
                      memory={"": {}, "-rc": {"recompute": "full"}})
    trials = load_runs(runs)
    figure, _ = eval_curves(load_steps(runs, trials), best_lr_trials(trials), "many")
    ax = figure.axes[0]
    line = {ln.get_label().split(" lr=")[0]: ln for ln in ax.get_lines()}
    assert set(line) == {"full", "full (recompute full)", "galore", "galore (recompute full)"}
    for method in ("full", "galore"):
        plain, recompute = line[method], line[f"{method} (recompute full)"]
        assert to_rgba(plain.get_color()) == to_rgba(recompute.get_color())
        assert plain.get_linestyle() != recompute.get_linestyle()
    assert to_rgba(line["full"].get_color()) != to_rgba(line["galore"].get_color())
    assert line["full"].get_linestyle() == line["galore"].get_linestyle()
    assert legend_outside_axes(figure, ax)
