"""The grid: every point of the sweep's spaces x seeds, expanded once per run of the sweep,
handed out as a fixed list to any number of worker loops; each trial records its own end (or
its launcher records a crash)."""

from __future__ import annotations

import sys
import threading
from collections import deque
from functools import cached_property
from pathlib import Path
from typing import Any

from harness.sweep.launchers import cluster_of
from harness.sweep.plan.expand import Trial, expand
from harness.sweep.plan.forecast import plan_text
from harness.sweep.run.trial_state import trial_states, trial_statuses
from harness.sweep.search.source import (
    HELD,
    Assigned,
    Pick,
    Search,
    Source,
    Work,
    finished,
    runs_again,
    unreadable_line,
)
from harness.trials import FAILED, RunsDir, Status, TrialDir


class GridSource(Source):
    """A fixed list of trials whose configs are written, handed out one at a time."""

    def __init__(self, trials: Assigned) -> None:
        self.trials = [(trial_id, Path(trial_dir)) for trial_id, trial_dir in trials]
        self.left = deque(self.trials)
        self.lock = threading.Lock()

    @classmethod
    def unfinished(cls, trials: list[Trial], dirs: list[TrialDir],
                   retry_failed: bool) -> tuple[GridSource, int, int]:
        """The trials to run (not finished; with `retry_failed` the failed ones too; not held
        by a live job or process; `dirs`: their folders), their configs written; how many are
        held; how many ended failed and are left so (without `retry_failed`). Each trial whose
        summary cannot be read is named on stderr (`unreadable_line`)."""
        todo, live, failed = [], 0, 0
        for t, trial, (status, summary) in zip(trials, dirs, trial_states(dirs), strict=True):
            live += status in HELD
            if status == Status.UNREADABLE:
                print(unreadable_line(trial, summary.error or "", retry_failed), file=sys.stderr,
                      flush=True)
            if not runs_again(status, retry_failed):
                failed += status in FAILED
                continue
            trial.write_config(t.run)
            todo.append((t.id, trial.path))
        return cls(todo), live, failed

    @property
    def assigned(self) -> Assigned:
        return self.trials

    def __len__(self) -> int:
        return len(self.left)

    def next(self) -> Pick | None:
        with self.lock:
            if not self.left:
                return None
            trial_id, trial_dir = self.left.popleft()
        return Pick(trial_id, trial_dir)

    def finish(self, pick: Pick) -> bool:
        return True  # a failed grid trial is recorded; the next one still runs

    def resumed(self, pick: Pick | None) -> GridSource:
        """`pick` first unless its folder records an end (running it again would redo a
        failed trial)."""
        with self.lock:
            left = list(self.left)
        return GridSource(([(pick.id, pick.dir)] if pick and not finished(pick.dir) else [])
                          + left)

    def spent(self) -> bool:
        return not self.left

    def split(self) -> list[GridSource]:
        """One source per trial: a job each (a launcher may batch them), or a thread slot
        each."""
        return [GridSource([trial]) for trial in self.left]

    def __getstate__(self) -> dict[str, Any]:
        return {"trials": list(self.left)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["trials"])


class GridSearch(Search):
    """A grid sweep: its trials expanded once, their folders read for what is left."""

    @cached_property
    def trials(self) -> list[Trial]:
        return expand(self.sweep)

    @cached_property
    def dirs(self) -> list[TrialDir]:
        return [RunsDir(self.out).trial(t.id) for t in self.trials]

    def describe(self) -> str:
        return plan_text(self.sweep, self.trials, self.out)

    def left(self, retry_failed: bool) -> list[Trial]:
        """`runs_again`, as `start` picks them."""
        return [t for t, s in zip(self.trials, trial_statuses(self.dirs), strict=True)
                if runs_again(s, retry_failed)]

    def start(self, retry_failed: bool) -> Work:
        """Trials whose job is still queued or running are left to it (a sweep run again
        collects)."""
        source, live, ended_failed = GridSource.unfinished(self.trials, self.dirs, retry_failed)
        n = len(self.dirs)
        title = cluster_of(self.sweep.launcher.kind).title
        held = f"{live} still {f'in {title}' if title else 'running'}, " if live else ""
        retry = (f"; {ended_failed} of them failed (run them again with --retry-failed)"
                 if ended_failed else "")
        print(f"{self.sweep.name}: {n} trials, {n - len(source) - live} already finished, "
              f"{held}{len(source)} to run in {self.out}{retry}", flush=True)
        return Work(source.split(), len(source))

    def again(self, dirs: list[TrialDir]) -> Work:
        return Work(GridSource([(d.name, d.path) for d in dirs]).split(), len(dirs))

    def trial_dirs(self) -> list[TrialDir]:
        return self.dirs

    def failed(self) -> bool:
        """Any trial that ended failed, oom, nan or killed."""
        return any(status in FAILED for status in trial_statuses(self.dirs))
