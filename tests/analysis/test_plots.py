"""Tests for the method-comparison figures on run directories written with known numbers."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import optuna
import pandas as pd
import pytest
import yaml
from matplotlib.collections import PolyCollection
from matplotlib.colors import to_rgb
from optuna.storages.journal import JournalFileBackend, JournalStorage

from harness.analysis import load_runs, load_steps
from harness.analysis.figures import (
    best_lr_trials,
    eval_curves,
    loss_curves,
    method_points,
    optuna_figures,
    pareto_front,
    pareto_plot,
    seed_band,
    throughput_chart,
)

T_975_DF2 = 4.302652729911275  # Student t, 97.5% quantile, 2 degrees of freedom (3 seeds)

# (trial, method, memory, lr, seed, status, final eval ppl, tok/s, peak memory in GB)
TRIALS = [
    ("f0", "full", None, 1e-3, 0, "ok", 30.0, 1000.0, 3.0),
    ("f1", "full", None, 1e-3, 1, "ok", 32.0, 1000.0, 3.0),
    ("f2", "full", None, 1e-3, 2, "ok", 34.0, 1000.0, 3.0),
    ("f3", "full", None, 3e-3, 0, "ok", 20.0, 900.0, 2.9),
    ("f4", "full", None, 3e-3, 1, "ok", 22.0, 1000.0, 3.0),
    ("f5", "full", None, 3e-3, 2, "ok", 27.0, 1100.0, 2.8),
    ("r0", "full", {"recompute": "full"}, 3e-3, 0, "ok", 23.5, 700.0, 1.5),
    ("g0", "galore", None, 1e-2, 0, "ok", 25.0, 800.0, 2.0),
    ("g1", "galore", None, 1e-2, 1, "ok", 27.0, 820.0, 2.0),
    ("g2", "galore", None, 2e-2, 0, "nan", 5.0, 800.0, 2.0),
    ("l0", "lora", None, 1e-3, 0, "ok", 40.0, 1200.0, 1.0),
    ("a0", "adam8bit", None, 1e-3, 0, "ok", 24.0, 950.0, 3.5),
    ("a1", "adam8bit", None, 3e-3, 0, None, None, None, None),
]


def write_runs(root: Path, trials: list[tuple] = TRIALS, sweep: dict | None = None) -> Path:
    """A runs dir: config, summary and metrics per trial (no summary for a None status).
    Eval ppl is twice the final value at 1000 tokens; loss falls by 1 per 1000 tokens."""
    root.mkdir(parents=True)
    methods = {method: {} for _, method, *_ in trials}
    (root / "sweep.yaml").write_text(yaml.safe_dump(sweep or {"name": "demo", "methods": methods}))
    for trial, method, memory, lr, seed, status, ppl, rate, peak in trials:
        folder = root / "trials" / trial
        folder.mkdir(parents=True)
        config = {"label": method, "seed": seed, "method": {"name": method},
                  "train": {"lr": lr}, "memory": memory or {}}
        (folder / "config.yaml").write_text(yaml.safe_dump(config))
        if status is None:
            continue
        summary = {"trial": trial, "status": status, "method": method, "lr": lr, "seed": seed,
                   "eval_ppl": ppl, "tokens_per_s": rate, "peak_memory_bytes": peak * 1e9}
        (folder / "summary.json").write_text(json.dumps(summary))
        lines = [{"kind": "train", "step": s, "tokens": s * 100, "loss": 5 - s / 10 + seed / 10}
                 for s in (5, 10, 15, 20)]
        lines += [{"kind": "eval", "step": s, "tokens": s * 100, "eval_ppl": ppl * f}
                  for s, f in ((10, 2), (20, 1))]
        (folder / "metrics.jsonl").write_text("\n".join(map(json.dumps, lines)) + "\n")
    return root


@pytest.fixture
def runs(tmp_path: Path) -> Path:
    return write_runs(tmp_path / "runs")


@pytest.fixture
def best(runs: Path) -> pd.DataFrame:
    return best_lr_trials(load_runs(runs))


def test_pareto_front_keeps_exactly_the_undominated_rows_and_ties() -> None:
    points = pd.DataFrame(
        {"x": [1, 1, 2, 2, 3, 4, math.nan, 0.5], "y": [5, 5, 5, 3, 3, 1, 0, 9]},
        index=list("abcdefgh"),
    )
    front = pareto_front(points, "x", "y")
    # c: a is as small and better in x; e: d beats it in x; g has no x; a and b tie, both stay.
    assert list(front.index) == ["h", "a", "b", "d", "f"]
    assert front.equals(points.loc[["h", "a", "b", "d", "f"]])
    assert pareto_front(points.iloc[0:0], "x", "y").empty


def test_best_lr_per_method_and_memory_variant(best: pd.DataFrame) -> None:
    picked = best.groupby("variant", sort=False)["trial"].apply(list).to_dict()
    # full: mean 23 at 3e-3 beats 32 at 1e-3; galore's nan trial (ppl 5) never counts.
    assert picked == {
        "adam8bit": ["a0"],
        "full": ["f3", "f4", "f5"],
        "full (recompute full)": ["r0"],
        "galore": ["g0", "g1"],
        "lora": ["l0"],
    }
    ordered = best_lr_trials(load_runs(Path(best["run_dir"].iloc[0])), order=["lora", "galore"])
    assert list(ordered["variant"].unique()) == [
        "lora", "galore", "adam8bit", "full", "full (recompute full)"]


def test_eval_curves_draw_one_line_per_method_at_its_best_lr(runs: Path, best) -> None:
    figure, caption = eval_curves(load_steps(runs), best, "demo")
    ax = figure.axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert list(lines) == ["adam8bit lr=0.001", "full lr=0.003 (3 seeds)",
                           "full (recompute full) lr=0.003", "galore lr=0.01 (2 seeds)",
                           "lora lr=0.001"]
    full = lines["full lr=0.003 (3 seeds)"]
    assert list(full.get_xdata()) == [1000, 2000]
    assert list(full.get_ydata()) == pytest.approx([46.0, 23.0])  # mean of 2x and 1x ppl
    assert caption == ("Eval perplexity vs tokens seen, each method at its best LR "
                       "(mean over seeds, 95% CI band)")
    assert ax.get_yscale() == "log"
    # Bands only for the methods with several seeds, in the line's colour.
    bands = [c for c in ax.collections if isinstance(c, PolyCollection)]
    several = ("full lr=0.003 (3 seeds)", "galore lr=0.01 (2 seeds)")
    assert [tuple(b.get_facecolor()[0][:3]) for b in bands] == [
        to_rgb(lines[k].get_color()) for k in several]


def test_band_is_mean_plus_minus_t_times_standard_error(runs: Path, best) -> None:
    full = best[best["variant"] == "full"]
    steps = load_steps(runs).merge(full[["run_dir", "trial"]])
    final = seed_band(steps[steps["kind"] == "eval"], "tokens", "eval_ppl").iloc[-1]
    # Seeds end at 20, 22, 27: mean 23, sample sd sqrt(13), n 3.
    half = T_975_DF2 * math.sqrt(13) / math.sqrt(3)
    assert (final["tokens"], final["n"]) == (2000, 3)
    assert final["mean"] == pytest.approx(23.0)
    assert (final["low"], final["high"]) == pytest.approx((23 - half, 23 + half))
    # The figure shades exactly that interval at the last eval.
    figure, _ = eval_curves(load_steps(runs), best, "demo")
    band = next(c for c in figure.axes[0].collections if isinstance(c, PolyCollection))
    at_end = band.get_paths()[0].vertices
    at_end = at_end[np.isclose(at_end[:, 0], 2000), 1]
    assert sorted(set(np.round(at_end, 9))) == pytest.approx([23 - half, 23 + half])
    # One seed: no interval.
    lone = seed_band(pd.DataFrame({"x": [1], "y": [2.0]}), "x", "y").iloc[0]
    assert math.isnan(lone["low"]) and math.isnan(lone["high"])


def test_loss_curves_average_the_seeds(runs: Path, best) -> None:
    figure, caption = loss_curves(load_steps(runs), best, "demo")
    ax = figure.axes[0]
    full = next(line for line in ax.get_lines() if line.get_label().startswith("full lr"))
    # Seed s logs 5 - step/10 + s/10; seeds 0, 1, 2 average to + 0.1.
    assert list(full.get_ydata()) == pytest.approx([4.6, 4.1, 3.6, 3.1])
    assert caption.startswith("Training loss vs tokens seen") and ax.get_yscale() == "linear"


def test_pareto_plot_marks_the_frontier(best: pd.DataFrame) -> None:
    points = method_points(best).set_index("variant")
    assert points.loc["full", "eval_ppl"] == pytest.approx(23.0)
    assert points.loc["full", "peak_memory_bytes"] == 3.0e9  # the largest over seeds
    front = pareto_front(points, "peak_memory_bytes", "eval_ppl")
    assert list(front.index) == ["lora", "full (recompute full)", "full"]
    figure, caption = pareto_plot(best, "demo")
    ax = figure.axes[0]
    (frontier,) = [line for line in ax.get_lines() if line.get_label() == "Pareto frontier"]
    assert list(frontier.get_xdata()) == pytest.approx([1.0, 1.5, 3.0])
    assert list(frontier.get_ydata()) == pytest.approx([40.0, 23.5, 23.0])
    assert {t.get_text() for t in ax.texts} == set(points.index)
    assert "Pareto frontier" in caption


def test_throughput_bars_with_intervals_only_over_several_seeds(best: pd.DataFrame) -> None:
    figure, caption = throughput_chart(best, "demo")
    ax = figure.axes[0]
    widths = [bar.get_width() for bar in ax.patches]
    assert widths == pytest.approx([950.0, 1000.0, 700.0, 810.0, 1200.0])
    assert [t.get_text() for t in ax.get_yticklabels()] == [
        "adam8bit", "full", "full (recompute full)", "galore", "lora"]
    points = method_points(best).set_index("variant")
    assert points.loc["full", "rate_half"] == pytest.approx(T_975_DF2 * 100 / math.sqrt(3))
    assert math.isnan(points.loc["lora", "rate_half"])
    (bars,) = ax.containers[1:]  # the error bars: full and galore only
    assert len(bars.lines[2][0].get_segments()) == 2
    assert caption.endswith("(mean over seeds, 95% CI)")


def test_figures_say_so_when_nothing_finished(tmp_path: Path) -> None:
    runs = write_runs(tmp_path / "runs", [("a1", "full", None, 1e-3, 0, None, None, None, None)])
    best = best_lr_trials(load_runs(runs))
    for figure, _ in (eval_curves(load_steps(runs), best, "x"), pareto_plot(best, "x"),
                      throughput_chart(best, "x")):
        assert figure.axes[0].texts[0].get_text() == "no finished trials yet"


def _optuna_sweep(root: Path, studies: dict[str, list[dict[str, Any]]]) -> Path:
    """A tpe sweep whose journal holds, per method, complete trials with the given params
    (value: ppl falling with lr) and one failed trial."""
    sweep = {"name": "tpe", "methods": {label: {} for label in studies},
             "search": {"sampler": "tpe", "metric": "eval_ppl"}, "storage": None}
    write_runs(root, [], sweep=sweep)
    storage = JournalStorage(JournalFileBackend(str(root / "optuna.journal")))
    dists = {"train.lr": optuna.distributions.FloatDistribution(1e-4, 1e-2, log=True),
             "train.warmup_steps": optuna.distributions.IntDistribution(0, 100)}
    for label, points in studies.items():
        study = optuna.create_study(storage=storage, study_name=f"tpe/{label}")
        for params in points:
            study.add_trial(optuna.trial.create_trial(
                params=params, distributions=dists, value=30 - 1000 * params["train.lr"]))
        study.add_trial(optuna.trial.create_trial(state=optuna.trial.TrialState.FAIL))
    return root


def test_optuna_history_and_importances(tmp_path: Path) -> None:
    varied = [{"train.lr": lr, "train.warmup_steps": w}
              for lr, w in ((1e-3, 10), (5e-3, 10), (2e-3, 50), (8e-3, 90))]
    runs = _optuna_sweep(tmp_path / "runs", {
        "full": varied,
        "lora": varied[:1],  # one complete trial: history only
        "galore": [{"train.lr": 1e-3, "train.warmup_steps": 10}] * 2,  # nothing varied
    })
    (history, history_caption), (importance, importance_caption) = optuna_figures(runs)
    assert history_caption.startswith("Optuna optimization history")
    ax = history.axes[0]
    best_so_far = {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()}
    assert best_so_far == {"full (best so far)": pytest.approx([29, 25, 25, 22]),
                           "lora (best so far)": [29], "galore (best so far)": [29, 29]}
    assert ax.get_ylabel() == "eval_ppl"
    assert importance_caption == "Optuna parameter importances per method"
    panels = [a for a in importance.axes if a.get_title()]
    assert [a.get_title() for a in panels] == ["full"]
    shares = {t.get_text(): p.get_width() for t, p in
              zip(panels[0].get_yticklabels(), panels[0].patches, strict=True)}
    assert set(shares) == {"train.lr", "train.warmup_steps"}
    assert sum(shares.values()) == pytest.approx(1.0)
    assert shares["train.lr"] > shares["train.warmup_steps"]  # the value depends on lr only


def test_no_optuna_figures_for_a_grid_sweep_or_before_any_trial(tmp_path: Path) -> None:
    assert optuna_figures(write_runs(tmp_path / "grid")) == []
    sweep = {"name": "tpe", "methods": {"full": {}}, "search": {"sampler": "tpe"}}
    runs = write_runs(tmp_path / "tpe", [], sweep=sweep)
    assert optuna_figures(runs) == []
    assert not (runs / "optuna.journal").exists()  # reading did not create a storage
