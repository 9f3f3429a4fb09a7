"""Optuna-driven search: one study per method, each Optuna trial an ordinary harness trial.

A sampled point becomes a resolved run config exactly as a grid point does, so its folder is
`trials/<label>-<hash>` either way and `harness status/report` read it unchanged. The Optuna
trial keeps that id in `user_attrs["trial_id"]`; the trial folder's `optuna.json` points back
to the study, so the training process reports each evaluation and obeys the pruner.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import optuna
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)
from optuna.storages import BaseStorage, RDBStorage
from optuna.storages.journal import JournalFileBackend, JournalStorage
from optuna.trial import TrialState

from harness.config import SweepConfig, UserError, check_distributions
from harness.records import read_json, write_json, write_yaml
from harness.sweep import FINISHED, Trial, make_trial, method_entry, trial_status

LINK = "optuna.json"
DONE = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)


def storage_target(sweep: SweepConfig, out: Path) -> str:
    return sweep.storage or str(out / "optuna.journal")


def open_storage(target: str) -> BaseStorage:
    """A database URL goes to RDBStorage; anything else is a journal file (no server needed)."""
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


def make_sampler(sweep: SweepConfig) -> optuna.samplers.BaseSampler:
    seed = sweep.seeds[0]
    if sweep.search.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if sweep.search.sampler == "cmaes":
        return optuna.samplers.CmaEsSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed)


def _to_optuna(spec: dict[str, Any]) -> BaseDistribution:
    if "choices" in spec:
        return CategoricalDistribution(spec["choices"])
    if spec["int"]:
        return IntDistribution(spec["low"], spec["high"], log=spec["log"], step=spec["step"] or 1)
    return FloatDistribution(spec["low"], spec["high"], log=spec["log"], step=spec["step"])


def method_space(sweep: SweepConfig, label: str) -> dict[str, BaseDistribution]:
    """The shared space plus the method's own (conditional: only this method's study sees it)."""
    _, _, own = method_entry(sweep, label)
    spec = {
        **check_distributions(sweep.search.space, "search.space"),
        **check_distributions(own, f"methods.{label}.space"),
    }
    return {key: _to_optuna(value) for key, value in spec.items()}


def enqueued(
    sweep: SweepConfig, spaces: dict[str, dict[str, BaseDistribution]]
) -> dict[str, list[dict[str, Any]]]:
    """Each fixed point, cut to the keys a method's space holds; every value must lie in it."""
    points: dict[str, list[dict[str, Any]]] = {label: [] for label in spaces}
    for i, point in enumerate(sweep.search.enqueue):
        for key, value in point.items():
            holders = [s[key] for s in spaces.values() if key in s]
            if not holders:
                raise UserError(f"search.enqueue[{i}].{key}: not in any search space")
            for dist in holders:
                try:
                    inside = dist._contains(dist.to_internal_repr(value))
                except (ValueError, TypeError):
                    inside = False
                if not inside:
                    raise UserError(f"search.enqueue[{i}].{key}: {value!r} is outside {dist}")
        for label, space in spaces.items():
            cut = {k: v for k, v in point.items() if k in space}
            if cut:
                points[label].append(cut)
    return points


def open_study(sweep: SweepConfig, label: str, storage: BaseStorage) -> optuna.Study:
    return optuna.create_study(
        storage=storage,
        study_name=f"{sweep.name}/{label}",
        sampler=make_sampler(sweep),
        pruner=make_pruner(sweep.search.pruner),
        direction=sweep.search.direction,
        load_if_exists=True,
    )


def _tell(study: optuna.Study, number: int, summary: dict[str, Any] | None, metric: str) -> None:
    """ok with a finite metric: COMPLETE; pruned: PRUNED; failed, nan, oom or no metric: FAIL."""
    summary = summary or {}
    value = summary.get(metric)
    if summary.get("status") == "pruned":
        study.tell(number, state=TrialState.PRUNED)
    elif summary.get("status") == "ok" and value is not None and math.isfinite(value):
        study.tell(number, value)
    else:
        study.tell(number, state=TrialState.FAIL)


