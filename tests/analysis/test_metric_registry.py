"""harness/config/metrics.py is the one list of metrics: the summary's fields, the objectives a
search accepts, `harness status` (table and --json), the report's methods table, its Pareto
front and the docs all follow it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
import pytest
from conftest import REPO
from test_report import make_runs

from harness.analysis import load_runs, status_table, summary_table
from harness.analysis.front import front_table
from harness.cli import main
from harness.config import SweepConfig, validate
from harness.config.metrics import EVALUATED, METRICS, OBJECTIVES, REGISTRY
from harness.errors import UserError
from harness.trials import Summary

PROGRESS = ["trial", "method", "memory", "status", "step", "steps"]
# t1's cells in `harness status`: its last logged loss, summary values and those written below.
EXPECTED_CELLS = {"loss": "3.0000", "eval ppl": "25.00", "tok/s": "333,333",
                  "peak memory": "1.23 GB", "peak RSS": "987.7 MB", "requeues": "3",
                  "final model": "5.0 kB"}


@pytest.fixture
def runs(tmp_path: Path) -> Path:
    return make_runs(tmp_path / "runs")


def test_every_metric_a_summary_has_is_a_numeric_column_in_the_registrys_order():
    fields = [m.name for m in REGISTRY if m.field]
    columns = Summary.columns()
    start = columns.index("tokens") + 1
    assert list(columns[start:start + len(fields)]) == fields
    assert set(fields) <= set(Summary.numeric_columns())
    assert {"eval_score", "trial_hours"}.isdisjoint(columns)  # GLUE's only; derived


def test_status_json_and_table_show_each_status_metric(runs: Path, capfd):
    """Every metric marked `status` is a key of --json and a column of the table, in the
    registry's order, formatted as it says."""
    folder = runs / "trials" / "t1"
    summary = json.loads((folder / "summary.json").read_text())
    (folder / "summary.json").write_text(json.dumps(
        {**summary, "peak_rss_bytes": 987_654_321, "requeues": 3, "final_model_bytes": 5_000}))
    assert main(["status", str(runs), "--json"]) == 0
    records = json.loads(capfd.readouterr().out)
    shown = [m.name for m in REGISTRY if m.status]
    assert all(list(r) == [*PROGRESS, *shown, "final_model_dropped", "error"] for r in records)
    t1 = next(r for r in records if r["trial"] == "t1")
    assert (t1["last_loss"], t1["eval_ppl"]) == (3.0, 25.0)
    assert t1["tokens_per_s"] == pytest.approx(1000 / 0.003, rel=1e-9)
    assert (t1["peak_memory_bytes"], t1["peak_rss_bytes"]) == (1_234_000_000, 987_654_321)
    assert (t1["requeues"], t1["final_model_bytes"]) == (3, 5_000)
    lines = status_table(load_runs(runs)).splitlines()
    header = [c.strip() for c in lines[0].split("|")[1:-1]]
    assert header == ["id", *PROGRESS[1:4], "step", *(METRICS[m].header for m in shown)]
    row = next(line for line in lines if "| t1 " in line)
    cells = dict(zip(header, (c.strip() for c in row.split("|")[1:-1]), strict=True))
    assert {h: cells[h] for h in EXPECTED_CELLS} == EXPECTED_CELLS  # as the registry formats
    assert lines[2 + 6:] == []  # six trials, no unreadable one


def test_the_methods_table_folds_each_report_metric_over_seeds_as_registered(runs: Path):
    """Two seeds at full's best LR: tok/s is their mean, memory columns their largest."""
    trials = load_runs(runs)
    seed = trials[trials["trial"] == "t1"].assign(
        trial="t1s1", seed=1, eval_ppl=27.0, tokens_per_s=1_000.0, peak_memory_bytes=3e9,
        peak_rss_bytes=1e6, optimizer_state_bytes=1e3)
    table = summary_table(pd.concat([trials, seed], ignore_index=True)).set_index("method")
    shown = [METRICS[m.name].header for m in REGISTRY if m.report]
    assert table.columns.tolist() == ["memory", "precision", "best lr", *shown, "trials"]
    full = table.loc["full"]
    assert full["eval ppl"] == "26.00"  # (25 + 27) / 2
    assert full["tok/s"] == f"{(1000 / 0.003 + 1000) / 2:,.0f}"
    assert (full["peak memory"], full["peak RSS"]) == ("3.00 GB", "1.0 MB")
    assert full["optimizer state"] == "512.0 MB"


