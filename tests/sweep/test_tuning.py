"""The same tuning for every method (a sweep's `tuning:`): the key's checks, coordinate
descent on synthetic objectives, and the grid and Optuna procedures' spaces. No trial trains:
each is finished by hand with a synthetic result."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from conftest import micro_run, write_yaml

from harness.errors import UserError
from harness.sweep.plan.expand import load_sweep
from harness.sweep.search.coordinate import CoordinateSearch, descend
from harness.sweep.search.grid import GridSearch
from harness.sweep.search.open import open_search
from harness.sweep.search.study_source import StudySearch
from harness.trials import RunsDir

LADDER = [2.5e-4, 5e-4, 1e-3, 2e-3, 4e-3]


def sweep_file(tmp_path: Path, tuning: dict, methods: dict | None = None, **more) -> Path:
    """4 steps of llama_micro; with a `budget:`, its steps and warmup follow each budget."""
    run = micro_run(steps=4, lr=1e-3)
    if "budget" in more:
        del run["train"]["steps"], run["train"]["warmup_steps"]
    return write_yaml(tmp_path / "s.yaml", {
        "name": "s", "model": "llama_micro", "device": "cpu", "task": run["task"],
        "train": run["train"], "methods": methods or {"full": {}, "muon": {}, "lion": {}},
        "seeds": [0, 1], "tuning": tuning, **more})


def run_all(search, loss, stop_after: int | None = None) -> list[str]:
    """Hand out trials one at a time, each finished ok with `loss(run)` as its eval loss (and
    its perplexity); the ids in the order handed out."""
    source, ids = search.start(False).sources[0], []
    while (stop_after is None or len(ids) < stop_after) and (pick := source.next()) is not None:
        value = loss(pick.config)
        RunsDir(search.out).trial(pick.id).write_summary({
            "trial": pick.id, "status": "ok", "method": pick.label,
            "eval_loss": value, "eval_ppl": math.exp(value)})
        source.finish(pick)
        ids.append(pick.id)
    return ids


def bowl(run) -> float:
    """Lowest at lr 2e-3 (and, for AdamW, betas (0.9, 0.98)); seeds differ a little."""
    loss = 3 + math.log2(run.train.lr / 2e-3) ** 2 + 0.01 * run.seed
    if run.method_name == "full":
        loss += 0 if tuple(run.method_params["betas"]) == (0.9, 0.98) else 0.5
    return loss


def test_descent_reaches_a_separable_bowls_minimum():
    """f = (a-5)² + 2(b-1)² + (c-2)², from (2, 3, 0): its minimum (5, 1, 2) is found, the budget
    spent exactly, and the best's LR neighbours (axis 0) were run."""
    def f(p):
        return (p[0] - 5) ** 2 + 2 * (p[1] - 1) ** 2 + (p[2] - 2) ** 2

    known: dict = {}
    while (step := descend([8, 4, 3], (2, 3, 0), known.get, 40)).proposals:
        known.update({p: f(p) for p in step.proposals})
    assert step.best == (5, 1, 2)
    assert len(step.used) == len(set(step.used)) == 40
    assert {(4, 1, 2), (6, 1, 2)} <= set(step.used)


def test_the_last_of_the_budget_goes_to_the_best_lr_neighbours():
    """f = (a-1)² + (b-3)² from (1, 0), 6 configurations: the LR holds at 1; b moves to 1; with
    2 left, the LR neighbours of (1, 1) run rather than b's next rung (hand-traced)."""
    known: dict = {}
    while (step := descend([3, 4], (1, 0), known.get, 6)).proposals:
        known.update({p: (p[0] - 1) ** 2 + (p[1] - 3) ** 2 for p in step.proposals})
    assert step.used == [(1, 0), (0, 0), (2, 0), (1, 1), (0, 1), (2, 1)]
    assert step.best == (1, 1)


def test_a_diverged_configuration_is_never_the_best():
    known: dict = {}
    values = {(0,): 2.0, (1,): 1.0, (2,): math.inf}
    while (step := descend([3], (1,), known.get, 3)).proposals:
        known.update({p: values[p] for p in step.proposals})
    assert step.best == (1,)
    assert sorted(step.used) == [(0,), (1,), (2,)]


