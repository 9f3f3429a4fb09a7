"""Optuna workers: ask a trial, run it, tell its result, until the study's budget is spent.

Local workers are threads of the sweep, each running trials as child processes; on Slurm each
worker is an array task (`WorkerJob`) that runs its trials inside its own allocation. Workers
share a study through its storage; with a database they send heartbeats, so that the trial
of a dead worker is failed and queued again for another.
"""

from __future__ import annotations

import math
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import optuna
from optuna.storages import BaseStorage, RDBStorage, fail_stale_trials
from optuna.trial import FrozenTrial, TrialState

from harness.config import SweepConfig
from harness.sweep.launchers import ChildProcess, count_requeue, record_launch
from harness.sweep.status import FAILED, FINISHED, trial_status
from harness.sweep.study import (
    LINK,
    counted,
    harness_trial,
    method_space,
    open_storage,
    open_study,
    retry_of,
    storage_target,
    tell,
)
from harness.trials import read_json, write_json, write_yaml


@contextmanager
def heartbeat(storage: BaseStorage, trial_id: int) -> Iterator[None]:
    """Beat while the trial runs, so that a dead worker's trial is seen stale and retried."""
    interval = storage.get_heartbeat_interval() if isinstance(storage, RDBStorage) else None
    if not interval:
        yield
        return
    stop = threading.Event()

    def beat() -> None:
        while True:
            storage.record_heartbeat(trial_id)
            if stop.wait(interval):
                return

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


RunTrial = Callable[[str, Path], object]


class Worker:
    """Ask a trial, run it, tell its result, until the method's budget is spent. Any number of
    workers (threads here, Slurm array tasks there) share a study: each asked trial is a new
    number, so none is run twice; a stale one (its worker died) is failed and queued again."""

    def __init__(self, sweep: SweepConfig, out: Path, run_trial: RunTrial, index: int) -> None:
        self.sweep, self.out, self.run_trial = sweep, out, run_trial
        self.target = storage_target(sweep, out)
        self.storage = open_storage(self.target, sweep.search.heartbeat_s)
        # A database study may have workers in other sweep processes too: tell them apart.
        shared = isinstance(self.storage, RDBStorage)
        self.name = f"{socket.gethostname()}/{os.getpid()}/{index}" if shared else str(index or "")
        self.current: tuple[str, int, Path] | None = None

    def run(
        self, labels: list[str], lock: threading.Lock, resume: tuple[str, int] | None = None
    ) -> None:
        for label in labels:
            if not self.study(label, lock, resume if resume and resume[0] == label else None):
                return

    def study(self, label: str, lock: threading.Lock, resume: tuple[str, int] | None) -> bool:
        """Work on one method's study until its budget is spent; False if stopped early."""
        s = self.sweep.search
        study = open_study(self.sweep, label, self.storage, self.name)
        space = method_space(self.sweep, label)
        if resume is not None and not self.finish(
            study, label, optuna.Trial(study, self._trial_id(study, resume[1]))
        ):
            return False
        deadline = time.time() + s.timeout_min * 60 if s.timeout_min else math.inf
        while time.time() < deadline:
            with lock:
                fail_stale_trials(study)
                trials = study.get_trials(deepcopy=False)
                waiting = any(t.state == TrialState.WAITING for t in trials)
                if not waiting and len(counted(trials)) >= s.n_trials:
                    if not self._others_running(trials):
                        return True
                    ot = None
                else:
                    ot = study.ask(space)
            if ot is None:  # another worker's trial may still go stale: wait for it
                time.sleep(self.sweep.search.heartbeat_s)
                continue
            if not self.finish(study, label, ot):
                return False
        return True

    def _others_running(self, trials: list[FrozenTrial]) -> bool:
        running = any(t.state == TrialState.RUNNING for t in trials)
        return running and isinstance(self.storage, RDBStorage)

    def _trial_id(self, study: optuna.Study, number: int) -> int:
        study_id = self.storage.get_study_id_from_name(study.study_name)
        return self.storage.get_trial_id_from_study_id_trial_number(study_id, number)

    def finish(self, study: optuna.Study, label: str, ot: optuna.Trial) -> bool:
        """Run the asked trial unless its folder already holds a result, then tell it. A trial
        that stopped unfinished (Ctrl-C) stays RUNNING and this worker stops: the next sweep
        (or, with a database, the heartbeat check) queues it again and it resumes."""
        s = self.sweep.search
        frozen = self.storage.get_trial(ot._trial_id)
        if frozen.state != TrialState.RUNNING:
            return True  # resumed after a requeue, but the study has moved on
        trial = harness_trial(self.sweep, label, ot)
        trial_dir = self.out / "trials" / trial.id
        again = retry_of(frozen) is not None
        status = trial_status(trial_dir)
        while status == "running" and not again:  # the same point, asked by another worker
            time.sleep(2)
            status = trial_status(trial_dir)
        if status not in FINISHED or (again and status in FAILED):
            write_yaml(trial_dir / "config.yaml", trial.run.model_dump(by_alias=True))
            link = {"storage": self.target, "study": study.study_name, "trial": ot.number}
            write_json(trial_dir / LINK, {**link, "metric": s.metric, "pruner": s.pruner})
            self.current = (label, ot.number, trial_dir)
            with heartbeat(self.storage, ot._trial_id):
                self.run_trial(trial.id, trial_dir)
            self.current = None
        summary = read_json(trial_dir / "summary.json")
        if (summary or {}).get("status") not in FINISHED:
            return False
        tell(study, ot.number, summary, s.metric)
        return True


class WorkerJob:
    """A Slurm (or submitit-local) job running one Worker; requeued, it finishes its trial."""

    def __init__(
        self, sweep: SweepConfig, out: Path, index: int, resume: tuple[str, int] | None = None
    ) -> None:
        self.sweep, self.out, self.index, self.resume = sweep, Path(out), index, resume
        self.child: Any = None
        self.worker: Worker | None = None

    def __call__(self) -> None:
        self.child = ChildProcess()

        def run_trial(trial_id: str, trial_dir: Path) -> None:
            record_launch(trial_dir, "worker")
            self.child.run(trial_dir)

        self.worker = Worker(self.sweep, self.out, run_trial, self.index)
        self.worker.run(list(self.sweep.methods), threading.Lock(), self.resume)

    def checkpoint(self) -> Any:
        from submitit.helpers import DelayedSubmission


        self.child.stop()
        current = self.worker.current if self.worker else None
        if current is None:
            return DelayedSubmission(WorkerJob(self.sweep, self.out, self.index, self.resume))
        label, number, trial_dir = current
        count_requeue(trial_dir)
        return DelayedSubmission(WorkerJob(self.sweep, self.out, self.index, (label, number)))

    def __getstate__(self) -> dict[str, Any]:
        return {"sweep": self.sweep, "out": self.out, "index": self.index, "resume": self.resume}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)
