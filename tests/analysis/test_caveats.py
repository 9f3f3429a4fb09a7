"""analysis/caveats.py: tok/s measured on a shared or loaded machine (†), a best LR at the edge
of the LRs tried (‡), a fine-tuning method pretraining from random weights (§), each marked in
the summary table and explained under it."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import yaml

from harness.analysis import load_runs, summary_table, write_report
from harness.analysis.caveats import annotate, conditions_line, grid_edge, with_conditions
from harness.analysis.tables import throughput_table

T0 = 1_800_000_000.0  # an epoch second


def spans(rows: list[tuple[str, float | None, float | None]]) -> pd.DataFrame:
    """Trials from (host, measured_from, measured_to), offsets in seconds from T0."""
    return pd.DataFrame({
        "status": "ok", "host": [h for h, _, _ in rows],
        "measured_from": [np.nan if a is None else T0 + a for _, a, _ in rows],
        "measured_to": [np.nan if b is None else T0 + b for _, _, b in rows]})


def test_trials_whose_measured_spans_overlap_on_one_host_count_each_other():
    trials = spans([("vm", 0, 10), ("vm", 5, 15), ("vm", 10, 20), ("vm", 30, 40),
                    ("other", 0, 40), ("vm", None, None)])
    counted = with_conditions(trials)["concurrent_trials"].tolist()
    # 0-10 meets 5-15; 10-20 meets 5-15 only (touching at 10 is not overlapping); 30-40 alone
    # on vm; "other" overlaps everything in time but on another host; no span: unknown.
    assert counted[:5] == [1, 2, 1, 0, 0]
    assert math.isnan(counted[5])


def test_a_span_from_before_the_meter_recorded_one_runs_from_training_start_to_the_end():
    trials = pd.DataFrame({"status": "ok", "host": "vm",
                           "started_at": [T0, T0 + 100], "first_step_at": [T0 + 20, T0 + 130],
                           "wall_s": [125.0, 50.0]})
    # first: 20-125; second: 130-150: apart. A span from started_at would be 100-150: overlap.
    assert with_conditions(trials)["concurrent_trials"].tolist() == [0, 0]
    trials.loc[1, "first_step_at"] = T0 + 110
    assert with_conditions(trials)["concurrent_trials"].tolist() == [1, 1]


def test_a_load_average_above_the_cores_is_loaded():
    trials = pd.DataFrame({"status": "ok", "load_average": [2.5, 2.0, np.nan],
                           "cpu_count": [2, 2, 2]})
    assert with_conditions(trials)["loaded"].tolist() == [True, False, False]


@pytest.mark.parametrize(("lrs", "best", "edge"), [
    ([1e-3, 3e-3, 1e-2], 3e-3, None),
    ([1e-3, 3e-3, 1e-2], 1e-3, "At the smallest tried (try lower)"),
    ([1e-3, 3e-3, 1e-2], 1e-2, "At the largest tried (try higher)"),
    ([3e-3, 3e-3], 3e-3, "Only one LR tried (not tuned)"),
])
def test_a_best_lr_at_either_end_of_the_lrs_tried_is_an_edge(lrs, best, edge):
    found = grid_edge(pd.DataFrame({"lr": lrs}), best)
    assert (found and found[0]) == edge


# (trial, label, method, lr, eval ppl, tok/s, host, span start, span end, load average)
TRIALS = [
    ("f1", "full", "full", 1e-3, 30.0, 1000.0, "vm", 0, 100, 1.0),
    ("f3", "full", "full", 3e-3, 25.0, 1100.0, "vm", 200, 300, 1.1),
    ("f9", "full", "full", 1e-2, 28.0, 1050.0, "vm", 400, 500, 0.9),
    ("g1", "galore", "galore", 1e-3, 27.0, 800.0, "vm", 600, 700, 2.4),  # alone, loaded
    ("g3", "galore", "galore", 3e-3, 29.0, 820.0, "vm", 800, 900, 1.0),
    ("q1", "qlora", "qlora", 1e-3, 90.0, 700.0, "vm", 1000, 1100, 1.9),
    ("q3", "qlora", "qlora", 3e-3, 80.0, 710.0, "vm", 1050, 1150, 2.0),  # overlaps q1
]


def write_runs(root: Path, trials: list[tuple] = TRIALS) -> Path:
    """A grid sweep on llama_tiny; each trial's summary with its host, span and load on 2
    cores."""
    (root / "trials").mkdir(parents=True)
    methods = {label: {} for _, label, *_ in trials}
    (root / "sweep.yaml").write_text(yaml.safe_dump({"name": "demo", "methods": methods}))
    for trial, label, method, lr, ppl, rate, host, start, end, load in trials:
        folder = root / "trials" / trial
        folder.mkdir()
        config = {"label": label, "seed": 0, "model": "llama_tiny", "method": {"name": method},
                  "train": {"lr": lr}}
        (folder / "config.yaml").write_text(yaml.safe_dump(config))
        summary: dict[str, Any] = {
            "trial": trial, "status": "ok", "method": label, "method_name": method, "lr": lr,
            "seed": 0, "model": "llama_tiny", "eval_ppl": ppl, "tokens_per_s": rate,
            "peak_memory_bytes": 1e9, "wall_s": end - start + 5, "device": "cpu", "host": host,
            "started_at": T0 + start - 5, "measured_from": T0 + start, "measured_to": T0 + end,
            "load_average": load, "cpu_count": 2, "processes": 1}
        (folder / "summary.json").write_text(json.dumps(summary))
    return root


def test_the_summary_marks_and_explains_each_caveat(tmp_path):
    trials = load_runs(write_runs(tmp_path / "runs"))
    marked, notes = annotate(summary_table(trials), trials)
    rows = marked.set_index("method")
    # full: best 3e-3 in the middle of its grid, measured alone on an idle host: unmarked.
    assert rows.loc["full", ["best lr", "tok/s"]].tolist() == ["0.003", "1,100"]
    # galore: best 1e-3, the smallest tried; its trial alone, but the load 2.4 > 2 cores.
    assert rows.loc["galore", ["best lr", "tok/s"]].tolist() == ["0.001 ‡", "800 †"]
    # qlora (a fine-tuning method from random weights): best 3e-3, the largest tried, which
    # ran while q1 did.
    assert rows.loc["qlora §", ["best lr", "tok/s"]].tolist() == ["0.003 ‡", "710 †"]
    shared, edges, outside = notes
    assert shared.startswith("† Measured on a shared or loaded machine")
    assert ("while 1 other trial ran: qlora (load average 2.0 on 2 cores)" in shared
            and "alone, on a loaded host: galore (load average 2.4 on 2 cores)" in shared)
    assert edges.startswith("‡ Best LR at the edge of the LRs tried")
    assert ("At the smallest tried (try lower): galore 0.001 (of 0.001, 0.003); "
            "At the largest tried (try higher): qlora 0.003 (of 0.001, 0.003)") in edges
    assert outside.startswith("§ qlora: run outside its intended use (meant for fine-tuning): "
                              "here it pretrains llama_tiny from randomly initialised weights, "
                              "so the frozen base it adapts is random. QLoRA fine-tunes")
    assert conditions_line(trials) == ("Throughput conditions: 2 of 7 finished trials ran while "
                                       "another trial ran on the same host (at most 1 other at "
                                       "once); load average 0.9–2.4 on 2 cores.")


def test_a_method_pretraining_from_a_pretrained_model_is_in_its_intended_use(tmp_path):
    trials = load_runs(write_runs(tmp_path / "runs")).assign(model="runs/base/trials/x")
    marked, notes = annotate(summary_table(trials), trials)
    assert "qlora" in marked["method"].tolist()
    assert not any(note.startswith("§") for note in notes)


def test_the_report_and_the_throughput_table_carry_the_marks(tmp_path):
    runs = write_runs(tmp_path / "runs")
    text = write_report(runs)
    page = (runs / "report" / "report.md").read_text()
    for output in (text, page):
        assert "| qlora §" in output and "| 0.001 ‡" in output and "| 800 †" in output
        assert "† Measured on a shared or loaded machine" in output
    rows = throughput_table(with_conditions(load_runs(runs))).set_index("method")
    assert rows["tok/s"].to_dict() == {"full": "1,100", "galore": "800 †", "qlora": "710 †"}
    trials = pd.read_csv(runs / "report" / "trials.csv").set_index("trial")
    assert trials["concurrent_trials"].to_dict() == {
        "f1": 0, "f3": 0, "f9": 0, "g1": 0, "g3": 0, "q1": 1, "q3": 1}


def test_a_model_whose_mlp_width_is_not_its_presets_is_marked(tmp_path):
    """model_options' width (¶): galore's trials at mlp_multiple_of 64, llama_tiny's 688 rounded
    up to 11 x 64 = 704; full's at intermediate_size 688, its preset's own: unmarked."""
    runs = write_runs(tmp_path / "runs")
    for trial, options in {"g1": {"mlp_multiple_of": 64}, "g3": {"mlp_multiple_of": 64},
                           "f3": {"intermediate_size": 688}}.items():
        path = runs / "trials" / trial / "config.yaml"
        path.write_text(yaml.safe_dump({**yaml.safe_load(path.read_text()),
                                        "model_options": options}))
    trials = load_runs(runs)
    marked, notes = annotate(summary_table(trials), trials)
    assert marked["method"].tolist() == ["full", "galore ¶", "qlora §"]
    assert ("¶ Shapes not the preset's (at GaLore's sizes, not the paper's): model_options set "
            "the MLP width. llama_tiny MLP width 704, not the preset's 688: galore.") in notes
