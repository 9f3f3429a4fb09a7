"""The one loop every sweep runs: next trial, write its files, run it, record its end.

A grid and an Optuna search differ only in their `Source`; the launchers only in the
`run_trial` the loop calls: a child process in one of the sweep's thread slots, or one in a
submitit job (`TrialJob`), locally or on Slurm.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.sweep.process import ChildProcess
from harness.sweep.source import GridSource, Pick, Source
from harness.trials import TrialDir

RunTrial = Callable[[str, Path], int]


def write_files(pick: Pick) -> None:
    """What the trial reads as it starts: its config, and the study it reports to."""
    trial = TrialDir(pick.dir)
    if pick.config is not None:
        trial.write_config(pick.config)
    if pick.link is not None:
        trial.write_optuna_link(pick.link)


class Worker:
    """Work a source until it has no trial left or one ends unfinished (Ctrl-C, requeue);
    `current` is the trial whose process runs now, which a requeued job resumes."""

    def __init__(self, source: Source, run_trial: RunTrial) -> None:
        self.source, self.run_trial = source, run_trial
        self.current: Pick | None = None

    def run(self) -> int:
        """The exit code of the last trial process (0 if none ran)."""
        code = 0
        while (pick := self.source.next()) is not None:
            if pick.run:
                write_files(pick)
                self.current = pick
                with self.source.running(pick):
                    code = self.run_trial(pick.id, pick.dir)
                self.current = None
            if not self.source.finish(pick):
                break
        return code


class TrialJob:
    """A submitit job working its source (one grid trial, or an Optuna worker's study) with
    each trial in a child process. On USR2 (preemption, time limit) submitit calls
    `checkpoint`: the child saves its checkpoint, the requeue is counted in the trial's
    summary, and the job is resubmitted to resume that trial first."""

    def __init__(self, source: Source | os.PathLike) -> None:
        """`source` may be a trial folder, its config written: a job for that one trial."""
        if isinstance(source, os.PathLike):
            source = GridSource([(Path(source).name, Path(source))])
        self.source = source
        self.child = ChildProcess()
        self.worker: Worker | None = None

    def __call__(self) -> int:
        self.worker = Worker(self.source, self.run_trial)
        return self.worker.run()

    def run_trial(self, trial_id: str, trial_dir: Path) -> int:
        """A trial the source asked for in the job (not one submitted as this job) records
        its launch here."""
        if (trial_id, trial_dir) not in self.source.assigned:
            TrialDir(trial_dir).record_launch("worker")
        return self.child.run(trial_dir)

    def checkpoint(self) -> Any:
        """Called by submitit on USR2, before it requeues the job."""
        from submitit.helpers import DelayedSubmission  # only inside a job

        self.child.stop()
        current = self.worker.current if self.worker else None
        if current is not None:
            TrialDir(current.dir).count_requeue()
        return DelayedSubmission(TrialJob(self.source.resumed(current)))

    def __getstate__(self) -> dict[str, Any]:
        return {"source": self.source}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["source"])
