"""analysis/load.py on what the trainer really writes (the session's finished sweep), and its
flattening and path checks on their own."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import FINISHED_SWEEP, SAMPLE_VOCAB
from test_report import make_runs

from harness.analysis import load_runs, load_steps, status_table
from harness.analysis.load import flatten, run_dirs
from harness.models import param_shapes


def test_one_row_per_trial_with_summary_and_config_columns(finished_run: Path):
    trials = load_runs(finished_run).set_index("method")
    assert sorted(trials.index) == ["adam8bit", "full"]
    assert (trials["status"] == "ok").all() and (trials["run_dir"] == str(finished_run)).all()
    assert sorted(trials["trial"]) == sorted(p.name for p in (finished_run / "trials").iterdir())
    n = sum(s.numel() for s in param_shapes("llama_micro", SAMPLE_VOCAB).values())
    train = FINISHED_SWEEP["train"]
    sequences = train["total_batch_size"] * train["steps"]
    for method, row in trials.iterrows():
        assert row["method_name"] == method and row["model"] == "llama_micro"
        assert (row["lr"], row["train.lr"], row["seed"]) == (0.003, 0.003, 0)
        assert row["steps"] == row["step"] == row["train.steps"] == 4
        assert row["tokens"] == sequences * FINISHED_SWEEP["task"]["seq_len"]  # 16 x 32
        assert row["task.seq_len"] == 32 and row["memory"] == "none"
        assert row["precision"] == "32-true"
        assert row["eval_ppl"] == pytest.approx(math.exp(row["eval_loss"]), rel=1e-6)
        assert row["trainable_params"] == row["total_params"] == n
        assert row["param_bytes"] == row["grad_bytes"] == 4 * n
        assert row["tokens_per_s"] > 0 and row["peak_memory_bytes"] > 0
    assert trials.loc["adam8bit", "optimizer_state_bytes"] < 0.3 * trials.loc[
        "full", "optimizer_state_bytes"]


def test_steps_are_every_logged_line_and_end_at_the_summary(finished_run: Path):
    steps = load_steps(finished_run)
    trials = load_runs(finished_run).set_index("trial")
    assert set(steps["trial"]) == set(trials.index)
    for trial, lines in steps.groupby("trial"):
        train = lines[lines["kind"] == "train"]
        evals = lines[lines["kind"] == "eval"]
        assert train["step"].tolist() == [1, 2, 3, 4]  # log_every 1
        assert evals["step"].tolist() == [2, 4]  # eval every 2
        assert (lines["method"] == trials.loc[trial, "method"]).all()
        assert evals["eval_ppl"].iloc[-1] == pytest.approx(trials.loc[trial, "eval_ppl"])
        assert train["loss"].iloc[-1] == pytest.approx(trials.loc[trial, "last_loss"])
        assert train["loss"].iloc[-1] < train["loss"].iloc[0]  # it trained


def test_status_table_of_the_finished_sweep(finished_run: Path):
    table = status_table(load_runs(finished_run))
    rows = [line for line in table.splitlines() if "-" in line and "|" in line][1:]
    assert len(rows) == 2 and all("| ok " in r and "| 4/4 " in r for r in rows)
    for trial in (finished_run / "trials").iterdir():
        summary = json.loads((trial / "summary.json").read_text())
        assert f"{summary['eval_ppl']:.2f}" in table


def test_flatten_dots_nested_keys_and_keeps_lists_as_one_cell():
    nested = {"train": {"lr": 0.1, "loss_scale": {"init": 2.0}}, "methods": ["a", "b"],
              "betas": (0.9, 0.99), "seed": 0, "empty": {}}
    assert flatten(nested) == {"train.lr": 0.1, "train.loss_scale.init": 2.0,
                               "methods": "['a', 'b']", "betas": "[0.9, 0.99]", "seed": 0}
    assert flatten({"a": 1}, prefix="params.") == {"params.a": 1}


def test_run_dirs_takes_one_or_many_and_checks_all_first(finished_run: Path, tmp_path: Path):
    assert run_dirs(str(finished_run)) == [finished_run]
    assert run_dirs([finished_run, str(finished_run)]) == [finished_run, finished_run]
    with pytest.raises(FileNotFoundError, match="runs directory not found"):
        run_dirs([finished_run, tmp_path / "missing"])
    with pytest.raises(FileNotFoundError, match="no trials/ folder in"):
        run_dirs(tmp_path)


def test_an_unreadable_summary_is_a_row_that_says_so(tmp_path: Path):
    """t1 (full, lr 0.003) has a summary.json cut short: its row is `unreadable`, never
    `pending`, with `error` naming the file and why; what its config says is still there."""
    runs = make_runs(tmp_path / "runs")
    summary = runs / "trials" / "t1" / "summary.json"
    summary.write_text('{"trial": "t1", "status": "ok"')
    trials = load_runs(runs).set_index("trial")
    assert trials.loc["t1", "status"] == "unreadable"
    assert trials.loc["t1", "error"] == (
        f"{summary}: not JSON (Expecting ',' delimiter: line 1 column 31, 30 bytes)")
    assert (trials.loc["t1", "method"], trials.loc["t1", "lr"]) == ("full", 0.003)
    assert math.isnan(trials.loc["t1", "eval_ppl"])
    assert trials.loc["t10", "status"] == "pending"  # no summary at all: not started
    lines = status_table(load_runs(runs)).splitlines()
    assert lines[-1] == f"unreadable: t1 ({trials.loc['t1', 'error']})"