def recover(study: optuna.Study, out: Path, metric: str) -> None:
    """Trials a killed sweep left RUNNING: told from their summary if the run finished, else
    failed (their folder keeps its checkpoint; the same point asked again resumes from it)."""
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        trial_dir = out / "trials" / str(t.user_attrs.get("trial_id", ""))
        status = trial_status(trial_dir)
        if status == "running":  # a live process on this machine still owns it
            continue
        summary = read_json(trial_dir / "summary.json") if status in FINISHED else None
        _tell(study, t.number, summary, metric)


def _harness_trial(sweep: SweepConfig, label: str, ot: optuna.Trial) -> Trial:
    """Seeds cycle over Optuna trials: the seed is part of the trial, as in a grid."""
    seed = sweep.seeds[ot.number % len(sweep.seeds)]
    trial = make_trial(sweep, label, dict(ot.params), seed)
    ot.set_user_attr("trial_id", trial.id)
    ot.set_user_attr("seed", seed)
    return trial


def run_study(sweep: SweepConfig, label: str, out: Path, jobs: int, target: str) -> None:
    """Ask `jobs` points at a time, run them as trial processes, tell their final metric."""
    from harness.launch import run_local

    s = sweep.search
    study = open_study(sweep, label, open_storage(target))
    space = method_space(sweep, label)
    recover(study, out, s.metric)
    for point in enqueued(sweep, {label: space})[label]:
        study.enqueue_trial(point, skip_if_exists=True)
    done = len(study.get_trials(deepcopy=False, states=DONE))
    print(f"{study.study_name}: {done} of {s.n_trials} trials finished", flush=True)
    deadline = time.time() + s.timeout_min * 60 if s.timeout_min else math.inf
    while done < (s.n_trials or 0) and time.time() < deadline:
        asked = [study.ask(space) for _ in range(min(jobs, s.n_trials - done))]
        trials = [_harness_trial(sweep, label, ot) for ot in asked]
        todo: dict[str, Path] = {}
        for ot, t in zip(asked, trials, strict=True):
            trial_dir = out / "trials" / t.id
            if t.id in todo or trial_status(trial_dir) in FINISHED:
                continue  # the same point asked twice: run it once, tell both
            write_yaml(trial_dir / "config.yaml", t.run.model_dump())
            link = {"storage": target, "study": study.study_name, "trial": ot.number}
            write_json(trial_dir / LINK, {**link, "metric": s.metric, "pruner": s.pruner})
            todo[t.id] = trial_dir
        run_local(list(todo.items()), jobs)
        for ot, t in zip(asked, trials, strict=True):
            _tell(study, ot.number, read_json(out / "trials" / t.id / "summary.json"), s.metric)
        done += len(asked)


def run_search(sweep: SweepConfig, out: Path, jobs: int) -> bool:
    """Run each method's study to `n_trials`; True if some trial failed (pruned is fine)."""
    target = storage_target(sweep, out)
    enqueued(sweep, {label: method_space(sweep, label) for label in sweep.methods})
    failed = False
    for label in sweep.methods:
        run_study(sweep, label, out, jobs, target)
        study = optuna.load_study(study_name=f"{sweep.name}/{label}", storage=open_storage(target))
        failed |= bool(study.get_trials(deepcopy=False, states=(TrialState.FAIL,)))
    return failed


def describe(sweep: SweepConfig) -> str:
    """The dry-run view: each method's space and the trial budget, in place of a trial table."""
    s = sweep.search
    spaces = {label: method_space(sweep, label) for label in sweep.methods}
    enqueued(sweep, spaces)
    lines = [f"sampler {s.sampler}, pruner {s.pruner}, {s.direction} {s.metric}"]
    for label, space in spaces.items():
        lines.append(f"{label}: study {sweep.name}/{label}")
        lines += [f"  {key}: {dist}" for key, dist in space.items()]
    steps = sweep.train.steps
    total = s.n_trials * len(spaces)
    limit = f", at most {s.timeout_min} min per method" if s.timeout_min else ""
    lines.append(
        f"budget: {s.n_trials} trials per method x {len(spaces)} methods = {total} trials "
        f"of {steps} steps{limit}; seeds {sweep.seeds} cycle over trials"
    )
    return "\n".join(lines)


def report(link_path: Path, step: int, metrics: dict[str, float]) -> bool:
    """Called by a trial at each evaluation: report the metric to its study, ask to prune."""
    link = read_json(link_path) or {}
    storage = open_storage(link["storage"])
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
