"""`harness report` with a trial whose summary.json cannot be read: it names the file and why
before any table, and marks ⚠ the rows whose best LR may be wrong without it."""

from __future__ import annotations

from html import escape
from pathlib import Path

import pandas as pd
from test_report import make_runs

from harness.analysis import load_runs, summary_table, write_report


def damaged_runs(tmp_path: Path) -> tuple[Path, str]:
    """The TRIALS sweep with t1's summary cut short: t1 is full's best trial (lr 0.003, ppl
    25.0), so without it full's best LR reads 0.001 (ppl 30.0)."""
    runs = make_runs(tmp_path / "runs")
    summary = runs / "trials" / "t1" / "summary.json"
    summary.write_text(summary.read_text()[:100])
    why = f"{summary}: not JSON (Expecting ',' delimiter: line 1 column 101, 100 bytes)"
    return runs, why


def test_the_summary_table_marks_the_rows_an_unreadable_trial_may_change(tmp_path):
    runs, _ = damaged_runs(tmp_path)
    table = summary_table(load_runs(runs), order=["full", "galore_r4", "adam8bit"])
    rows = table.set_index("method")
    assert rows.loc["full", "best lr"] == "0.001 ⚠"
    assert rows.loc["full", "trials"] == "1 ok / 3 (1 nan, 1 unreadable)"
    assert rows.loc["galore_r4", "best lr"] == "0.01"  # all its records read: unmarked
    assert rows.loc["adam8bit", "best lr"] == ""


def test_the_report_names_every_unreadable_record_first(tmp_path):
    runs, why = damaged_runs(tmp_path)
    out = tmp_path / "report"
    printed = write_report(runs, out)
    note = (f"⚠ Trial records that cannot be read (1): their results are left out, so the rows "
            "marked ⚠ may name another best LR than all their trials would; `harness sweep "
            f"--retry-failed` trains them again. unreadable: t1 ({why}).")
    assert printed.split("\n\n")[0] == note
    page = (out / "report.md").read_text()
    assert note in page and page.index(note) < page.index("## Methods at their best")
    assert "<p>⚠ Trial records" in (out / "report.html").read_text()
    assert f"unreadable: t1 ({escape(why)})." in (out / "report.html").read_text()
    pretrain = pd.read_csv(out / "pretrain.csv").set_index("method")
    assert list(pretrain.index) == ["full ⚠", "galore_r4", "adam8bit"]
    assert pretrain.loc["full ⚠", "llama_tiny"].startswith("30.00")  # t0's, as t1 is unread
    trials = pd.read_csv(out / "trials.csv").set_index("trial")
    assert (trials.loc["t1", "status"], trials.loc["t1", "error"]) == ("unreadable", why)
