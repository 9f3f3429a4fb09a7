"""The sweep's search behind one interface (harness/sweep/search/source.py): a grid's or an Optuna
search's plan, the trials a run will start, and a grid expanded once per run of a sweep. No
trial trains here: every trial is finished by hand or none is asked."""

from __future__ import annotations

from pathlib import Path

from conftest import micro_run, write_yaml

from harness.sweep.plan import expand as expand_module
from harness.sweep.plan.expand import load_sweep
from harness.sweep.plan.forecast import plan_text
from harness.sweep.run.driver import run_sweep
from harness.sweep.search.grid import GridSearch
from harness.sweep.search.open import open_search
from harness.sweep.search.study_source import StudySearch
from harness.trials import RunsDir

LRS = [0.001, 0.003]


def sweep_file(tmp_path: Path, **search) -> Path:
    """Pretraining on the sample data: 10 steps of 2 x 32 tokens, full and lora, two LRs on
    the grid (or `search`)."""
    run = micro_run(steps=10)
    run["train"].update(batch_size=2, total_batch_size=2)
    return write_yaml(tmp_path / "s.yaml", {
        "name": "s", "model": "llama_micro", "device": "cpu", "task": run["task"],
        "train": run["train"], "methods": {"full": {}, "lora": {"rank": 4}},
        "search": search or {"space": {"train.lr": LRS}}})


def finish(out: Path, trial_id: str, status: str, method: str = "full") -> None:
    RunsDir(out).trial(trial_id).write_summary({"trial": trial_id, "status": status,
                                                "method": method})


def test_open_search_tells_a_grid_from_an_optuna_search(tmp_path):
    out = tmp_path / "runs"
    assert type(open_search(load_sweep(sweep_file(tmp_path), {}), out)) is GridSearch
    searched = sweep_file(tmp_path, sampler="random", n_trials=3,
                          space={"train.lr": {"low": 1e-3, "high": 1e-2}})
    assert type(open_search(load_sweep(searched, {}), out)) is StudySearch


def test_a_grid_is_expanded_once_in_a_run_of_its_sweep(tmp_path, monkeypatch):
    """4 trials, all finished: the disk check, the trials to run, the failed and the
    unfinished ones at the end all read the one expansion, 4 trials made in all."""
    sweep, out = load_sweep(sweep_file(tmp_path), {}), tmp_path / "runs"
    for trial in open_search(sweep, out).trial_dirs():
        finish(out, trial.name, "ok")
    made, make = [], expand_module.make_trial
    monkeypatch.setattr(expand_module, "make_trial",
                        lambda *args: made.append(args[1]) or make(*args))
    assert run_sweep(sweep, out) == 0
    assert sorted(made) == ["full", "full", "lora", "lora"]


def test_a_grid_leaves_to_run_what_is_not_finished(tmp_path):
    """Of 4 trials: one ok, one failed (run again only with --retry-failed), two never run."""
    search = open_search(load_sweep(sweep_file(tmp_path), {}), tmp_path / "runs")
    ok, failed, *rest = [t.id for t in search.trials]
    finish(search.out, ok, "ok")
    finish(search.out, failed, "failed")
    assert [t.id for t in search.left(retry_failed=False)] == rest
    assert [t.id for t in search.left(retry_failed=True)] == [failed, *rest]


def test_a_search_leaves_each_methods_base_point_once_per_trial_left(tmp_path):
    """n_trials 3 a method: full has 2 finished (one ok, one pruned), lora one failed, which
    counts unless --retry-failed runs it again: 1 full and 2 lora left, or 1 and 3."""
    path = sweep_file(tmp_path, sampler="random", n_trials=3,
                      space={"train.lr": {"low": 1e-3, "high": 1e-2}})
    search = open_search(load_sweep(path, {}), tmp_path / "runs")
    finish(search.out, "full-a", "ok")
    finish(search.out, "full-b", "pruned")
    finish(search.out, "lora-c", "failed", method="lora")
    assert [t.label for t in search.left(retry_failed=False)] == ["full", "lora", "lora"]
    assert [t.label for t in search.left(retry_failed=True)] == ["full"] + ["lora"] * 3


def test_a_pretraining_grids_plan_has_its_cost_columns_and_totals(tmp_path):
    """4 trials of 10 steps x 2 sequences x 32 tokens: 640 tokens each, 2,560 in all."""
    sweep = load_sweep(sweep_file(tmp_path), {})
    search = open_search(sweep, tmp_path / "runs")
    lines = plan_text(sweep, search.trials, search.out).splitlines()
    header, rows, last = lines[0], lines[2:-1], lines[-1]
    for column in ("trial", "hyperparameters", "peak a process", "device time", "kept on disk"):
        assert column in header
    assert [row.split()[0] for row in rows] == [t.id for t in search.trials]
    assert all(" 640 " in row for row in rows)
    assert last.startswith("4 trials, 2,560 tokens in all; predicted: ")
    assert search.describe() == "\n".join(lines)


def test_a_searchs_plan_is_its_studies(tmp_path):
    path = sweep_file(tmp_path, sampler="random", n_trials=3,
                      space={"train.lr": {"low": 1e-3, "high": 1e-2}})
    text = open_search(load_sweep(path, {}), tmp_path / "runs").describe()
    assert text.splitlines()[0] == "sampler random, pruner none, minimize eval_ppl"
    assert "full: study s/full" in text and "lora: study s/lora" in text
    assert text.splitlines()[-1].startswith("budget: 3 trials per method x 2 methods = 6 "
                                            "trials of 10 steps")
