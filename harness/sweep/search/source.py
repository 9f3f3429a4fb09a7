"""The search's interface: where a sweep's trials come from, a grid's fixed list or an Optuna
study, behind two small classes the run part asks without knowing which it is.

A `Search` is made once per run of a sweep from its config (search.py `open_search`): the
dry-run's view, the trials a run will start (the disk check's), the worker sources to launch,
those again for the trials left interrupted, and the outcome. A `Source` is one worker loop's
view: it hands out a `Pick` (a trial folder, what to write there first, whether it still has
to run), records its end (`finish`: Optuna is told), and after a requeue gives a source that
resumes the trial the job was running. The grid's are in grid.py, Optuna's in study_source.py.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from harness.config import RunConfig, SweepConfig
from harness.sweep.plan.expand import Trial
from harness.trials import FAILED, FINISHED, Status, TrialDir

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


class Source(ABC):
    """What a `Worker` asks; each method is called from the worker's own thread."""

    @property
    def assigned(self) -> Assigned:
        """The trials fixed when the source was made (a grid's): a job running it records
        their launch at submission, so that `harness status` sees them queued."""
        return []

    @abstractmethod
    def next(self) -> Pick | None:
        """The next trial to run or record; None when the source has none left."""

    def running(self, pick: Pick) -> AbstractContextManager[None]:
        """Held while the trial runs (Optuna beats its heartbeat)."""
        return nullcontext()

    @abstractmethod
    def finish(self, pick: Pick) -> bool:
        """Record the trial's end; False stops the worker (a trial left unfinished)."""

    @abstractmethod
    def resumed(self, pick: Pick | None) -> Source:
        """The source a requeued job works on: `pick` (its trial when stopped) first."""

    def spent(self) -> bool:
        """Whether it has handed out every trial it will: a job stopped once its last one
        has ended is not requeued. A study may always ask another."""
        return False


class Work(NamedTuple):
    """What a launcher is given: the sources, one worker loop each, and the count of trials
    fixed in them (a grid's: its progress bar), None where they are asked as they run."""

    sources: list[Source]
    total: int | None = None


class Search(ABC):
    """A sweep's way of choosing its trials, made once per run of the sweep from its config."""

    def __init__(self, sweep: SweepConfig, out: Path) -> None:
        self.sweep, self.out = sweep, Path(out)

    @property
    def shared(self) -> bool:
        """Whether several sweep processes may work one runs folder at once (so a run takes
        no lock on it)."""
        return False

    @abstractmethod
    def describe(self) -> str:
        """The dry-run's view of the plan, offline."""

    @abstractmethod
    def left(self, retry_failed: bool) -> list[Trial]:
        """The trials a run will start, as the disk check counts them."""

    @abstractmethod
    def start(self, retry_failed: bool) -> Work:
        """Get the trials ready (say how many are left) and the sources that run them."""

    @abstractmethod
    def again(self, dirs: list[TrialDir]) -> Work:
        """The sources that run the trials left interrupted with a checkpoint (`dirs`)."""

    @abstractmethod
    def trial_dirs(self) -> list[TrialDir]:
        """The sweep's trials: a grid's planned ones; a search's, those it has asked for."""

    @abstractmethod
    def failed(self) -> bool:
        """Whether some trial that counts ended failed (pruned is fine)."""


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
