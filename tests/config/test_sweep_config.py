"""harness/config/sweep.py: a search fits its sampler, a launcher's ranks fit its kind."""

from __future__ import annotations

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
