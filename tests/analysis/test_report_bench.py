"""analysis/report_bench.py (`harness bench report`) and what it drove: a report of many trials
folds its figures per method setting."""

from __future__ import annotations

import json

import pytest

from harness.analysis import load_runs
from harness.analysis.plots import PER_TRIAL, memory_chart
from harness.analysis.report_bench import METHODS, bench_report, report_table, write_sweep
from harness.cli import main


def test_past_the_limit_the_memory_chart_has_one_bar_per_method_setting(tmp_path):
    """60 trials, 10 methods: 10 bars of 6 trials each, each as long as its method's peak (the
    writer gives method i a peak of (1 + 0.1 i) GB on every trial)."""
    write_sweep(tmp_path, 60)
    trials = load_runs(tmp_path)
    assert len(trials) == 60 > PER_TRIAL
    figure, caption = memory_chart(trials, "big")
    ax = figure.axes[0]
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert caption == "Memory breakdown per method setting"
    assert sorted(labels) == sorted(f"{m} (6 trials)" for m in METHODS)  # trials' id order
    ends = [0.0] * len(labels)
    for bar in ax.patches:  # stacked segments: a bar ends where its last segment ends
        row = round(bar.get_y() + bar.get_height() / 2)
        ends[row] = max(ends[row], bar.get_x() + bar.get_width())
    expected = {f"{m} (6 trials)": 1 + 0.1 * i for i, m in enumerate(METHODS)}
    assert ends == pytest.approx([expected[label] for label in labels], rel=1e-9)


def test_bench_report_times_the_report_and_says_met_or_missed(capsys):
    (record,) = bench_report(50)
    assert record["name"] == "report/50_trials" and record["target"] == 15.0
    assert record["met"] == (record["value"] < 15.0)
    assert record["peak_rss_bytes"] > 50e6  # a Python process with pandas and matplotlib
    # past 40 trials the per-trial curves are left out and the memory chart folds
    assert "loss.png" not in record["png_bytes"] and record["png_bytes"]["memory.png"] > 0
    assert "report/50_trials:" in report_table([record])
    assert main(["bench", "report", "--trials", "20", "--json"]) == 0
    (small,) = json.loads(capsys.readouterr().out)
    assert small["name"] == "report/20_trials" and "loss.png" in small["png_bytes"]


@pytest.mark.parametrize("verdict", [True, False])
def test_the_table_says_the_verdict(verdict):
    record = {"name": "report/2000_trials", "value": 9.8 if verdict else 20.0, "target": 15.0,
              "met": verdict, "peak_rss_bytes": 717e6, "png_bytes": {"memory.png": 60_000}}
    line = report_table([record])
    assert ("met" if verdict else "missed") in line and "717 MB" in line
    assert "memory.png 60 kB" in line
