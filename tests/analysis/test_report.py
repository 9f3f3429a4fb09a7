"""Tests for harness.analysis on run directories written by hand with known numbers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib.image
import pandas as pd
import pytest
import yaml
from conftest import REPO

from harness.analysis import load_runs, load_steps, status_table, summary_table, write_report
from harness.analysis.plots import trial_labels
from harness.sweep.plan.expand import load_sweep

# label -> (method config, [(trial id, lr, status, eval ppl)]); None status = never started.
TRIALS: dict[str, tuple[dict[str, Any], list[tuple[str, float, str | None, float | None]]]] = {
    "full": (
        {"name": "full", "betas": [0.9, 0.999], "eps": 1e-8},
        [("t0", 0.001, "ok", 30.0), ("t1", 0.003, "ok", 25.0), ("t2", 0.01, "nan", 5.0)],
    ),
    "galore_r4": (
        {"name": "galore", "rank": 4, "update_proj_gap": 200},
        [("t3", 0.01, "ok", 40.0), ("t4", 0.02, "failed", None)],
    ),
    "adam8bit": ({"name": "adam8bit"}, [("t10", 0.003, None, None)]),
}


def _config(label: str, method: dict[str, Any], lr: float, seed: int) -> dict[str, Any]:
    return {
        "name": "quickstart",
        "seed": seed,
        "model": "llama_tiny",
        "device": "auto",
        "method": method,
        "train": {"lr": lr, "steps": 40, "batch_size": 8, "precision": "fp32"},
        "task": {"kind": "pretrain", "dataset": "sample", "seq_len": 128, "packing": True},
        "eval": {"every": 20, "tokens": 20000},
        "label": label,
    }


def _summary(trial: str, label: str, method: dict, lr: float, status: str, ppl: float | None):
    done = status == "ok"
    return {
        "trial": trial,
        "status": status,
        "method": label,
        "method_name": method["name"],
        "params": {k: v for k, v in method.items() if k != "name"},
        "lr": lr,
        "seed": 0,
        "model": "llama_tiny",
        "steps": 40,
        "step": 40 if done else 20,
        "tokens": 40960 if done else 20480,
        "eval_loss": None,
        "eval_ppl": ppl,
        "tokens_per_s": 1000.0 / lr,
        "mfu": None,
        "peak_memory_bytes": 1_234_000_000 if lr == 0.003 else 2_000_000_000,
        "param_bytes": 4_000_000,
        "grad_bytes": 4_000_000,
        "optimizer_state_bytes": 512_000_000 if lr == 0.003 else 8_000_000,
        "trainable_params": 1_000_000,
        "total_params": 1_000_000,
        "wall_s": 12.5,
        "device": "cuda:0",
        "error": None if done else "diverged",
    }


def _metrics(ppl: float | None) -> list[str]:
    """Train lines every 10 steps and two evals whose final value is the summary's ppl."""
    lines = [
        {"kind": "train", "step": s, "loss": 5.0 - s / 20, "lr": 0.001, "tokens": s * 1024}
        for s in (10, 20, 30, 40)
    ]
    if ppl is not None:
        lines += [
            {"kind": "eval", "step": 20, "tokens": 20480, "eval_loss": 4.0, "eval_ppl": ppl * 2},
            {"kind": "eval", "step": 40, "tokens": 40960, "eval_loss": 3.0, "eval_ppl": ppl},
        ]
    return [json.dumps(line) for line in lines]


