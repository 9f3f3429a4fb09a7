"""Optuna-driven search: one study per method, each Optuna trial an ordinary harness trial.

A sampled point becomes a resolved run config exactly as a grid point does, so its folder is
`trials/<label>-<hash>` either way and `harness status/report` read it unchanged. The Optuna
trial keeps that id in `user_attrs["trial_id"]`; the trial folder's `optuna.json` points back
to the study, so the training process reports each evaluation and obeys the pruner
(harness/sweep/search/prune.py). Storage and pruners are made here alone.
"""

from __future__ import annotations

import inspect
import math
import random
import time
import warnings
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
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
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError, ProgrammingError

from harness.config import SweepConfig
from harness.config.objectives import Constraint, objective_value
from harness.config.space import check_distributions
from harness.config.sweep import SearchConfig
from harness.errors import UserError
from harness.sweep.plan.expand import Trial, make_trial, method_entry
from harness.sweep.run.trial_state import trial_statuses
from harness.trials import FAILED, FINISHED, RunsDir, Status, Summary
from harness.trials.events import verbose

DONE = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
RACE_TRIES = 5


def storage_target(storage: str | None, out: Path) -> str:
    """The sweep's `storage:`, or by default the journal file in its runs folder."""
    return storage or str(RunsDir(out).journal)


def open_storage(target: str, heartbeat_s: int | None = None) -> BaseStorage:
    """A database URL goes to RDBStorage, with heartbeats for the workers when asked (a trial
    silent for 3 beats is failed and queued again); anything else is a journal file."""
    for _ in range(RACE_TRIES - 1):
        try:
            return _open_storage(target, heartbeat_s)
        except (IntegrityError, ProgrammingError):
            # Sweeps started at once on a fresh database race to create its tables; the
            # losers try again and find them made.
            time.sleep(0.5 + random.random())
    return _open_storage(target, heartbeat_s)


def plain_storage(target: str) -> BaseStorage:
    """A database URL is an RDBStorage; anything else a journal file."""
    if "://" in target:
        return RDBStorage(target)
    Path(target).parent.mkdir(parents=True, exist_ok=True)
    return JournalStorage(JournalFileBackend(target))


def _open_storage(target: str, heartbeat_s: int | None) -> BaseStorage:
    if "://" not in target or heartbeat_s is None:
        return plain_storage(target)
    warnings.filterwarnings("ignore", category=ExperimentalWarning)  # heartbeat API
    # We beat ourselves (search.heartbeat), without Study.optimize, which Optuna warns about.
    warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used")
    # Optuna 4.9 renamed the callback's argument (the old name warns, and goes in 6.0).
    new = "heartbeat_stale_trial_callback" in inspect.signature(RDBStorage).parameters
    callback = {("heartbeat_stale_trial_callback" if new else "failed_trial_callback"):
                RetryHeartbeatStaleTrialCallback(max_retry=3)}
    return RDBStorage(
        target, heartbeat_interval=heartbeat_s, grace_period=3 * heartbeat_s, **callback
    )


@contextmanager
def study_lock(storage: BaseStorage, study_name: str) -> Iterator[None]:
    """Held by a worker while it checks the budget and asks, so that workers in several
    processes never ask past `n_trials` or pop one queued trial twice. On PostgreSQL a session
    advisory lock, which the server drops with the connection of a worker that dies holding
    it; elsewhere nothing (a journal file or SQLite is one machine's: run one sweep process
    with `--jobs N` there, whose workers share a thread lock)."""
    engine = storage.engine if isinstance(storage, RDBStorage) else None
    if engine is None or engine.dialect.name != "postgresql":
        yield
        return
    key = {"key": zlib.crc32(study_name.encode())}
    with engine.connect() as conn:
        conn.execute(text("SELECT pg_advisory_lock(:key)"), key)
        try:
            yield
        finally:
            conn.execute(text("SELECT pg_advisory_unlock(:key)"), key)


def make_pruner(name: str) -> optuna.pruners.BasePruner:
    if name == "median":
        return optuna.pruners.MedianPruner()
    if name == "hyperband":
        return optuna.pruners.HyperbandPruner()
    return optuna.pruners.NopPruner()


def make_sampler(kind: str, seed: int, worker: str = "") -> optuna.samplers.BaseSampler:
    """Seeded by the sweep's first seed; each further worker draws its own stream, since
    workers with equal seeds would propose the same points."""
    seed = seed if not worker else zlib.crc32(f"{seed}/{worker}".encode())
    if kind == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if kind == "cmaes":
        return optuna.samplers.CmaEsSampler(seed=seed)
    if kind == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed)  # multi-objective TPE with several objectives


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
    fixed: list[dict[str, Any]], spaces: dict[str, dict[str, BaseDistribution]]
) -> dict[str, list[dict[str, Any]]]:
    """Each fixed point (`search.enqueue`), cut to the keys a method's space holds; every value
    must lie in it."""
    points: dict[str, list[dict[str, Any]]] = {label: [] for label in spaces}
    for i, point in enumerate(fixed):
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


