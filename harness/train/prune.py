"""The trial side of an Optuna sweep: a trial whose folder holds `optuna.json` reports each
evaluation to its study and stops, `pruned`, when the study's pruner says so.

It lives with training, not with the sweep, because `harness train` (and `train()` called
directly on such a folder) must find its study with no sweep around it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import optuna
from optuna.storages import BaseStorage, RDBStorage
from optuna.storages.journal import JournalFileBackend, JournalStorage
from optuna.trial import TrialState

from harness.trials import TrialDir, read_json


def plain_storage(target: str) -> BaseStorage:
    """A database URL is an RDBStorage; anything else a journal file."""
    if "://" in target:
        return RDBStorage(target)
    Path(target).parent.mkdir(parents=True, exist_ok=True)
    return JournalStorage(JournalFileBackend(target))


def make_pruner(name: str) -> optuna.pruners.BasePruner:
    if name == "median":
        return optuna.pruners.MedianPruner()
    if name == "hyperband":
        return optuna.pruners.HyperbandPruner()
    return optuna.pruners.NopPruner()


def pruner_for(trial_dir: Path) -> Callable[[int, dict[str, float]], bool] | None:
    """Only a trial started by an Optuna sweep (its folder holds optuna.json) reports evals."""
    link = TrialDir(trial_dir).optuna_link
    if not link.exists():
        return None
    return lambda step, metrics: report(link, step, metrics)


def report(link_path: Path, step: int, metrics: dict[str, float]) -> bool:
    """Called by a trial at each evaluation: report the metric to its study, ask to prune (a
    multi-objective study, which Optuna cannot prune, has no metric in the link)."""
    link = read_json(link_path) or {}
    if link.get("metric") is None:
        return False
    storage = plain_storage(link["storage"])
    study = optuna.load_study(
        study_name=link["study"], storage=storage, pruner=make_pruner(link["pruner"])
    )
    study_id = storage.get_study_id_from_name(link["study"])
    trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, link["trial"])
    if storage.get_trial(trial_id).state != TrialState.RUNNING:
        return False  # a trial re-run by hand after its study moved on
    trial = optuna.trial.Trial(study, trial_id)
    trial.report(metrics[link["metric"]], step)
    return trial.should_prune()
