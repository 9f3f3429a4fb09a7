"""The Optuna search: ask a method's study for a point, hand it out as a harness trial, tell
its result; method after method, until each study's budget is spent.

Any number of sources (one per worker loop: threads of the sweep, or a launcher's jobs, in any
number of sweep processes) share a study through its storage: each asked trial is a new
number, and the budget check and the ask are one step (`study_lock`), so none is run twice and
none past the budget. With a database every asked trial sends heartbeats from the moment it is
asked, so that the trial of a dead worker is failed and queued again for another, which never
starts it while a process on this machine still trains in its folder.
"""

from __future__ import annotations

import math
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from functools import cached_property
from pathlib import Path
from typing import Any

import optuna
from optuna.distributions import BaseDistribution
from optuna.storages import BaseStorage, RDBStorage, fail_stale_trials
from optuna.trial import FrozenTrial, TrialState
from sqlalchemy.exc import SQLAlchemyError

from harness.config import SweepConfig
from harness.sweep.plan.expand import Trial, expand
from harness.sweep.run.trial_state import trial_status
from harness.sweep.search.source import Pick, Search, Source, Work, runs_again
from harness.sweep.search.study import (
    DONE,
    counted,
    describe,
    enqueued,
    harness_trial,
    method_space,
    open_storage,
    open_study,
    recover,
    retry_failures,
    retry_of,
    storage_target,
    study_lock,
    tell,
)
from harness.trials import FAILED, FINISHED, RunsDir, Status, TrialDir


def beat_interval(storage: BaseStorage) -> int | None:
    """Seconds between heartbeats; None where there are none (a journal file, no database)."""
    return storage.get_heartbeat_interval() if isinstance(storage, RDBStorage) else None


def beat(storage: BaseStorage, trial_id: int) -> None:
    """One heartbeat. A database error is reported and survived: the next beat may get
    through, while a beating thread that died would get its live trial failed as stale."""
    try:
        storage.record_heartbeat(trial_id)
    except SQLAlchemyError as e:
        print(f"heartbeat of Optuna trial {trial_id} failed: {type(e).__name__}",
              file=sys.stderr, flush=True)


