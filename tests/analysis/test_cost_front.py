"""analysis/cost_front.py: perplexity per GB and per hour, each method at its best LR against
its peak memory and its wall time × processes, the Pareto front of the three, and the ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import yaml

from harness.analysis import load_runs, write_report
from harness.analysis.cost_front import (
    cost_figure,
    cost_points,
    cost_table,
    hours_unit,
    process_hours,
)
from harness.analysis.figures import best_lr_trials

# (trial, method, lr, seed, eval ppl, peak GB, wall s, processes)
TRIALS = [
    ("a0", "a", 1e-3, 0, 20.0, 2.0, 3600.0, 1),
    ("a1", "a", 1e-3, 1, 22.0, 2.0, 5400.0, 1),  # a: ppl 21, 2 GB, 1.25 h
    ("a9", "a", 3e-3, 0, 40.0, 9.0, 9.0, 1),  # a worse LR: never counted
    ("b0", "b", 1e-3, 0, 25.0, 1.0, 900.0, 4),  # b: 25, 1 GB, 4 × 0.25 h = 1 h
    ("c0", "c", 1e-3, 0, 30.0, 3.0, 1800.0, 1),  # c: 30, 3 GB, 0.5 h
    ("d0", "d", 1e-3, 0, 31.0, 3.0, 3600.0, 1),  # d: 31, 3 GB, 1 h: c beats it on all three
    ("e0", "e", 1e-3, 0, 30.0, 3.0, 1800.0, 1),  # e: ties c on all three: both stay
]


def write_runs(root: Path, device: str = "cuda:0") -> Path:
    (root / "trials").mkdir(parents=True)
    methods = {m: {} for _, m, *_ in TRIALS}
    (root / "sweep.yaml").write_text(yaml.safe_dump({"name": "demo", "methods": methods}))
    for trial, method, lr, seed, ppl, peak, wall, processes in TRIALS:
        folder = root / "trials" / trial
        folder.mkdir()
        (folder / "config.yaml").write_text(yaml.safe_dump(
            {"label": method, "seed": seed, "method": {"name": "full"}, "train": {"lr": lr}}))
        (folder / "summary.json").write_text(json.dumps({
            "trial": trial, "status": "ok", "method": method, "lr": lr, "seed": seed,
            "eval_ppl": ppl, "peak_memory_bytes": peak * 1e9, "wall_s": wall,
            "processes": processes, "device": device, "tokens_per_s": 100.0}))
    return root


@pytest.fixture
def points(tmp_path: Path) -> pd.DataFrame:
    return cost_points(best_lr_trials(load_runs(write_runs(tmp_path / "runs"))))


def test_hours_are_wall_time_times_processes_and_say_what_ran_them():
    trials = pd.DataFrame({"wall_s": [3600.0, 1800.0, 7200.0], "processes": [8, None, 1],
                           "device": ["cuda:0", "cuda:0", "cuda:0"]})
    # a trial from before `processes` was recorded counts one process
    assert process_hours(trials).tolist() == [8.0, 0.5, 2.0]
    assert hours_unit(trials) == "GPU-hours"
    assert hours_unit(trials.assign(device="cpu")) == "CPU-process-hours"
    assert hours_unit(trials.assign(device=["cpu", "cuda:0", "cpu"])) == "process-hours"


def test_each_method_at_its_best_lr_and_the_front_of_the_three(points):
    rows = points.set_index("variant")
    assert rows.loc["a", ["eval_ppl", "peak_gb", "hours"]].tolist() == [21.0, 2.0, 1.25]
    assert rows.loc["b", "hours"] == 1.0
    assert rows["front"].to_dict() == {"a": True, "b": True, "c": True, "d": False, "e": True}


def test_the_table_ranks_the_methods_by_each(points):
    table = cost_table(points, "GPU-hours")
    assert list(table.columns) == ["method", "eval ppl", "peak GB", "GPU-hours", "rank: ppl",
                                   "rank: memory", "rank: hours", "front"]
    assert table.values.tolist() == [
        ["a", "21.00", "2", "1.25", "1", "2", "5", "yes"],
        ["b", "25.00", "1", "1", "2", "1", "3", "yes"],
        ["c", "30.00", "3", "0.5", "3", "3", "1", "yes"],
        ["e", "30.00", "3", "0.5", "3", "3", "1", "yes"],
        ["d", "31.00", "3", "1", "5", "3", "3", ""],
    ]


def test_the_figure_puts_perplexity_against_memory_and_hours(tmp_path, points):
    best = best_lr_trials(load_runs(write_runs(tmp_path / "more")))
    figure, caption = cost_figure(points, best, "GPU-hours", "demo")
    memory, hours = figure.axes
    assert memory.get_xlabel() == "peak memory (GB)"
    assert hours.get_xlabel() == "GPU-hours (wall time × processes)"
    assert memory.get_ylabel() == "eval perplexity (log scale)"
    for ax, xs in ((memory, [2.0, 1.0, 3.0, 3.0]), (hours, [1.25, 1.0, 0.5, 0.5])):
        rings, dots = ax.collections
        assert rings.get_offsets()[:, 0].tolist() == xs  # a, b, c, e: the front, ringed
        assert sorted(dots.get_offsets()[:, 1].tolist()) == [21.0, 25.0, 30.0, 30.0, 31.0]
    assert "Pareto front of all three" in caption


def test_the_report_has_the_section_its_figure_and_cpu_hours_on_cpu(tmp_path):
    runs = write_runs(tmp_path / "runs", device="cpu")
    text = write_report(runs)
    page = (runs / "report" / "report.md").read_text()
    for output in (text, page):
        assert "Perplexity per GB and per hour" in output
        assert "| CPU-process-hours " in output
        assert "On the Pareto front of eval perplexity, peak memory, CPU-process-hours" in output
    assert "![Eval perplexity vs peak memory and vs CPU-process-hours" in page
    assert (runs / "report" / "cost.png").read_bytes()[:4] == b"\x89PNG"