def quiet_optuna() -> None:
    """Optuna's notices about the studies we create ("A new study created", "Using an
    existing study") and the ExperimentalWarnings of the calls our code makes reach the
    terminal only under --verbose; Optuna's warnings and errors always do."""
    if verbose():
        optuna.logging.set_verbosity(optuna.logging.INFO)
        return
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    # `module` matches where a warning points: a call in the harness, not a user's own code
    warnings.filterwarnings("ignore", category=ExperimentalWarning, module=r"harness\.")


def open_study(
    sweep: SweepConfig, label: str, storage: BaseStorage, worker: str = ""
) -> optuna.Study:
    quiet_optuna()
    study = optuna.create_study(
        storage=storage,
        study_name=f"{sweep.name}/{label}",
        sampler=make_sampler(sweep.search.sampler, sweep.seeds[0], worker),
        pruner=make_pruner(sweep.search.pruner),
        directions=[goal.direction for goal in sweep.search.goals],
        load_if_exists=True,
    )
    name_metrics(study, [goal.metric for goal in sweep.search.goals])
    return study


def name_metrics(study: optuna.Study, metrics: list[str]) -> None:
    """The objectives' names on the study, so optuna-dashboard's axes read "eval_ppl", not
    "Objective 0"; written only where the study lacks them (one storage write per study)."""
    if study.metric_names != metrics:  # experimental: quiet_optuna keeps its warning quiet
        study.set_metric_names(metrics)


def tell(
    study: optuna.Study, number: int, summary: Summary | dict[str, Any] | None,
    search: SearchConfig,
) -> None:
    """ok with every objective finite: COMPLETE, with each constraint's margin recorded first
    (the sampler reads them); pruned: PRUNED; failed, nan, oom or a missing objective: FAIL. A
    trial already finished (failed as stale while its worker still ran it: a database outage,
    a stalled machine) is left alone: its retry records the result."""
    summary = dict(summary or {})
    values = [objective_value(summary, goal.metric) for goal in search.goals]
    if summary.get("status") == Status.PRUNED:
        study.tell(number, state=TrialState.PRUNED, skip_if_finished=True)
    elif summary.get("status") == Status.OK and all(
            v is not None and math.isfinite(v) for v in values):
        _constrain(study, number, summary, search.limits)
        study.tell(number, values if len(values) > 1 else values[0], skip_if_finished=True)
    else:
        study.tell(number, state=TrialState.FAIL, skip_if_finished=True)


def _constrain(study: optuna.Study, number: int, summary: dict[str, Any],
               limits: list[Constraint]) -> None:
    trial_id = study._storage.get_trial_id_from_study_id_trial_number(study._study_id, number)
    if not limits or study._storage.get_trial(trial_id).state != TrialState.RUNNING:
        return
    trial = optuna.trial.Trial(study, trial_id)
    for limit in limits:
        value = objective_value(summary, limit.metric)
        if value is not None and math.isfinite(value):
            trial.set_constraint(limit.key, limit.violation(value))


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
    """The failed trial this one repeats, queued by the heartbeat callback (the last of its
    history: a retry that went stale too is repeated in turn) or by us."""
    history = trial.system_attrs.get("retry_history")
    return history[-1] if history else trial.user_attrs.get("retry_of")


def counted(trials: list[FrozenTrial]) -> list[FrozenTrial]:
    """The trials that count against n_trials: a failure queued again counts once, as its
    retry."""
    again = {retry_of(t) for t in trials}
    return [t for t in trials if not (t.state == TrialState.FAIL and t.number in again)]


def recover(study: optuna.Study, out: Path, search: SearchConfig) -> None:
    """Trials a killed sweep left RUNNING (journal storage has no heartbeats) are told from
    their summary if the run finished, else failed and queued again: their folder keeps the
    checkpoint they resume from."""
    trials = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    dirs = [RunsDir(out).trial(t.user_attrs.get("trial_id", "-")) for t in trials]
    for t, trial, status in zip(trials, dirs, trial_statuses(dirs), strict=True):
        if status in (Status.RUNNING, Status.QUEUED):  # a live process still owns it
            continue
        summary = trial.read_summary() if status in FINISHED else None
        tell(study, t.number, summary, search)
        if status not in FINISHED:
            retry(study, t)


def retry_failures(study: optuna.Study, out: Path) -> None:
    """`--retry-failed`: failed, oom, nan and killed trials are queued again, each once."""
    trials = counted(study.get_trials(deepcopy=False))
    statuses = trial_statuses([RunsDir(out).trial(t.user_attrs.get("trial_id", ""))
                               for t in trials])
    for t, status in zip(trials, statuses, strict=True):
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
    enqueued(s.enqueue, spaces)
    goals = ", ".join(f"{g.direction} {g.metric}" for g in s.goals)
    lines = [f"sampler {s.sampler}, pruner {s.pruner}, {goals}"]
    lines += [f"constraint: {limit.key}" for limit in s.limits]
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