@contextmanager
def heartbeat(storage: BaseStorage, trial_id: int) -> Iterator[None]:
    """Beat while the trial runs, so that a dead worker's trial is seen stale and retried."""
    interval = beat_interval(storage)
    if not interval:
        yield
        return
    stop = threading.Event()

    def beating() -> None:
        while True:
            beat(storage, trial_id)
            if stop.wait(interval):
                return

    thread = threading.Thread(target=beating, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


class StudySource(Source):
    """One worker's view of the sweep's studies. `index` tells the workers apart (each samples
    its own stream); `lock` is shared by the sweep's local workers, so that the budget check
    and the ask are one step; `resume` (label, number) is the trial a requeued job finishes
    first."""

    def __init__(
        self,
        sweep: SweepConfig,
        out: Path,
        index: int,
        lock: threading.Lock | None = None,
        resume: tuple[str, int] | None = None,
    ) -> None:
        self.sweep, self.out, self.index, self.resume = sweep, Path(out), index, resume
        self.lock = lock or threading.Lock()
        self.target = storage_target(sweep.storage, self.out)
        self.storage = open_storage(self.target, sweep.search.heartbeat_s)
        # A database study may have workers in other sweep processes too: tell them apart.
        shared = isinstance(self.storage, RDBStorage)
        self.name = f"{socket.gethostname()}/{os.getpid()}/{index}" if shared else str(index or "")
        self.labels = list(sweep.methods)
        self.study: optuna.Study | None = None
        self.space: dict[str, BaseDistribution] = {}
        self.deadline: float | None = None

    def next(self) -> Pick | None:
        while self.labels:
            label = self.labels[0]
            if self.study is None:
                self.study = open_study(self.sweep, label, self.storage, self.name)
                self.space = method_space(self.sweep, label)
                self.deadline = None
                if self.resume is not None and self.resume[0] == label:
                    pick = self._pick(label, optuna.Trial(self.study, self._id(self.resume[1])))
                    if pick is not None:
                        return pick
            ot = self._ask()
            if ot is None:  # this method's budget is spent (or its time is up)
                self.labels.pop(0)
                self.study = None
                continue
            pick = self._pick(label, ot)
            if pick is not None:
                return pick
        return None

    def _ask(self) -> optuna.Trial | None:
        """A new (or queued) trial, or None once the budget is spent and no other worker's
        trial may still go stale and be queued again. Its first heartbeat is recorded at once:
        a worker that dies before its trial starts leaves it stale too, never RUNNING forever
        (which would keep every other worker waiting)."""
        s, study = self.sweep.search, self.study
        assert study is not None
        if self.deadline is None:
            self.deadline = time.time() + s.timeout_min * 60 if s.timeout_min else math.inf
        while time.time() < self.deadline:
            with self.lock, study_lock(self.storage, study.study_name):
                fail_stale_trials(study)
                trials = study.get_trials(deepcopy=False)
                waiting = any(t.state == TrialState.WAITING for t in trials)
                if waiting or len(counted(trials)) < s.n_trials:
                    ot = study.ask(self.space)
                    if beat_interval(self.storage):
                        beat(self.storage, ot._trial_id)
                    return ot
                if not self._others_running(trials):
                    return None
            time.sleep(s.heartbeat_s)
        return None

    def _others_running(self, trials: list[FrozenTrial]) -> bool:
        running = any(t.state == TrialState.RUNNING for t in trials)
        return running and isinstance(self.storage, RDBStorage)

    def _id(self, number: int) -> int:
        assert self.study is not None
        study_id = self.storage.get_study_id_from_name(self.study.study_name)
        return self.storage.get_trial_id_from_study_id_trial_number(study_id, number)

    def _pick(self, label: str, ot: optuna.Trial) -> Pick | None:
        """The asked trial as a harness trial, to run unless its folder already holds a
        result; None when it is no longer RUNNING (resumed after a requeue, but the study has
        moved on). It waits (beating) while another process trains in the folder: the same
        point asked by another worker, or, for a retry, the trial of a worker failed as stale
        that still runs on this machine (one elsewhere cannot be seen; its stale heartbeat
        says it is gone)."""
        s, study = self.sweep.search, self.study
        assert study is not None
        frozen = self.storage.get_trial(ot._trial_id)
        if frozen.state != TrialState.RUNNING:
            return None
        trial = harness_trial(self.sweep, label, ot)
        trial_dir = RunsDir(self.out).trial(trial.id).path
        again = retry_of(frozen) is not None
        status = trial_status(trial_dir)
        with heartbeat(self.storage, ot._trial_id):
            while status == Status.RUNNING and (not again or self._here(trial_dir)):
                time.sleep(2)
                status = trial_status(trial_dir)
        if status in FINISHED and not (again and status in FAILED):
            return Pick(trial.id, trial_dir, label, ot.number, run=False)
        link = {"storage": self.target, "study": study.study_name, "trial": ot.number,
                "metric": s.goals[0].metric if len(s.goals) == 1 else None, "pruner": s.pruner}
        return Pick(trial.id, trial_dir, label, ot.number, trial.run, link)

    @staticmethod
    def _here(trial_dir: Path) -> bool:
        """Whether the trial's process runs on this machine (so its pid is checked)."""
        summary = TrialDir(trial_dir).read_summary()
        return summary is not None and summary.get("host") == socket.gethostname()

    def running(self, pick: Pick) -> AbstractContextManager[None]:
        assert pick.number is not None
        return heartbeat(self.storage, self._id(pick.number))

    def finish(self, pick: Pick) -> bool:
        """Tell the study the trial's result. A trial that stopped unfinished (Ctrl-C) stays
        RUNNING and this worker stops: the next sweep (or, with a database, the heartbeat
        check) queues it again and it resumes."""
        assert self.study is not None and pick.number is not None
        summary = TrialDir(pick.dir).read_summary()
        if summary is None or summary.status not in FINISHED:
            return False
        tell(self.study, pick.number, summary, self.sweep.search)
        return True

    def resumed(self, pick: Pick | None) -> StudySource:
        resume = (pick.label, pick.number) if pick and pick.number is not None else self.resume
        return StudySource(self.sweep, self.out, self.index, resume=resume)

    def __getstate__(self) -> dict[str, Any]:
        return {"sweep": self.sweep, "out": self.out, "index": self.index, "resume": self.resume}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)


