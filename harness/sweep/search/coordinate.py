"""Coordinate descent, as marin tunes every optimizer (arXiv 2509.02046 §3): start each method
from its defaults (the LR nearest the sweep's), vary one setting at a time to its neighbours on
its ladder, move to the best, and repeat until no neighbour of any setting improves or the
method's `tuning.trials` configurations are spent; a budget left over goes to the untried
configurations nearest the best. Each (method, budget) descends on its own; each configuration
runs once per seed and counts by its mean metric (a failed or non-finite seed: diverged).

The descent is a function of the finished trials' results alone (`descend`), so a sweep run
again recomputes the same proposals and re-runs nothing; the proposals of one step (a setting's
two neighbours, every seed) run in parallel on the sweep's workers.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from harness.config import SweepConfig
from harness.config.budget import Budget
from harness.config.objectives import objective_value
from harness.sweep.plan.expand import Trial, budgets, make_trial
from harness.sweep.run.trial_state import trial_states, trial_status
from harness.sweep.search.source import Pick, Search, Source, Work, runs_again
from harness.sweep.search.tuned import Ladder, check_tuning, ladders
from harness.trials import FAILED, FINISHED, RunsDir, Status, TrialDir

Point = tuple[int, ...]  # an index into each ladder
POLL_S = 2.0  # how often a waiting worker looks for results of trials run elsewhere


@dataclass
class Step:
    """Where the descent stands: the configurations to evaluate now (none: it is over), every
    one it has asked for so far in order (what counts against the budget), the best so far."""

    proposals: list[Point]
    used: list[Point]
    best: Point | None = None


def neighbours(x: Point, axis: int, sizes: list[int]) -> list[Point]:
    """`x` one rung down and one up on `axis`, where the ladder has them."""
    out = []
    for d in (-1, 1):
        i = x[axis] + d
        if 0 <= i < sizes[axis]:
            out.append((*x[:axis], i, *x[axis + 1:]))
    return out


def descend(sizes: list[int], start: Point, value: Callable[[Point], float | None],
            budget: int) -> Step:
    """The next configurations to evaluate, from the results known so far (`value`: lower is
    better, inf diverged, None not known yet). Axis 0 is the LR: where the budget is about to
    run out, the best's LR neighbours (0.5x and 2x on a factor-2 ladder) are asked first."""
    used = [start]
    if value(start) is None:
        return Step([start], used)
    x, axis, stale, n = start, 0, 0, len(sizes)

    def ask(points: list[Point]) -> list[Point]:
        new = [p for p in points if p not in used][:budget - len(used)]
        used.extend(new)
        return [p for p in points if p in used and value(p) is None]

    def better(points: list[Point]) -> Point:
        best = x
        for p in points:
            if p in used and value(p) < value(best):  # type: ignore[operator]
                best = p
        return best

    while stale < n and len(used) < budget:
        lr_missing = [p for p in neighbours(x, 0, sizes) if p not in used]
        if lr_missing and budget - len(used) <= len(lr_missing):
            if pending := ask(lr_missing):
                return Step(pending, used, x)
            x = better(lr_missing)
            break
        around = neighbours(x, axis, sizes)
        if pending := ask(around):
            return Step(pending, used, x)
        moved = better(around)
        if moved != x:
            x, stale = moved, 0
        else:
            stale, axis = stale + 1, (axis + 1) % n
    if stale >= n and len(used) < budget:  # converged early: the rest of the budget nearby
        rest = sorted((p for p in itertools.product(*map(range, sizes)) if p not in used),
                      key=lambda p: (sum(abs(a - b) for a, b in zip(p, x, strict=True)), p))
        if pending := ask(rest[:budget - len(used)]):
            return Step(pending, used, x)
    return Step([], used, min(used, key=lambda p: value(p)))  # type: ignore[arg-type, return-value]


@dataclass
class Group:
    """One method at one budget: its ladders and each configuration's trials, one a seed."""

    sweep: SweepConfig
    label: str
    budget: Budget | None
    steps: list[Ladder]
    out: Path
    retry: bool = False
    retried: set[str] = field(default_factory=set)  # ids run again under --retry-failed
    known: dict[Point, float] = field(default_factory=dict)
    made: dict[Point, list[Trial]] = field(default_factory=dict)

    def point(self, p: Point) -> dict[str, Any]:
        return {s.key: s.values[i] for s, i in zip(self.steps, p, strict=True)}

    def trials(self, p: Point) -> list[Trial]:
        if p not in self.made:
            self.made[p] = [make_trial(self.sweep, self.label, self.point(p), seed, self.budget)
                            for seed in self.sweep.seeds]
        return self.made[p]

    def dir(self, trial: Trial) -> TrialDir:
        return RunsDir(self.out).trial(trial.id)

    def waits(self, trial_id: str, status: str) -> bool:
        """Whether the trial still has to run (or is running) before its result counts."""
        again = self.retry and status in FAILED and trial_id not in self.retried
        return status not in FINISHED or again

    def value(self, p: Point) -> float | None:
        """The mean of the metric over seeds (minimized); inf when a seed failed or is not
        finite; None while a seed has no result."""
        if p in self.known:
            return self.known[p]
        trials = self.trials(p)
        states = trial_states([self.dir(t) for t in trials])
        if any(self.waits(t.id, s) for t, (s, _) in zip(trials, states, strict=True)):
            return None
        search = self.sweep.search
        sign = -1.0 if search.direction == "maximize" else 1.0
        values = [objective_value(dict(summary), search.metric) if status == Status.OK else None
                  for status, summary in states]
        ok = all(v is not None and math.isfinite(v) for v in values)
        self.known[p] = sign * sum(values) / len(values) if ok else math.inf  # type: ignore[arg-type]
        return self.known[p]

    def step(self) -> Step:
        tuning = self.sweep.tuning
        assert tuning is not None and tuning.trials is not None
        return descend([len(s.values) for s in self.steps], tuple(s.start for s in self.steps),
                       self.value, tuning.trials)