def test_coordinate_tunes_every_method_with_the_same_trial_count(tmp_path):
    """5 configurations x 2 seeds for each of AdamW, Muon and Lion; AdamW's descent reaches the
    bowl's minimum (lr 2e-3 from 1e-3, then betas (0.9, 0.98) from (0.9, 0.999))."""
    tuning = {"procedure": "coordinate", "trials": 5, "lr": LADDER}
    search = open_search(load_sweep(sweep_file(tmp_path, tuning), {}), tmp_path / "runs")
    assert type(search) is CoordinateSearch
    ids = run_all(search, bowl)
    assert {label: sum(i.startswith(f"{label}-") for i in ids)
            for label in ("full", "muon", "lion")} == {"full": 10, "muon": 10, "lion": 10}
    full = next(g for g in search.groups if g.label == "full")
    best = full.point(full.step().best)
    assert best == {"train.lr": 2e-3, "method.betas": (0.9, 0.98)}
    again = open_search(load_sweep(sweep_file(tmp_path, tuning), {}), tmp_path / "runs")
    assert run_all(again, bowl) == []  # a finished descent re-runs nothing
    assert again.left(False) == []


def test_each_budget_is_tuned_on_its_own(tmp_path):
    """Two token budgets (2 and 4 steps of 4 x 32 tokens): a descent each, 3 configurations x
    2 seeds at each; the bowl's minimum is reached at both."""
    tuning = {"procedure": "coordinate", "trials": 3, "lr": LADDER}
    path = sweep_file(tmp_path, tuning, methods={"muon": {}}, budget={"tokens": [256, 512]})
    search = open_search(load_sweep(path, {}), tmp_path / "runs")
    ids = run_all(search, bowl)
    assert len(ids) == 12
    steps = [(g.budget.tokens, {t.run.train.steps for p in g.step().used for t in g.trials(p)})
             for g in search.groups]
    assert steps == [(256, {2}), (512, {4})]
    assert [g.point(g.step().best)["train.lr"] for g in search.groups] == [2e-3, 2e-3]


def test_a_source_made_again_mid_way_proposes_the_same_trials(tmp_path):
    tuning = {"procedure": "coordinate", "trials": 4, "lr": LADDER}
    path, out = sweep_file(tmp_path, tuning, methods={"full": {}}), tmp_path / "runs"
    first = open_search(load_sweep(path, {}), out)
    run_all(first, bowl, stop_after=3)
    source = first.start(False).sources[0]
    coming = [source.next().id, source.next().id]  # handed out, not finished
    second = open_search(load_sweep(path, {}), out).start(False).sources[0]
    assert [second.next().id, second.next().id] == coming


def test_retry_failed_runs_a_failed_trial_once_more_before_it_counts(tmp_path):
    """A start trial that failed: without --retry-failed the descent takes it as diverged and
    moves on; with it, the same trial is handed out again, and once only in that run."""
    tuning = {"procedure": "coordinate", "trials": 3, "lr": LADDER}
    path, out = sweep_file(tmp_path, tuning, methods={"full": {}}, seeds=[0]), tmp_path / "runs"
    source = open_search(load_sweep(path, {}), out).start(False).sources[0]
    start = source.next()
    RunsDir(out).trial(start.id).write_summary({"trial": start.id, "status": "failed",
                                                "method": "full"})
    source.finish(start)
    assert source.next().id != start.id  # diverged: its LR neighbours come next
    search = open_search(load_sweep(path, {}), out)
    again = search.start(True).sources[0]
    assert again.next().id == start.id
    RunsDir(out).trial(start.id).write_summary({"trial": start.id, "status": "failed",
                                                "method": "full"})
    again.finish(start)
    assert again.next().id != start.id


def test_a_setting_the_method_entry_fixes_is_not_tuned(tmp_path):
    tuning = {"procedure": "coordinate", "trials": 3, "lr": LADDER}
    path = sweep_file(tmp_path, tuning, methods={"galore": {"scale": 0.25}})
    search = open_search(load_sweep(path, {}), tmp_path / "runs")
    assert [s.key for s in search.groups[0].steps] == ["train.lr", "method.update_proj_gap"]
    assert "method.update_proj_gap: [50, 100, 200, 500] (starts at 200)" in search.describe()