class StudySearch(Search):
    """An Optuna search: a study per method in the sweep's storage, `launcher.jobs` worker
    loops asking them until each study's budget is spent."""

    def __init__(self, sweep: SweepConfig, out: Path) -> None:
        super().__init__(sweep, out)
        self.target = storage_target(sweep.storage, self.out)
        self.lock = threading.Lock()  # local workers check the budget and ask as one step

    @property
    def shared(self) -> bool:
        """A study in a database: the documented way for several sweep processes to work one
        runs folder (the study hands each trial to one of them)."""
        return "://" in (self.sweep.storage or "")

    def describe(self) -> str:
        return describe(self.sweep)

    def left(self, retry_failed: bool) -> list[Trial]:
        """Each method's base point once for each trial left of its `n_trials` (its searched
        keys' sizes taken at their defaults)."""
        done: dict[str, int] = {}
        for summary in filter(None, (d.read_summary() for d in self.trial_dirs())):
            if not runs_again(str(summary.get("status")), retry_failed):
                done[str(summary.get("method"))] = done.get(str(summary.get("method")), 0) + 1
        n = self.sweep.search.n_trials or 0
        return [t for t in expand(self.sweep) for _ in range(max(0, n - done.get(t.label, 0)))]

    def start(self, retry_failed: bool) -> Work:
        self.open_studies(retry_failed)
        return self.workers()

    def workers(self) -> Work:
        return Work([StudySource(self.sweep, self.out, i, self.lock)
                     for i in range(self.sweep.launcher.jobs)])

    def again(self, dirs: list[TrialDir]) -> Work:
        """The workers started again, a journal's interrupted trials queued again first (a
        database's heartbeats find them)."""
        if not isinstance(self.storage, RDBStorage):
            for label in self.sweep.methods:
                recover(open_study(self.sweep, label, self.storage), self.out, self.sweep.search)
        return self.workers()

    def trial_dirs(self) -> list[TrialDir]:
        return RunsDir(self.out).trial_dirs()

    def failed(self) -> bool:
        """Whether some counted trial of some study failed (pruned is fine)."""
        return any(t.state == TrialState.FAIL for label in self.sweep.methods for t in
                   counted(open_study(self.sweep, label, self.storage).get_trials(deepcopy=False)))

    @cached_property
    def storage(self) -> BaseStorage:
        return open_storage(self.target, self.sweep.search.heartbeat_s)

    def open_studies(self, retry_failed: bool) -> None:
        """Each method's study, ready for the workers: a journal's trials left running by a
        dead sweep recovered (a database's heartbeats find them), failed ones queued again
        with `retry_failed`, the sweep's enqueued points added once."""
        sweep = self.sweep
        name_unreadable(self.out)
        spaces = {label: method_space(sweep, label) for label in sweep.methods}
        points = enqueued(sweep.search.enqueue, spaces)
        for label in sweep.methods:
            study = open_study(sweep, label, self.storage)
            if not isinstance(self.storage, RDBStorage):  # heartbeats find dead workers there
                recover(study, self.out, sweep.search)
            if retry_failed:
                retry_failures(study, self.out)
            for point in points[label]:
                study.enqueue_trial(point, skip_if_exists=True)
            done = sum(t.state in DONE for t in counted(study.get_trials(deepcopy=False)))
            print(f"{study.study_name}: {done} of {sweep.search.n_trials} trials finished",
                  flush=True)


def name_unreadable(out: Path) -> None:
    """Each trial folder whose summary.json cannot be read, named on stderr: its study still
    holds the trial's state and value (a finished one is not asked again), but status and the
    report cannot use the trial until the file is fixed."""
    for trial in RunsDir(out).trial_dirs():
        summary = trial.read_summary()
        if summary is not None and summary.status == Status.UNREADABLE:
            print(f"unreadable: {trial.name} ({summary.error}): its study keeps the trial's "
                  "state and value; status and the report show it unreadable until the file "
                  "is fixed",
                  file=sys.stderr, flush=True)