class Coordinator:
    """What the sweep's workers share: every group's descent, and the trials running now."""

    def __init__(self, groups: list[Group]) -> None:
        self.groups = groups
        self.flight: set[str] = set()
        self.cond = threading.Condition()

    def next(self) -> Pick | None:
        """A proposed trial not yet run nor running; waits while the only ones left run."""
        with self.cond:
            while True:
                pick, waiting = self._proposal()
                if pick is not None or not waiting:
                    return pick
                self.cond.wait(POLL_S)

    def _proposal(self) -> tuple[Pick | None, bool]:
        """The first proposed trial free to run, and whether any proposal is still unfinished
        (running here, or held by a live process or job)."""
        waiting = False
        for group in self.groups:
            for p in group.step().proposals:
                for trial in group.trials(p):
                    folder = group.dir(trial)
                    if trial.id in self.flight:
                        waiting = True
                        continue
                    status = trial_status(folder)
                    if not group.waits(trial.id, status):
                        continue
                    waiting = True
                    if runs_again(status, group.retry):
                        self.flight.add(trial.id)
                        if status in FAILED:
                            group.retried.add(trial.id)
                        return Pick(trial.id, folder.path, group.label, config=trial.run), True
        return None, waiting

    def finish(self, pick: Pick) -> bool:
        with self.cond:
            self.flight.discard(pick.id)
            self.cond.notify_all()
        summary = TrialDir(pick.dir).read_summary()
        return summary is not None and summary.status in FINISHED


class CoordinateSource(Source):
    """One worker loop's view of the shared `Coordinator`."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator

    def next(self) -> Pick | None:
        return self.coordinator.next()

    def finish(self, pick: Pick) -> bool:
        """False (the worker stops) for a trial stopped unfinished: it resumes on the next run."""
        return self.coordinator.finish(pick)

    def resumed(self, pick: Pick | None) -> CoordinateSource:
        return CoordinateSource(self.coordinator)  # a stopped trial is still proposed


class CoordinateSearch(Search):
    """A sweep whose `tuning.procedure` is coordinate: a descent per method and budget."""

    def __init__(self, sweep: SweepConfig, out: Path) -> None:
        super().__init__(sweep, out)
        check_tuning(sweep)
        self.retry = False

    @cached_property
    def groups(self) -> list[Group]:
        return [Group(self.sweep, label, budget, ladders(self.sweep, label), self.out, self.retry)
                for label in self.sweep.methods for budget in budgets(self.sweep)]

    @property
    def per_group(self) -> int:
        tuning = self.sweep.tuning
        assert tuning is not None and tuning.trials is not None
        return tuning.trials * len(self.sweep.seeds)

    def describe(self) -> str:
        tuning = self.sweep.tuning
        assert tuning is not None
        lines = [f"tuning: coordinate descent (arXiv 2509.02046 §3), {tuning.trials} "
                 f"configurations per method and budget, each run with seeds {self.sweep.seeds}; "
                 f"metric {self.sweep.search.direction} {self.sweep.search.metric}"]
        for label in self.sweep.methods:
            lines.append(f"{label}:")
            for s in ladders(self.sweep, label):
                lines.append(f"  {s.key}: {s.values} (starts at {s.values[s.start]!r})")
        n = len(self.groups) * self.per_group
        lines.append(f"budget: {len(self.sweep.methods)} methods x {len(budgets(self.sweep))} "
                     f"budgets x {tuning.trials} configurations x {len(self.sweep.seeds)} seeds "
                     f"= {n} trials")
        return "\n".join(lines)

    def finished_count(self, group: Group) -> int:
        dirs = [group.dir(t) for p in group.step().used for t in group.trials(p)]
        return sum(s in FINISHED for s, _ in trial_states(dirs))

    def retrying(self, retry_failed: bool) -> None:
        """`--retry-failed`: each failed trial of the descents runs once more before it counts."""
        self.retry = retry_failed
        for group in self.groups:
            group.retry = retry_failed

    def left(self, retry_failed: bool) -> list[Trial]:
        """A method's starting trial once for each trial its descent has left to run."""
        self.retrying(retry_failed)
        out = []
        for group in self.groups:
            base = group.trials(tuple(s.start for s in group.steps))[0]
            out += [base] * (self.per_group - self.finished_count(group))
        return out

    def start(self, retry_failed: bool) -> Work:
        left = len(self.left(retry_failed))
        total = len(self.groups) * self.per_group
        print(f"{self.sweep.name}: tuning by coordinate descent, {total} trials "
              f"({len(self.groups)} method-budget pairs x {self.per_group}), "
              f"{total - left} already finished, {left} to run in {self.out}", flush=True)
        return Work(self.again([]).sources, left)

    def again(self, dirs: list[TrialDir]) -> Work:
        coordinator = Coordinator(self.groups)
        return Work([CoordinateSource(coordinator) for _ in range(self.sweep.launcher.jobs)])

    def trial_dirs(self) -> list[TrialDir]:
        """The trials the descents have asked for so far."""
        return [g.dir(t) for g in self.groups for p in g.step().used for t in g.trials(p)]

    def failed(self) -> bool:
        return any(s in FAILED for s, _ in trial_states(self.trial_dirs()))

