"""Where a worker loop gets its trials: a grid's fixed list, or an Optuna study (search.py).

A sweep has one way to run trials, the `Worker` loop; a source is all that differs between a
grid and a search. It hands out a `Pick` (a trial folder, what to write there first, whether
it still has to run), records its end (`finish`: Optuna is told), and after a requeue gives a
source that resumes the trial the job was running.
"""

from __future__ import annotations

import sys
import threading
from collections import deque
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from harness.config import RunConfig, SweepConfig
from harness.sweep.expand import expand
from harness.sweep.trial_state import trial_states
from harness.trials import FAILED, FINISHED, RunsDir, Status, TrialDir

Assigned = list[tuple[str, Path]]


def finished(trial_dir: Path) -> bool:
    """Whether the trial's folder records an end (ok, failed, ...): nothing left to resume."""
    summary = TrialDir(trial_dir).read_summary()
    return summary is not None and summary.status in FINISHED


@dataclass
class Pick:
    """One trial handed to a worker loop."""

    id: str
    dir: Path
    label: str = ""
    number: int | None = None  # its Optuna trial
    config: RunConfig | None = None  # written before it runs; None: the folder has it
    link: dict[str, Any] | None = None  # the study it reports to (optuna.json)
    run: bool = True  # False: its folder already holds a result, only `finish` it


class Source(Protocol):
    """What a `Worker` asks; each method is called from the worker's own thread."""

    @property
    def assigned(self) -> Assigned:
        """The trials fixed when the source was made (a grid's): a job running it records
        their launch at submission, so that `harness status` sees them queued."""
        ...

    def next(self) -> Pick | None:
        """The next trial to run or record; None when the source has none left."""
        ...

    def running(self, pick: Pick) -> AbstractContextManager[None]:
        """Held while the trial runs (Optuna beats its heartbeat)."""
        ...

    def finish(self, pick: Pick) -> bool:
        """Record the trial's end; False stops the worker (a trial left unfinished)."""
        ...

    def resumed(self, pick: Pick | None) -> Source:
        """The source a requeued job works on: `pick` (its trial when stopped) first."""
        ...


HELD = (Status.QUEUED, Status.RUNNING)  # by a live job or process


def runs_again(status: str, retry_failed: bool) -> bool:
    """Whether a run of the sweep starts a trial in `status`: not finished (with
    `retry_failed`, failed ones too) and not held by a live job or process."""
    settled = set(FINISHED) - (set(FAILED) if retry_failed else set())
    return status not in settled and status not in HELD


def unreadable_line(trial: TrialDir, error: str, retry_failed: bool) -> str:
    """What a sweep does with a trial whose summary.json cannot be read: it may hold a result,
    so the trial counts as failed and is not trained over unless `--retry-failed` asks."""
    if retry_failed:
        return (f"unreadable: {trial.name} ({error}): running it again (--retry-failed), from "
                f"its newest checkpoint if it has one; the file goes to "
                f"{trial.corrupt_summary.name}")
    return (f"unreadable: {trial.name} ({error}): counted as failed and not run again; fix the "
            "file, or pass --retry-failed to train the trial again")


class GridSource:
    """A fixed list of trials whose configs are written, handed out one at a time to any
    number of worker loops; each trial records its own end (or its launcher records a crash)."""

    def __init__(self, trials: Assigned) -> None:
        self.trials = [(trial_id, Path(trial_dir)) for trial_id, trial_dir in trials]
        self.left = deque(self.trials)
        self.lock = threading.Lock()

    @classmethod
    def unfinished(cls, sweep: SweepConfig, out: Path,
                   retry_failed: bool) -> tuple[GridSource, list[TrialDir], int, int]:
        """The grid's trials to run (not finished; with `retry_failed` the failed ones too; not
        held by a live job or process), their configs written; every trial's folder, for the
        retries; how many are held; how many ended failed and are left so (without
        `retry_failed`). Each trial whose summary cannot be read is named on stderr
        (`unreadable_line`)."""
        trials = expand(sweep)
        todo, live, failed = [], 0, 0
        dirs = [RunsDir(out).trial(t.id) for t in trials]
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
        return cls(todo), dirs, live, failed

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

    def running(self, pick: Pick) -> AbstractContextManager[None]:
        return nullcontext()

    def finish(self, pick: Pick) -> bool:
        return True  # a failed grid trial is recorded; the next one still runs

    def resumed(self, pick: Pick | None) -> GridSource:
        """`pick` first unless its folder records an end (running it again would redo a
        failed trial)."""
        with self.lock:
            left = list(self.left)
        return GridSource(([(pick.id, pick.dir)] if pick and not finished(pick.dir) else [])
                          + left)

    def split(self) -> list[GridSource]:
        """One source per trial: a job each (on Slurm one array), or a thread slot each."""
        return [GridSource([trial]) for trial in self.left]

    def __getstate__(self) -> dict[str, Any]:
        return {"trials": list(self.left)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["trials"])
