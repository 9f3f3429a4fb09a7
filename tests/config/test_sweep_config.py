"""harness/config/sweep.py: a search fits its sampler, a launcher's ranks fit its kind."""

from __future__ import annotations

import re

import pytest

from harness.config import LauncherConfig, SearchConfig, SweepConfig, validate
from harness.errors import UserError


def sweep(**data) -> SweepConfig:
    return validate(SweepConfig, {"name": "s", "methods": {"full": {}}, **data})


def test_defaults_are_one_seed_one_local_job_and_a_grid():
    s = sweep()
    assert s.seeds == [0] and s.storage is None
    assert (s.search.sampler, s.search.space, s.search.metric) == ("grid", {}, "eval_ppl")
    assert (s.launcher.kind, s.launcher.jobs, s.launcher.ranks) == ("local", 1, 1)


def test_a_sweep_needs_methods_and_seeds():
    with pytest.raises(UserError, match=r"^methods: \{\} is invalid"):
        validate(SweepConfig, {"name": "s", "methods": {}})
    with pytest.raises(UserError, match=r"^seeds: \[\] is invalid"):
        sweep(seeds=[])


@pytest.mark.parametrize("extra", [{"n_trials": 4}, {"timeout_min": 5}, {"enqueue": [{}]},
                                   {"pruner": "median"}])
def test_optuna_keys_need_an_optuna_sampler(extra):
    key = next(iter(extra))
    with pytest.raises(UserError, match=rf"^search: {key} needs an Optuna sampler \(random, "):
        sweep(search=extra)


def test_grid_space_is_lists_and_optuna_space_is_distributions():
    grid = sweep(search={"space": {"train.lr": [1e-3, 3e-3]}}).search
    assert grid.space == {"train.lr": [1e-3, 3e-3]}
    with pytest.raises(UserError, match=r"^search.space.train.lr: expected a non-empty list "):
        sweep(search={"space": {"train.lr": {"low": 1e-4, "high": 1e-2}}})
    tpe = SearchConfig(sampler="tpe", n_trials=3,
                       space={"train.lr": {"low": 1e-4, "high": 1e-2, "log": True}})
    assert tpe.n_trials == 3
    with pytest.raises(UserError, match=r"^search: n_trials is required for sampler 'cmaes'"):
        sweep(search={"sampler": "cmaes"})
    with pytest.raises(UserError, match=r"^search.space.train.lr: low 1 must be below high"):
        sweep(search={"sampler": "random", "n_trials": 2,
                      "space": {"train.lr": {"low": 1, "high": 0.5}}})


def test_ranks_are_nodes_times_tasks_and_need_a_process_launcher():
    assert LauncherConfig(nodes=2, tasks_per_node=4).ranks == 8
    assert sweep(launcher={"kind": "submitit-local", "tasks_per_node": 2}).launcher.ranks == 2
    with pytest.raises(UserError, match=r"^config: launcher: nodes x tasks_per_node > 1 \(a DDP "
                                        r"trial\) needs kind submitit-local or slurm"):
        sweep(launcher={"tasks_per_node": 2})
    # Optuna workers run multi-process trials too (tests/sweep/test_launchers.py runs one)
    searched = sweep(launcher={"kind": "slurm", "nodes": 2},
                     search={"sampler": "random", "n_trials": 2, "space": {}})
    assert (searched.launcher.ranks, searched.search.sampler) == (2, "random")


def test_objectives_default_to_the_metric_and_constraints_parse():
    one = sweep().search
    assert [(g.metric, g.direction) for g in one.goals] == [("eval_ppl", "minimize")]
    two = SearchConfig(sampler="nsga2", n_trials=4, objectives=[
        {"metric": "eval_ppl"}, {"metric": "tokens_per_s", "direction": "maximize"}],
        constraints=["peak_memory_bytes <= 24GB", "trial_hours>=0.5"])
    assert [(g.metric, g.direction) for g in two.goals] == [
        ("eval_ppl", "minimize"), ("tokens_per_s", "maximize")]
    memory, hours = two.limits
    assert (memory.metric, memory.op, memory.limit) == ("peak_memory_bytes", "<=", 24e9)
    assert memory.violation(25e9) == 1e9 and memory.violation(23e9) == -1e9
    assert hours.violation(0.25) == 0.25 and hours.violation(1.0) == -0.5


@pytest.mark.parametrize(("search", "message"), [
    ({"sampler": "tpe", "n_trials": 2, "pruner": "median",
      "objectives": [{"metric": "eval_ppl"}, {"metric": "peak_memory_bytes"}]},
     "search: pruner 'median' needs one objective: Optuna cannot prune a multi-objective study"),
    ({"sampler": "cmaes", "n_trials": 2,
      "objectives": [{"metric": "eval_ppl"}, {"metric": "peak_memory_bytes"}]},
     "search: sampler 'cmaes' searches one objective; with several use tpe or nsga2"),
    ({"constraints": ["peak_memory < 24GB"]},
     "search: search.constraints[0]: 'peak_memory < 24GB' is not a constraint (allowed: "
     "METRIC <= VALUE"),
    ({"objectives": [{"metric": "loss"}]}, "search.objectives.0.metric: 'loss' is not allowed"),
])
def test_objective_mistakes_are_one_line_errors(search, message):
    with pytest.raises(UserError, match="^" + re.escape(message)) as error:
        sweep(search=search)
    assert "\n" not in str(error.value)
