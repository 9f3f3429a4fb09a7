"""The trial side of an Optuna sweep: a trial whose folder holds `optuna.json` reports each
evaluation to its study and stops, `pruned`, when the study's pruner says so.

Training knows no Optuna: the trial's entry (`harness train`) asks `pruner_for` its folder
and hands the callable it gets to `train()`, which calls it at each evaluation.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from harness.sweep.search.study import make_pruner, plain_storage
from harness.trials import TrialDir, read_json


def pruner_for(trial_dir: Path) -> Callable[[int, dict[str, float]], bool] | None:
    """Only a trial started by an Optuna sweep (its folder holds optuna.json) reports evals; a
    multi-objective study, which Optuna cannot prune, names no metric and gets none. The link
    is read once, as the trial starts."""
    link = read_json(TrialDir(trial_dir).optuna_link)
    if not link or link.get("metric") is None:
        return None
    return lambda step, metrics: report(link, step, metrics)


def report(link: dict[str, Any], step: int, metrics: dict[str, float]) -> bool:
    """Called by a trial at each evaluation: report the link's metric to its study, ask to
    prune."""
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
