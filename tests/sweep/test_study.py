"""Optuna search through the real command: study per method, resume, enqueue, pruning."""

from __future__ import annotations

import os
import re
import signal
import statistics
import subprocess
import sys
import time

import optuna
import pytest
from conftest import STEPS_LEFT, harness_here, micro_run, wait_for_step, write_yaml

from harness.errors import UserError
from harness.methods.resolve import load_run
from harness.sweep.plan.expand import load_sweep, make_trial
from harness.sweep.search.prune import pruner_for
from harness.sweep.search.study import method_space, open_storage, open_study, tell
from harness.train import train
from harness.trials import read_json, write_json


def search_file(tmp_path, **search):
    run = micro_run(steps=2)
    data = {k: run[k] for k in ("model", "task", "train", "eval")}
    data["eval"] = {"every": 0, "tokens": 64}
    data.update(name="tpe", methods={"full": {}}, search=search)
    return write_yaml(tmp_path / "tpe.yaml", data)


@pytest.mark.parametrize(
    ("search", "message"),
    [
        ({"sampler": "tpe", "space": {"train.lr": {"low": 1e-4}}}, "n_trials is required"),
        (
            {"sampler": "tpe", "n_trials": 2, "space": {"train.lr": {"low": 1e-4}}},
            "search.space.train.lr: {'low': 0.0001} is not a distribution",
        ),
        (
            {"sampler": "tpe", "n_trials": 2, "space": {"train.lr": {"low": 1, "high": 0.1}}},
            "low 1 must be below high 0.1",
        ),
        (
            {
                "sampler": "random",
                "n_trials": 2,
                "space": {"train.lr": {"low": 0, "high": 1, "log": True}},
            },
            "log: true needs low > 0",
        ),
        ({"sampler": "grid", "n_trials": 3}, "n_trials needs an Optuna sampler"),
    ],
)
def test_search_config_errors_are_one_line(tmp_path, search, message):
    with pytest.raises(UserError, match=message) as e:
        load_sweep(search_file(tmp_path, **search), {})
    assert "\n" not in str(e.value)


def test_method_space_is_conditional_and_ints_stay_ints(tmp_path):
    path = search_file(
        tmp_path,
        sampler="random",
        n_trials=2,
        space={"train.lr": {"low": "1e-4", "high": "1e-2", "log": True}},
    )
    data = read_json_yaml(path)
    data["methods"] = {
        "full": {},
        "lowrank": {"space": {"method.rank": {"low": 4, "high": 16, "step": 4}}},
    }
    sweep = load_sweep(write_yaml(path, data), {})
    assert set(method_space(sweep, "full")) == {"train.lr"}
    rank = method_space(sweep, "lowrank")["method.rank"]
    assert isinstance(rank, optuna.distributions.IntDistribution) and rank.step == 4
    trial = make_trial(sweep, "lowrank", {"train.lr": 1e-3, "method.rank": 8}, 0)
    assert trial.run.method["rank"] == 8 and trial.id.startswith("lowrank-")
    dry = harness_here("sweep", str(path), "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "lowrank: study tpe/lowrank" in dry.stdout and "method.rank" in dry.stdout
    assert "2 trials per method x 2 methods = 4 trials" in dry.stdout


def read_json_yaml(path):
    import yaml

    return yaml.safe_load(path.read_text())


def test_tpe_sweep_runs_a_study_and_resumes_without_rerunning(tmp_path):
    path = search_file(
        tmp_path,
        sampler="tpe",
        n_trials=4,
        space={"train.lr": {"low": 1e-4, "high": 1e-2, "log": True}},
        enqueue=[{"train.lr": 0.003}],
    )
    out = tmp_path / "runs"
    done = harness_here("sweep", str(path), "--out", str(out), "--jobs", "2")
    assert done.returncode == 0, done.stderr
    assert (out / "optuna.journal").is_file()
    study = optuna.load_study(
        study_name="tpe/full", storage=open_storage(str(out / "optuna.journal"))
    )
    trials = study.get_trials()
    assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE] * 4
    assert trials[0].params == {"train.lr": 0.003}
    ids = {t.user_attrs["trial_id"] for t in trials}
    assert ids == {d.name for d in (out / "trials").iterdir()}
    for t in trials:
        summary = read_json(out / "trials" / t.user_attrs["trial_id"] / "summary.json")
        assert summary["eval_ppl"] == pytest.approx(t.value)
        assert summary["lr"] == pytest.approx(t.params["train.lr"])

    again = harness_here("sweep", str(path), "--out", str(out))
    assert again.returncode == 0, again.stderr
    assert "tpe/full: 4 of 4 trials finished" in again.stdout
    assert (
        len(
            optuna.load_study(
                study_name="tpe/full", storage=open_storage(str(out / "optuna.journal"))
            ).trials
        )
        == 4
    )