def test_the_front_shows_any_objective_with_its_header_and_format():
    frame = pd.DataFrame({"trial": ["a", "b"], "status": "ok", "method": ["a", "b"],
                          "memory": "none", "precision": "32-true", "lr": 1e-3, "seed": 0,
                          "eval_loss": [3.0, 2.5], "tokens_per_s": [2000.0, 1000.0],
                          "wall_s": [7200.0, 1800.0]})
    goals = [("eval_loss", "minimize"), ("tokens_per_s", "maximize"), ("trial_hours", "minimize")]
    table = front_table(frame, goals)
    assert table.columns.tolist()[4:] == ["eval loss", "tok/s", "trial-hours"]
    assert table[["eval loss", "tok/s", "trial-hours"]].values.tolist() == [
        ["2.50", "1,000", "0.500"], ["3.00", "2,000", "2.000"]]


def sweep(search: dict) -> SweepConfig:
    return validate(SweepConfig, {"name": "s", "methods": {"full": {}}, "search": search})


@pytest.mark.parametrize("name", OBJECTIVES)
def test_each_objective_metric_may_be_searched_and_constrained(name):
    search = sweep({"sampler": "nsga2", "n_trials": 2, "constraints": [f"{name} >= 1"],
                    "objectives": [{"metric": name}, {"metric": "eval_ppl"}]}).search
    assert search.goals[0].metric == search.limits[0].metric == name


def test_an_unknown_metric_is_one_line_listing_the_registrys_objectives():
    with pytest.raises(UserError) as error:
        sweep({"objectives": [{"metric": "loss"}, {"metric": "eval_ppl"}]})
    message = str(error.value)
    assert "\n" not in message and message.startswith("search.objectives.0.metric: 'loss' is not")
    assert re.findall(r"'(\w+)'", message.split("allowed:")[1]) == list(OBJECTIVES)
    with pytest.raises(UserError) as error:
        sweep({"constraints": ["loss <= 3"]})
    listed = re.search(r"METRIC one of (.*?), VALUE", str(error.value)).group(1)
    assert listed.split(", ") == list(OBJECTIVES)
    assert {"peak_rss_bytes", "last_loss"}.isdisjoint(OBJECTIVES)  # measured, not searched


def test_one_objective_is_a_metric_every_evaluation_logs():
    """`search.metric` (one objective, prunable) takes what an eval line carries."""
    assert EVALUATED == ("eval_loss", "eval_ppl", "eval_score")
    assert [sweep({"metric": name}).search.metric for name in EVALUATED] == list(EVALUATED)
    allowed = "'eval_loss', 'eval_ppl' or 'eval_score'"
    with pytest.raises(UserError, match=re.escape(
            f"search.metric: 'tokens_per_s' is not allowed (allowed: {allowed})")):
        sweep({"metric": "tokens_per_s"})


def test_the_docs_list_every_metric_with_its_unit_and_direction():
    """docs/records.md's table of metrics: one row a metric, in the registry's order."""
    text = (REPO / "docs" / "records.md").read_text().split("### Metrics")[1].split("\n## ")[0]
    rows = re.findall(r"^\| `(\w+)` \|" + r"([^|]*)\|" * 6 + "$", text, re.M)
    assert [r[0] for r in rows] == [m.name for m in REGISTRY]
    for name, *cells in rows:
        m = METRICS[name]
        shown = ", ".join(w for w, on in (("status", m.status), ("report", m.report)) if on)
        assert [c.strip() for c in cells] == [m.header, m.unit or "—", m.direction,
                                              m.across_seeds, "yes" if m.objective else "", shown]
