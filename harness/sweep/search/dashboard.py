"""`harness dashboard RUNS_DIR`: optuna-dashboard on a search sweep's own study storage (its
journal file, or the database its `storage:` names), so its users watch a study where they
already would, with its history, its Pareto front and each trial's parameters. Bound to
127.0.0.1: reach it from elsewhere through an SSH tunnel, never an open port."""

from __future__ import annotations

from pathlib import Path

import optuna
from optuna.storages import BaseStorage

from harness.errors import UserError
from harness.sweep.search.study import name_metrics, open_storage
from harness.trials import RunsDir

HOST = "127.0.0.1"


def sweep_of(runs_dir: Path) -> dict:
    """The run directory's sweep.yaml, read once for the storage and the objectives' names."""
    sweep = RunsDir(runs_dir).read_sweep()
    if not sweep:
        raise UserError(f"{runs_dir}: no sweep.yaml here (allowed: a sweep's run directory, "
                        "e.g. runs/quickstart)")
    return sweep


def storage_of(runs_dir: Path, sweep: dict) -> str:
    """The sweep's Optuna storage; a one-line error for a folder that has none."""
    if (sweep.get("search") or {}).get("sampler", "grid") == "grid":
        raise UserError(f"{runs_dir}: a grid sweep keeps no Optuna study; the dashboard shows "
                        "search sweeps (search.sampler random, tpe, cmaes or nsga2)")
    target = str(sweep.get("storage") or RunsDir(runs_dir).journal)
    if "://" not in target and not Path(target).is_file():
        raise UserError(f"{runs_dir}: its study storage {target} does not exist yet (run the "
                        "sweep first)")
    return target


def serve(runs_dir: Path, port: int) -> None:
    """Serve until interrupted (Ctrl-C)."""
    try:
        import optuna_dashboard
    except ImportError:
        raise UserError("harness dashboard needs optuna-dashboard: pip install -e "
                        "'.[dashboard]' (or pip install optuna-dashboard)") from None
    sweep = sweep_of(runs_dir)
    storage = open_storage(storage_of(runs_dir, sweep))
    name_objectives(sweep, storage)
    print(f"dashboard of {runs_dir}: http://{HOST}:{port}/dashboard (Ctrl-C stops it)",
          flush=True)
    optuna_dashboard.run_server(storage, host=HOST, port=port)


def name_objectives(sweep: dict, storage: BaseStorage) -> None:
    """Give each of the sweep's studies its objectives' metric names where it has none (a
    study from before sweeps named them), so the dashboard's axes read the metric, not
    "Objective 0"."""
    search = sweep.get("search") or {}
    goals = search.get("objectives") or [{"metric": search.get("metric") or "eval_ppl"}]
    metrics = [str(goal["metric"]) for goal in goals]
    stored = set(optuna.study.get_all_study_names(storage))
    for label in sweep.get("methods") or {}:
        name = f"{sweep.get('name')}/{label}"
        if name not in stored:
            continue
        study = optuna.load_study(study_name=name, storage=storage)
        if study.metric_names is None and len(study.directions) == len(metrics):
            name_metrics(study, metrics)