def test_a_trial_stops_as_pruned_when_its_study_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(optuna.pruners.MedianPruner, "prune", lambda self, study, trial: True)
    path = search_file(tmp_path, sampler="tpe", n_trials=1, pruner="median")
    sweep = load_sweep(path, {})
    target = str(tmp_path / "optuna.journal")
    study = open_study(sweep, "full", open_storage(target))
    asked = study.ask()
    out = tmp_path / "trial"
    write_json(
        out / "optuna.json",
        {
            "storage": target,
            "study": "tpe/full",
            "trial": 0,
            "metric": "eval_ppl",
            "pruner": "median",
        },
    )
    summary = train(load_run(micro_run(steps=6)), out, prune=pruner_for(out))
    assert summary["status"] == "pruned" and summary["step"] == 3
    assert summary["eval_ppl"] is not None
    tell(study, asked.number, summary, sweep.search)
    frozen = study.trials[0]
    assert frozen.state == optuna.trial.TrialState.PRUNED
    assert list(frozen.intermediate_values) == [3]


def test_a_trial_reads_its_study_link_once_as_it_starts(tmp_path, monkeypatch):
    """The link is read as the trial starts and handed down: with the file gone, the trial
    still reports to its study and obeys its pruner. A folder without a link, or a
    multi-objective study's (no metric: Optuna cannot prune it), gets no pruner."""
    monkeypatch.setattr(optuna.pruners.MedianPruner, "prune", lambda self, study, trial: True)
    sweep = load_sweep(search_file(tmp_path, sampler="tpe", n_trials=1, pruner="median"), {})
    target = str(tmp_path / "optuna.journal")
    study = open_study(sweep, "full", open_storage(target))
    study.ask()
    out = tmp_path / "trial"
    link = {"storage": target, "study": "tpe/full", "trial": 0, "metric": "eval_ppl",
            "pruner": "median"}
    write_json(out / "optuna.json", link)
    prune = pruner_for(out)
    (out / "optuna.json").unlink()
    assert prune is not None and prune(3, {"eval_ppl": 41.5}) is True
    assert study.trials[0].intermediate_values == {3: 41.5}
    assert pruner_for(out) is None
    write_json(out / "optuna.json", {**link, "metric": None})
    assert pruner_for(out) is None


@pytest.mark.parametrize(("sampler", "kind"), [("random", "RandomSampler"), ("tpe", "TPESampler"),
                                               ("cmaes", "CmaEsSampler"),
                                               ("nsga2", "NSGAIISampler")])
def test_each_sampler_is_built_seeded(tmp_path, sampler, kind):
    from harness.sweep.search.study import make_sampler

    data = {"name": "s", "model": "llama_micro", "methods": {"full": {}}, "seeds": [3],
            "search": {"sampler": sampler, "n_trials": 2,
                       "space": {"train.lr": {"low": 1e-4, "high": 1e-2, "log": True}}}}
    sweep = load_sweep(write_yaml(tmp_path / "s.yaml", data), {})
    built = make_sampler(sweep.search.sampler, sweep.seeds[0])
    assert type(built).__name__ == kind


