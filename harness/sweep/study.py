"""Optuna-driven search: one study per method, each Optuna trial an ordinary harness trial.

A sampled point becomes a resolved run config exactly as a grid point does, so its folder is
`trials/<label>-<hash>` either way and `harness status/report` read it unchanged. The Optuna
trial keeps that id in `user_attrs["trial_id"]`; the trial folder's `optuna.json` points back
to the study, so the training process reports each evaluation and obeys the pruner.
"""

from __future__ import annotations

import math
import warnings
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)
from optuna.exceptions import ExperimentalWarning
from optuna.storages import (
    BaseStorage,
    RDBStorage,
    RetryHeartbeatStaleTrialCallback,
)
from optuna.storages.journal import JournalFileBackend, JournalStorage
from optuna.trial import FrozenTrial, TrialState

from harness.config import SweepConfig
from harness.config.space import check_distributions
from harness.errors import UserError
from harness.sweep.plan import Trial, make_trial, method_entry
from harness.sweep.status import FAILED, FINISHED, trial_status
from harness.trials import read_json

LINK = "optuna.json"
DONE = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)


def storage_target(sweep: SweepConfig, out: Path) -> str:
    return sweep.storage or str(out / "optuna.journal")


def open_storage(target: str, heartbeat_s: int | None = None) -> BaseStorage:
    """A database URL goes to RDBStorage, with heartbeats for the workers when asked (a trial
    silent for 3 beats is failed and queued again); anything else is a journal file."""
    if "://" in target:
        if heartbeat_s is None:
            return RDBStorage(target)
        warnings.filterwarnings("ignore", category=ExperimentalWarning)  # heartbeat API
        return RDBStorage(
            target,
            heartbeat_interval=heartbeat_s,
            grace_period=3 * heartbeat_s,
            failed_trial_callback=RetryHeartbeatStaleTrialCallback(max_retry=3),
        )
    Path(target).parent.mkdir(parents=True, exist_ok=True)
    return JournalStorage(JournalFileBackend(target))


def make_pruner(name: str) -> optuna.pruners.BasePruner:
    if name == "median":
        return optuna.pruners.MedianPruner()
    if name == "hyperband":
        return optuna.pruners.HyperbandPruner()
    return optuna.pruners.NopPruner()


def make_sampler(sweep: SweepConfig, worker: str = "") -> optuna.samplers.BaseSampler:
    """Seeded by the sweep's first seed; each further worker draws its own stream, since
    workers with equal seeds would propose the same points."""
    seed = sweep.seeds[0] if not worker else zlib.crc32(f"{sweep.seeds[0]}/{worker}".encode())
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


def open_study(
    sweep: SweepConfig, label: str, storage: BaseStorage, worker: str = ""
) -> optuna.Study:
    return optuna.create_study(
        storage=storage,
        study_name=f"{sweep.name}/{label}",
        sampler=make_sampler(sweep, worker),
        pruner=make_pruner(sweep.search.pruner),
        direction=sweep.search.direction,
        load_if_exists=True,
    )


def tell(study: optuna.Study, number: int, summary: dict[str, Any] | None, metric: str) -> None:
    """ok with a finite metric: COMPLETE; pruned: PRUNED; failed, nan, oom or no metric: FAIL."""
    summary = summary or {}
    value = summary.get(metric)
    if summary.get("status") == "pruned":
        study.tell(number, state=TrialState.PRUNED)
    elif summary.get("status") == "ok" and value is not None and math.isfinite(value):
        study.tell(number, value)
    else:
        study.tell(number, state=TrialState.FAIL)


def retry(study: optuna.Study, trial: FrozenTrial) -> None:
    """Queue the same point and seed again: it maps to the same folder and resumes there."""
    study.add_trial(
        optuna.trial.create_trial(
            state=TrialState.WAITING,
            params=trial.params,
            distributions=trial.distributions,
            user_attrs={**trial.user_attrs, "retry_of": trial.number},
        )
    )


def retry_of(trial: FrozenTrial) -> int | None:
    """The failed trial this one repeats, queued by us or by the heartbeat callback."""
    return trial.user_attrs.get("retry_of", trial.system_attrs.get("failed_trial"))


def counted(trials: list[FrozenTrial]) -> list[FrozenTrial]:
    """The trials that count against n_trials: a failure queued again counts once, as its
    retry."""
    again = {retry_of(t) for t in trials}
    return [t for t in trials if not (t.state == TrialState.FAIL and t.number in again)]


def recover(study: optuna.Study, out: Path, metric: str) -> None:
    """Trials a killed sweep left RUNNING (journal storage has no heartbeats) are told from
    their summary if the run finished, else failed and queued again: their folder keeps the
    checkpoint they resume from."""
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        trial_dir = out / "trials" / str(t.user_attrs.get("trial_id", "-"))
        status = trial_status(trial_dir)
        if status in ("running", "queued"):  # a live process still owns it
            continue
        summary = read_json(trial_dir / "summary.json") if status in FINISHED else None
        tell(study, t.number, summary, metric)
        if status not in FINISHED:
            retry(study, t)


def retry_failures(study: optuna.Study, out: Path) -> None:
    """`--retry-failed`: failed, oom and nan trials are queued again, each once."""
    for t in counted(study.get_trials(deepcopy=False)):
        status = trial_status(out / "trials" / str(t.user_attrs.get("trial_id", "")))
        if t.state == TrialState.FAIL and status in FAILED:
            retry(study, t)


def harness_trial(sweep: SweepConfig, label: str, ot: optuna.Trial) -> Trial:
    """Seeds cycle over Optuna trials (the seed is part of the trial, as in a grid); a retried
    trial keeps its seed."""
    seed = ot.user_attrs.get("seed", sweep.seeds[ot.number % len(sweep.seeds)])
    trial = make_trial(sweep, label, dict(ot.params), seed)
    ot.set_user_attr("trial_id", trial.id)
    ot.set_user_attr("seed", seed)
    return trial




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


def pruner_for(trial_dir: Path) -> Callable[[int, dict[str, float]], bool] | None:
    """Only a trial started by an Optuna sweep (its folder holds optuna.json) reports evals."""
    link = trial_dir / LINK
    if not link.exists():
        return None
    return lambda step, metrics: report(link, step, metrics)


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