def make_runs(root: Path, sweep: bool = True, evals: bool = True) -> Path:
    """Write the TRIALS sweep; t0's metrics end in a line truncated mid-write."""
    if sweep:
        methods = {label: method for label, (method, _) in TRIALS.items()}
        root.mkdir(parents=True)
        (root / "sweep.yaml").write_text(
            yaml.safe_dump({"name": "demo", "methods": methods}, sort_keys=False)
        )
    for label, (method, trials) in TRIALS.items():
        for trial, lr, status, ppl in trials:
            folder = root / "trials" / trial
            folder.mkdir(parents=True)
            config = _config(label, method, lr, seed=0)
            (folder / "config.yaml").write_text(yaml.safe_dump(config))
            if status is None:
                continue
            summary = _summary(trial, label, method, lr, status, ppl)
            (folder / "summary.json").write_text(json.dumps(summary))
            lines = _metrics(ppl if evals else None)
            if trial == "t0":
                lines.append('{"kind": "train", "step": 45, "lo')
            (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return root


@pytest.fixture
def runs(tmp_path: Path) -> Path:
    return make_runs(tmp_path / "runs")


def test_load_runs_flattens_config_and_merges_summary(runs: Path) -> None:
    trials = load_runs(runs).set_index("trial")
    assert list(trials.index) == ["t0", "t1", "t2", "t3", "t4", "t10"]
    assert trials.loc["t3", "train.lr"] == 0.01
    assert trials.loc["t3", "method.name"] == "galore"
    assert trials.loc["t3", "method.rank"] == 4
    assert trials.loc["t3", "params.rank"] == 4
    assert trials.loc["t3", "task.seq_len"] == 128
    assert trials.loc["t0", "method.betas"] == "[0.9, 0.999]"
    assert trials.loc["t4", "error"] == "diverged"
    assert trials.loc["t1", "eval_ppl"] == 25.0
    # The summary wins over the config on the same key; the config fills in when no summary.
    assert trials.loc["t0", "device"] == "cuda:0"
    assert trials.loc["t10", "device"] == "auto"
    assert (trials["run_dir"] == str(runs)).all()


def test_trial_without_summary_is_pending_with_config_facts(runs: Path) -> None:
    pending = load_runs(runs).set_index("trial").loc["t10"]
    assert pending["status"] == "pending"
    assert pending["method"] == "adam8bit"
    assert pending["lr"] == 0.003
    assert pending["steps"] == 40


def test_load_runs_accepts_several_dirs_in_order(tmp_path: Path) -> None:
    first = make_runs(tmp_path / "a")
    second = make_runs(tmp_path / "b", sweep=False)
    trials = load_runs([second, str(first)])
    assert len(trials) == 12
    assert list(trials["run_dir"].unique()) == [str(second), str(first)]


def test_load_steps_skips_truncated_line_and_labels_method(runs: Path) -> None:
    steps = load_steps(runs)
    t0 = steps[steps["trial"] == "t0"]
    assert len(t0) == 6  # 4 train + 2 eval; the truncated line is dropped
    assert t0["step"].max() == 40
    assert set(steps["method"]) == {"full", "galore_r4"}
    evals = steps[(steps["kind"] == "eval") & (steps["trial"] == "t3")]
    assert evals["eval_ppl"].tolist() == [80.0, 40.0]


def test_summary_picks_lowest_ppl_ok_trial_per_method(runs: Path) -> None:
    table = summary_table(load_runs(runs), order=["full", "galore_r4", "adam8bit"])
    rows = table.set_index("method")
    assert list(table["method"]) == ["full", "galore_r4", "adam8bit"]
    # t2 has a lower ppl but diverged (status nan), so it must not win.
    assert rows.loc["full", "best lr"] == "0.003"
    assert rows.loc["full", "eval ppl"] == "25.00"
    assert rows.loc["full", "tok/s"] == "333,333"
    assert rows.loc["full", "peak memory"] == "1.23 GB"
    assert rows.loc["full", "optimizer state"] == "512.0 MB"
    assert rows.loc["full", "trials"] == "2 ok / 3 (1 nan)"
    assert rows.loc["galore_r4", "best lr"] == "0.01"
    assert rows.loc["galore_r4", "trials"] == "1 ok / 2 (1 failed)"
    assert rows.loc["adam8bit", "best lr"] == ""
    assert rows.loc["adam8bit", "eval ppl"] == ""
    assert rows.loc["adam8bit", "trials"] == "0 ok / 1 (1 pending)"


def test_summary_averages_seeds_before_picking_lr(runs: Path) -> None:
    trials = load_runs(runs)
    # A second seed at lr 0.003 that did badly makes lr 0.001 the better LR on average.
    extra = trials[trials["trial"] == "t1"].assign(trial="t1s1", seed=1, eval_ppl=45.0)
    table = summary_table(pd.concat([trials, extra], ignore_index=True)).set_index("method")
    assert table.loc["full", "best lr"] == "0.001"
    assert table.loc["full", "eval ppl"] == "30.00"


def test_summary_orders_alphabetically_without_sweep(runs: Path) -> None:
    table = summary_table(load_runs(runs))
    assert list(table["method"]) == ["adam8bit", "full", "galore_r4"]


def test_status_table_shows_progress(runs: Path) -> None:
    lines = status_table(load_runs(runs)).splitlines()
    assert [cell.strip() for cell in lines[0].split("|")[1:-1]] == [
        "id", "method", "memory", "status", "step", "loss", "eval ppl", "tok/s", "grad norm",
        "peak memory", "peak RSS", "requeues", "final model",
    ]  # fmt: skip
    t4 = next(line for line in lines if "| t4 " in line)
    assert "failed" in t4 and "20/40" in t4 and "| 3.0000 |" in t4
    t10 = next(line for line in lines if "| t10 " in line)
    assert "pending" in t10 and "0/40" in t10
    assert len(lines) == 2 + 6


def test_a_trials_final_model_size_is_in_the_status_table_and_trials_csv(runs: Path) -> None:
    folder = runs / "trials" / "t1"
    summary = json.loads((folder / "summary.json").read_text())
    (folder / "summary.json").write_text(json.dumps({**summary, "final_model_bytes": 29_437_952}))
    row = next(line for line in status_table(load_runs(runs)).splitlines() if "| t1 " in line)
    assert row.split("|")[-2].strip() == "29.4 MB"
    write_report(runs)
    csv = pd.read_csv(runs / "report" / "trials.csv").set_index("trial")
    assert csv.loc["t1", "final_model_bytes"] == 29_437_952


def test_status_of_a_running_trial_comes_from_its_metrics(runs: Path) -> None:
    """A running trial's summary is only rewritten at its end: progress is read from the
    tail of metrics.jsonl."""
    folder = runs / "trials" / "t4"
    summary = json.loads((folder / "summary.json").read_text())
    summary.update(status="running", step=0, eval_ppl=None, requeues=2)
    (folder / "summary.json").write_text(json.dumps(summary))
    with (folder / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"kind": "train", "step": 45, "loss": 2.5, "tokens_per_s": 777.0}))
        f.write("\n" + json.dumps({"kind": "eval", "step": 45, "eval_ppl": 12.34}) + "\n")
    row = next(line for line in status_table(load_runs(runs)).splitlines() if "| t4 " in line)
    cells = [cell.strip() for cell in row.split("|")[1:-1]]
    assert cells[3:8] == ["running", "45/40", "2.5000", "12.34", "777"]
    assert cells[-2] == "2"