def test_a_multi_objective_search_tells_each_objective_and_records_the_constraint(tmp_path):
    """Perplexity and peak memory, minimized together, with a memory constraint: each trial's
    values are its summary's, its margin is peak - limit, and the study's Pareto front is the
    feasible trials no other feasible one beats on both (checked by hand here). Full recompute
    lowers the peak (measured 24.6 MB against 25.3 MB), so the limit between them leaves only
    those feasible."""
    limit = 25_000_000
    path = search_file(
        tmp_path, sampler="tpe", n_trials=4,
        objectives=[{"metric": "eval_ppl"}, {"metric": "peak_memory_bytes"}],
        constraints=[f"peak_memory_bytes <= {limit}"],
        space={"train.lr": {"low": 1e-3, "high": 1e-2, "log": True},
               "memory.recompute": ["none", "full"]},
        enqueue=[{"train.lr": 0.003, "memory.recompute": "none"},
                 {"train.lr": 0.003, "memory.recompute": "full"}])
    out = tmp_path / "runs"
    done = harness_here("sweep", str(path), "--out", str(out), "--jobs", "2")
    assert done.returncode == 0, done.stderr
    assert "minimize eval_ppl, minimize peak_memory_bytes" in harness_here(
        "sweep", str(path), "--dry-run").stdout
    study = optuna.load_study(study_name="tpe/full",
                              storage=open_storage(str(out / "optuna.journal")))
    trials = study.get_trials()
    assert len(trials) == 4 and len(study.directions) == 2
    values = {}
    for t in trials:
        assert t.state == optuna.trial.TrialState.COMPLETE
        summary = read_json(out / "trials" / t.user_attrs["trial_id"] / "summary.json")
        assert t.values == [summary["eval_ppl"], summary["peak_memory_bytes"]]
        assert t.constraints == {f"peak_memory_bytes <= {limit}":
                                 summary["peak_memory_bytes"] - limit}
        values[t.number] = t.values
    feasible = {n: v for n, v in values.items() if v[1] <= limit}
    assert 0 < len(feasible) < len(values)  # trial 1 (recompute) in, trial 0 out
    front = {n for n, (p, m) in feasible.items()
             if not any(q <= p and k <= m and (q, k) != (p, m) for q, k in feasible.values())}
    assert {t.number for t in study.best_trials} == front


def test_median_pruner_cuts_a_bad_trial_from_real_statistics(tmp_path):
    """Five good learning rates finish; a sixth that barely learns is above their median at
    its first evaluation and ends `pruned`, keeping its metrics."""
    lrs = [0.003, 0.004, 0.005, 0.006, 0.007, 1e-7]
    path = search_file(tmp_path, sampler="random", n_trials=6, pruner="median",
                       space={"train.lr": {"low": 1e-8, "high": 1e-2, "log": True}},
                       enqueue=[{"train.lr": lr} for lr in lrs])
    data = read_json_yaml(path)
    data["train"]["steps"], data["eval"]["every"] = 4, 2
    out = tmp_path / "runs"
    done = harness_here("sweep", str(write_yaml(path, data)), "--out", str(out))
    assert done.returncode == 0, done.stderr
    study = optuna.load_study(study_name="tpe/full",
                              storage=open_storage(str(out / "optuna.journal")))
    states = [t.state.name for t in study.get_trials()]
    assert states == ["COMPLETE"] * 5 + ["PRUNED"]
    pruned = study.get_trials()[5]
    assert list(pruned.intermediate_values) == [2]
    median = statistics.median(t.intermediate_values[2] for t in study.get_trials()[:5])
    assert pruned.intermediate_values[2] > median
    summary = read_json(out / "trials" / pruned.user_attrs["trial_id"] / "summary.json")
    assert summary["status"] == "pruned" and summary["step"] == 2
    assert summary["eval_ppl"] == pytest.approx(pruned.intermediate_values[2])
    assert "pruned" in harness_here("status", str(out)).stdout


