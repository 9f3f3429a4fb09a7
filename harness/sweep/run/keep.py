"""Which finished trials keep their final model once a sweep's run ends (`keep_models`).

`best` (the default): per method label, model and token budget, the trial best by the sweep's
metric (`search.metric`, or the first of `search.objectives`, in its direction) keeps its
model, and every other trial of that group that ended `ok` has its model dropped; `none`: every
`ok` trial's model is dropped; `all`: nothing is. Only `ok` trials hold a final model, and only
theirs is ever dropped: a trial still running, queued, interrupted or failed (resumable, or
retried with `--retry-failed`) is never touched. It is decided again at the end of every run of
the sweep, so a trial that finishes better later keeps its model and the previous best's goes.

A dropped trial keeps everything but its model: its summary records why
(`final_model_dropped`, and the trial kept in its place), written before the files go, so a
kill between the two is finished by the next run.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from harness.config import SweepConfig
from harness.config.objectives import Objective
from harness.sweep.run.trial_state import trial_states
from harness.trials import Status, Summary, TrialDir, final_model

NOT_BEST = "not best"
NONE_KEPT = "keep_models: none"

Group = tuple[str, str, int | None]  # method label, model, token budget


@dataclass(frozen=True)
class Finished:
    """A trial that ended `ok`, as the decision sees it."""

    trial: TrialDir
    summary: Summary
    group: Group


@dataclass(frozen=True)
class Drop:
    """A trial whose final model goes, and the mark its summary gets."""

    trial: TrialDir
    why: str
    best: str | None = None  # the trial of its group that keeps its model


def budget_of(config: dict[str, Any]) -> int | None:
    """The token budget a trial's config belongs to: the sweep's `budget:` entry it records
    (`train.budget.tokens`), else the tokens it plans, steps × sequences per step × sequence
    length (GLUE: at most that); None where the config does not say."""
    train, task = config.get("train") or {}, config.get("task") or {}
    mark = train.get("budget")
    if isinstance(mark, dict) and isinstance(mark.get("tokens"), int):
        return mark["tokens"]
    steps, seq_len = train.get("steps"), task.get("seq_len")
    per_step = train.get("total_batch_size") or train.get("batch_size")
    if not all(isinstance(v, int) for v in (steps, seq_len, per_step)):
        return None
    return steps * per_step * seq_len


def group_of(trial: TrialDir, summary: Summary) -> Group:
    """(method label, model, token budget) of a trial, from its config (its summary where the
    config is not there)."""
    config = trial.read_config()
    label = config.get("label") or summary.get("method") or trial.name.rsplit("-", 1)[0]
    return key_of(str(label), {"model": summary.get("model"), **config})


def key_of(label: str, config: dict[str, Any]) -> Group:
    """The group of a trial of method `label` whose resolved config is `config`."""
    model = config.get("model")
    return (label, model if isinstance(model, str) else json.dumps(model, sort_keys=True),
            budget_of(config))


def finished(trials: Iterable[TrialDir]) -> list[Finished]:
    """The trials whose status is `ok` (a live job says more than a folder), in order."""
    dirs = list(trials)
    return [Finished(t, s, group_of(t, s))
            for t, (status, s) in zip(dirs, trial_states(dirs), strict=True)
            if status == Status.OK]


def decide(trials: list[Finished], keep: str, goal: Objective) -> list[Drop]:
    """The trials whose final model goes under `keep` (all, best, none), `goal` ranking them.
    A group none of whose trials has the metric keeps every model: nothing ranks them."""
    if keep == "all":
        return []
    if keep == "none":
        return [Drop(f.trial, NONE_KEPT) for f in trials]
    groups: dict[Group, list[Finished]] = {}
    for f in trials:
        groups.setdefault(f.group, []).append(f)
    drops = []
    for members in groups.values():
        best = best_of(members, goal)
        if best is not None:
            drops += [Drop(f.trial, NOT_BEST, best.trial.name) for f in members if f is not best]
    return drops


def best_of(members: list[Finished], goal: Objective) -> Finished | None:
    """The member best by `goal` (the first of equals, in trial order); None when none has a
    value for its metric."""
    ranked = [(value, i) for i, f in enumerate(members)
              if (value := _value(f.summary, goal.metric)) is not None]
    if not ranked:
        return None
    sign = 1 if goal.direction == "minimize" else -1
    return members[min(ranked, key=lambda vi: (sign * vi[0], vi[1]))[1]]


def _value(summary: Summary, metric: str) -> float | None:
    value = summary.get(metric)
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        return None
    return float(value)


def drop(decision: Drop) -> int:
    """The trial's summary marked, then its final model removed; the bytes freed (0 where it
    was gone already). The summary is read again here: it is never written over stale."""
    trial = decision.trial
    summary = trial.read_summary()
    if summary is None or summary.status != Status.OK:
        return 0
    mark = {"final_model_dropped": decision.why}
    if decision.best is not None:
        mark["final_model_kept_by"] = decision.best
    if any(summary.get(k) != v for k, v in mark.items()):
        trial.write_summary(summary.update(**mark))
    return final_model.drop(trial.final_model)


def keep_models(sweep: SweepConfig, trials: Iterable[TrialDir]) -> str | None:
    """`sweep.keep_models` applied to its trials at the end of a run; the line saying what
    was dropped (None: nothing was)."""
    drops = [d for d in decide(finished(trials), sweep.keep_models, sweep.search.goals[0])
             if final_model.present(d.trial.final_model)]
    if not drops:
        return None
    freed = sum(drop(d) for d in drops)
    why = ("none" if sweep.keep_models == "none" else
           "best: each method's best trial per model and budget keeps its model")
    return (f"keep_models: {why}; dropped the final models of {len(drops)} trials "
            f"({freed / 1e6:.1f} MB); `keep_models: all` keeps every one")