def test_grid_tunes_the_lr_alone_for_every_method(tmp_path):
    tuning = {"procedure": "grid", "lr": [1e-3, 2e-3, 4e-3]}
    search = open_search(load_sweep(sweep_file(tmp_path, tuning), {}), tmp_path / "runs")
    assert type(search) is GridSearch
    trials = search.trials
    assert len(trials) == 3 * 3 * 2  # methods x lr x seeds
    assert {t.run.train.lr for t in trials} == {1e-3, 2e-3, 4e-3}
    muon = [t for t in trials if t.label == "muon"]
    assert {t.run.method_params["momentum"] for t in muon} == {0.95}


def test_optuna_searches_the_lr_range_and_each_methods_tunables(tmp_path):
    """TPE's space per method; its first asked trial is a run config with the tuple setting
    read back from Optuna's stored list."""
    tuning = {"procedure": "optuna", "trials": 4, "lr": [1e-4, 1e-2]}
    search = open_search(load_sweep(sweep_file(tmp_path, tuning), {}), tmp_path / "runs")
    assert type(search) is StudySearch
    spaces = {label: entry["space"] for label, entry in search.sweep.methods.items()}
    assert spaces["full"] == {"train.lr": {"low": 1e-4, "high": 1e-2, "log": True},
                              "method.betas": [[0.9, 0.95], [0.9, 0.98], [0.9, 0.999]]}
    assert spaces["muon"]["method.momentum"] == [0.9, 0.95, 0.98]
    assert search.sweep.search.n_trials == 4
    pick = search.start(False).sources[0].next()
    assert pick.label == "full" and 1e-4 <= pick.config.train.lr <= 1e-2
    assert tuple(pick.config.method_params["betas"]) in {(0.9, 0.95), (0.9, 0.98), (0.9, 0.999)}


@pytest.mark.parametrize(("tuning", "more", "message"), [
    ({"procedure": "coordinate", "trials": 3, "lr": [1e-3, 3e-3]}, {},
     "lr: 0.003 after 0.001 is not twice it"),
    ({"procedure": "coordinate", "lr": LADDER}, {}, "trials is required with procedure"),
    ({"procedure": "grid", "trials": 2, "lr": LADDER}, {}, "trials: 2 with procedure grid"),
    ({"procedure": "optuna", "trials": 3, "lr": [1e-3]}, {}, "give two"),
    ({"procedure": "grid", "lr": [2e-3, 1e-3]}, {}, "must be positive, distinct and ascending"),
    ({"procedure": "grid", "lr": LADDER}, {"search": {"space": {"train.lr": [1e-3]}}},
     "search.space: not allowed with tuning:"),
    ({"procedure": "coordinate", "trials": 3, "lr": LADDER},
     {"launcher": {"kind": "submitit-local"}}, "launcher.kind: 'submitit-local' with tuning"),
    ({"procedure": "grid", "lr": LADDER},
     {"search": {"objectives": [{"metric": "eval_ppl"}, {"metric": "peak_memory_bytes"}]}},
     "search.objectives: tuning: minimizes one metric"),
])
def test_bad_tuning_is_one_line(tmp_path, tuning, more, message):
    with pytest.raises(UserError, match=message) as caught:
        load_sweep(sweep_file(tmp_path, tuning, **more), {})
    assert "\n" not in str(caught.value)


def test_more_trials_than_a_method_has_configurations_is_refused(tmp_path):
    """Lion: 2 LRs x 3 betas = 6 configurations; 7 would leave it fewer than the others."""
    tuning = {"procedure": "coordinate", "trials": 7, "lr": [1e-3, 2e-3]}
    sweep = load_sweep(sweep_file(tmp_path, tuning, methods={"lion": {}}), {})
    with pytest.raises(UserError, match=r"tuning.trials: 7 is more than methods.lion's 6 "
                       r"configurations \(2 train.lr x 3 method.betas\)"):
        open_search(sweep, tmp_path / "runs")


def test_optuna_with_budgets_is_refused(tmp_path):
    tuning = {"procedure": "optuna", "trials": 3, "lr": LADDER}
    sweep = load_sweep(sweep_file(tmp_path, tuning, budget={"tokens": [256]}), {})
    with pytest.raises(UserError, match=r"tuning.procedure: optuna with budget: \(its study"):
        open_search(sweep, tmp_path / "runs")


def test_a_method_space_with_tuning_is_refused(tmp_path):
    methods = {"full": {"space": {"train.lr": [1e-3]}}}
    with pytest.raises(UserError, match=r"methods.full.space: not allowed with tuning:"):
        load_sweep(sweep_file(tmp_path, {"procedure": "grid", "lr": LADDER}, methods), {})