def test_trial_labels_add_seed_only_when_seeds_vary(runs: Path) -> None:
    trials = load_runs(runs)
    assert trial_labels(trials)[(str(runs), "t1")] == "full lr=0.003"
    trials.loc[trials["trial"] == "t1", "seed"] = 1
    assert trial_labels(trials)[(str(runs), "t1")] == "full lr=0.003 seed=1"


def test_write_report_writes_csv_markdown_and_png(runs: Path) -> None:
    text = write_report(runs)
    out = runs / "report"
    assert sorted(p.name for p in out.iterdir()) == [
        "cost.png", "eval.png", "loss.png", "memory.png", "pareto.png", "pretrain.csv",
        "pretrain.md",
        "report.html", "report.md", "throughput.csv", "throughput.md", "throughput.png",
        "train_loss.png", "trials.csv"]
    assert "| full " in text and "25.00" in text

    assert (out / "trials.csv").read_text().count("\n") == 1 + 6

    summary = (out / "report.md").read_text()
    assert summary.startswith("# Sweep report: demo\n")
    assert "decimal units" in summary
    assert "| 0.003 " in summary and "| 25.00 " in summary and "| 40.00 " in summary
    assert "Best LR per method: full 0.003, galore_r4 0.01, adam8bit n/a" in summary
    assert "![Eval perplexity vs tokens seen](loss.png)" in summary
    assert summary.index("| full ") < summary.index("| galore_r4 ") < summary.index("| adam8bit ")

    png = out / "loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 10_000
    height, width, _ = matplotlib.image.imread(png).shape
    assert (width, height) == (960, 600)


