"""The one loop every sweep runs: next trial, write its files, run it, record its end.

A grid and an Optuna search differ only in their `Source`; the launchers only in the
`run_trial` the loop calls: a child process in one of the sweep's thread slots, or one in a
job of the launcher's cluster (harness/sweep/launchers/).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from harness.sweep.search.source import Pick, Source
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
