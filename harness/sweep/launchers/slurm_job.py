"""Inside a Slurm launcher's job: the checkpointable submitit job working its source, and
what it gives each trial process (torch's rank variables from submitit's environment)."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

from harness.sweep.launchers.base import Ranks, allocated_cpus
from harness.sweep.launchers.slurm_cluster import SlurmCluster
from harness.sweep.run.follow import Board
from harness.sweep.run.process import ChildProcess, trial_env
from harness.sweep.run.worker import Worker
from harness.sweep.search.grid import GridSource
from harness.sweep.search.source import Source, finished
from harness.trials import TrialDir

REQUEUE = SlurmCluster.requeue_signal


def job_env() -> dict[str, str]:
    """A trial process's environment in this job: a multi-task job is one DDP trial, each
    task one rank; its threads are the job's CPUs per task, or fewer where the job was given
    an OMP_NUM_THREADS below that."""
    import submitit  # only inside a job: the CLI does not pay for it

    job = submitit.JobEnvironment()
    threads = allocated_cpus(job.num_tasks // job.num_nodes)
    asked = os.environ.get("OMP_NUM_THREADS", "")
    env = trial_env(min(threads, int(asked)) if asked.isdigit() and int(asked) else threads)
    if job.num_tasks > 1:
        env.update(Ranks(job.global_rank, job.num_tasks, job.local_rank, job.hostnames[0],
                         Ranks.port(job.job_id), job.num_tasks // job.num_nodes).env())
    return env


def job_board() -> Board | None:
    """The board of the job this runs in; None for a job of one task."""
    import submitit

    job = submitit.JobEnvironment()
    if job.num_tasks == 1:
        return None
    return Board(job.job_id, job.hostnames[0], job.global_rank, job.num_tasks)


class TrialJob:
    """A submitit job working its source (one grid trial, or an Optuna worker's study) with
    each trial in a child process. On USR2 (preemption, time limit) the child saves its
    checkpoint, the requeue is counted in the trial's summary, and submitit resubmits the job
    to resume that trial first. Any number of signals at any moment make one requeue: while
    one is handled, or once the job's work is done, later ones change nothing (submitit's own
    handler, run twice, fails on its half-written pickle and loses the trial)."""

    def __init__(self, source: Source | os.PathLike) -> None:
        """`source` may be a trial folder, its config written: a job for that one trial."""
        if isinstance(source, os.PathLike):
            source = GridSource([(Path(source).name, Path(source))])
        self.source = source
        self.child = ChildProcess(job_env, REQUEUE)
        self.worker: Worker | None = None
        self.requeue: Any = None  # submitit's USR2 handler: checkpoint, dump, requeue, exit
        self.stopping = False  # a signal is being handled
        self.ended = False  # the work is done: the job ends as it would have
        self.board: Board | None = None  # rank 0 of a multi-task Optuna worker posts here

    def __call__(self) -> int:
        self.worker = Worker(self.source, self.run_trial)
        self.requeue = signal.getsignal(REQUEUE)
        signal.signal(REQUEUE, self.on_signal)
        try:
            board = None if self.source.assigned else job_board()
            if board is None:  # a grid job: every task knows its trial
                return self.worker.run()
            if not board.leads:
                return self.follow(board)
            self.board = board
            try:
                return self.worker.run()
            finally:
                board.post(None)
                board.close()
        finally:
            self.ended = True

    def follow(self, board: Board) -> int:
        """Another rank of an Optuna worker's job: run each trial rank 0 runs, as its rank."""
        code = 0
        while (trial_dir := board.take()) is not None:
            code = self.child.run(trial_dir)
        return code

    def on_signal(self, signum: int, frame: Any) -> None:
        """The first signal stops the running trial with a checkpoint, then has submitit
        requeue the job, unless nothing is left to run (the trial had just finished)."""
        if self.stopping or self.ended:
            why = "a requeue is under way" if self.stopping else "the job's work is done"
            print(f"signal {signal.Signals(signum).name} ignored: {why}", flush=True)
            return
        self.stopping = True
        self.child.stop()
        current = self.worker.current if self.worker else None
        last = self.source.spent()
        if last and (current is None or finished(current.dir)):
            print("the trial had finished: no requeue, the job ends", flush=True)
            return
        if callable(self.requeue):
            self.requeue(signum, frame)

    def run_trial(self, trial_id: str, trial_dir: Path) -> int:
        """A trial the source asked for in the job (not one submitted as this job) records
        its launch here."""
        if (trial_id, trial_dir) not in self.source.assigned:
            TrialDir(trial_dir).record_launch("worker")
        if self.board is not None:
            self.board.post(trial_dir)
        return self.child.run(trial_dir)

    def checkpoint(self) -> Any:
        """Called by submitit as it requeues the job: the trial has stopped with its
        checkpoint; its requeue counts unless it had ended anyway."""
        from submitit.helpers import DelayedSubmission  # only inside a job

        self.child.stop()
        current = self.worker.current if self.worker else None
        if current is not None and not finished(current.dir):
            TrialDir(current.dir).count_requeue()
        return DelayedSubmission(TrialJob(self.source.resumed(current)))

    def __getstate__(self) -> dict[str, Any]:
        return {"source": self.source}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["source"])