def test_memory_modifiers_are_columns_and_variants_rows(runs: Path) -> None:
    """Trials of one method that differ in memory modifiers or precision are separate rows,
    each at its own best LR; the memory chart stacks each finished trial's bytes."""
    for trial, memory, precision in (("t0", {"recompute": "full"}, "fp32"),
                                     ("t3", {"offload": ["mlp", "norm"], "layerwise": True},
                                      "fp16")):
        path = runs / "trials" / trial / "config.yaml"
        config = yaml.safe_load(path.read_text())
        config["memory"] = memory
        config["train"]["precision"] = precision
        path.write_text(yaml.safe_dump(config))
    trials = load_runs(runs).set_index("trial")
    assert trials.loc["t0", "memory"] == "recompute full"
    assert trials.loc["t3", "memory"] == "offload mlp+norm, layerwise"
    assert trials.loc["t1", "memory"] == "none"
    assert trials.loc["t3", "precision"] == "16-mixed"  # the old name, read as today's
    table = summary_table(load_runs(runs), order=["full", "galore_r4", "adam8bit"])
    rows = table[["method", "memory", "precision", "best lr"]].values.tolist()
    assert rows == [["full", "recompute full", "32-true", "0.001"],
                    ["full", "none", "32-true", "0.003"],
                    ["galore_r4", "offload mlp+norm, layerwise", "16-mixed", "0.01"],
                    ["galore_r4", "none", "32-true", ""], ["adam8bit", "none", "32-true", ""]]
    write_report(runs)
    summary = (runs / "report" / "report.md").read_text()
    assert "full (recompute full) 0.001, full 0.003, galore_r4 (offload mlp+norm, " in summary
    assert "![Memory breakdown per trial](memory.png)" in summary
    chart = matplotlib.image.imread(runs / "report" / "memory.png")
    assert chart.shape[1] == 1080 and chart.shape[0] > 300


def test_write_report_falls_back_to_training_loss(tmp_path: Path) -> None:
    runs = make_runs(tmp_path / "runs", sweep=False, evals=False)
    write_report(runs)
    summary = (runs / "report" / "report.md").read_text()
    assert summary.startswith("# Sweep report: runs\n")
    assert "![Training loss vs tokens seen](loss.png)" in summary
    assert (runs / "report" / "loss.png").stat().st_size > 10_000


def test_write_report_on_empty_sweep(tmp_path: Path) -> None:
    (tmp_path / "trials").mkdir()
    text = write_report(tmp_path)
    assert "method" in text
    assert (tmp_path / "report" / "loss.png").read_bytes()[:4] == b"\x89PNG"


def test_missing_runs_dir_raises_with_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=r"runs directory not found: .*nope$"):
        load_runs(missing)
    with pytest.raises(FileNotFoundError, match="no trials/ folder"):
        load_steps(tmp_path)


def test_write_report_on_a_sweep_the_trainer_wrote(finished_run_copy: Path) -> None:
    """The shared finished sweep (two methods, one LR, evals at steps 2 and 4): every file the
    report promises, from real summaries and metrics."""
    text = write_report(finished_run_copy)
    out = finished_run_copy / "report"
    assert {"report.md", "report.html", "trials.csv", "pretrain.csv", "loss.png",
            "eval.png", "memory.png"} <= {p.name for p in out.iterdir()}
    summary = (out / "report.md").read_text()
    assert summary.startswith("# Sweep report: finished\n")
    assert "Best LR per method: full 0.003, adam8bit 0.003" in summary
    assert "![Eval perplexity vs tokens seen](loss.png)" in summary
    assert summary.index("| full ") < summary.index("| adam8bit ")  # the sweep's order
    trials = pd.read_csv(out / "trials.csv")
    assert len(trials) == 2 and set(trials["status"]) == {"ok"}
    assert "| full " in text and "| adam8bit " in text


def test_the_sweeps_note_opens_the_report_and_the_terminal_output(runs: Path) -> None:
    """The quickstart says its ordering is a smoke test and where a result is."""
    note = load_sweep(REPO / "sweeps" / "quickstart.yaml", {}).note
    assert "smoke test, not a result" in note and "sweeps/repro_small.yaml" in note
    sweep = yaml.safe_load((runs / "sweep.yaml").read_text())
    (runs / "sweep.yaml").write_text(yaml.safe_dump({**sweep, "note": note}, sort_keys=False))
    assert write_report(runs).startswith(note + "\n\n")
    assert (runs / "report" / "report.md").read_text().startswith(
        f"# Sweep report: demo\n\n{note}\n\n6 trials in ")
    assert (runs / "report" / "report.html").read_text().index(note.split(":")[0]) < (
        (runs / "report" / "report.html").read_text().index("6 trials in "))