def sweep_in_background(tmp_path, checkpoint_every: int, step: int):
    """A one-trial random-search sweep of `step` + STEPS_LEFT steps, started as a terminal
    starts it (SIGINT at its default: a pytest launched in the background inherits it ignored,
    and so would the sweep, which then never sees a Ctrl-C) and watched until `step`."""
    path = search_file(tmp_path, sampler="random", n_trials=1,
                       space={"train.lr": {"low": 1e-3, "high": 1e-2, "log": True}})
    data = read_json_yaml(path)
    data["train"].update(steps=step + STEPS_LEFT, checkpoint_every=checkpoint_every)
    write_yaml(path, data)
    out = tmp_path / "runs"
    sweep = subprocess.Popen([sys.executable, "-m", "harness.cli", "sweep", str(path),
                              "--out", str(out)], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    while not (out / "trials").is_dir() or not any((out / "trials").iterdir()):
        time.sleep(0.2)
    (trial_dir,) = (out / "trials").iterdir()
    wait_for_step(trial_dir, step)
    return sweep, path, out, trial_dir


def test_retry_failed_queues_a_crashed_optuna_trial_again(tmp_path):
    sweep, path, out, trial_dir = sweep_in_background(tmp_path, checkpoint_every=5, step=7)
    os.kill(read_json(trial_dir / "summary.json")["pid"], signal.SIGKILL)
    assert sweep.wait(timeout=120) == 1  # the kill is recorded; the sweep says so
    assert read_json(trial_dir / "summary.json")["status"] == "killed"  # SIGKILL: issue 18

    again = harness_here("sweep", str(path), "--out", str(out), "--retry-failed")
    assert again.returncode == 0, again.stderr
    resumed = re.search(rf"resumed from {trial_dir}/checkpoint/state.pt at step (\d+)",
                        again.stdout)
    assert resumed and int(resumed.group(1)) >= 5, again.stdout[-2000:]
    trials = optuna.load_study(study_name="tpe/full",
                               storage=open_storage(str(out / "optuna.journal"))).get_trials()
    assert [t.state.name for t in trials] == ["FAIL", "COMPLETE"]
    assert trials[1].user_attrs["retry_of"] == 0
    assert trials[1].user_attrs["trial_id"] == trials[0].user_attrs["trial_id"] == trial_dir.name
    assert "tpe/full: 1 of 1 trials finished" in harness_here("sweep", str(path), "--out",
                                                              str(out)).stdout


def test_ctrl_c_leaves_the_trial_to_resume_on_the_next_run(tmp_path):
    sweep, path, out, trial_dir = sweep_in_background(tmp_path, checkpoint_every=0, step=3)
    sweep.send_signal(signal.SIGINT)
    assert sweep.wait(timeout=120) == 130
    assert read_json(trial_dir / "summary.json")["status"] == "interrupted"
    storage = open_storage(str(out / "optuna.journal"))
    assert [t.state.name for t in optuna.load_study(study_name="tpe/full",
                                                    storage=storage).get_trials()] == ["RUNNING"]

    again = harness_here("sweep", str(path), "--out", str(out))
    assert again.returncode == 0, again.stderr
    assert f"resumed from {trial_dir}/checkpoint/state.pt" in again.stdout
    trials = optuna.load_study(study_name="tpe/full", storage=storage).get_trials()
    assert [t.state.name for t in trials] == ["FAIL", "COMPLETE"]  # told, then retried in place
    assert trials[1].user_attrs["trial_id"] == trial_dir.name
    assert "tpe/full: 1 of 1 trials finished" in harness_here("sweep", str(path), "--out",
                                                              str(out)).stdout
