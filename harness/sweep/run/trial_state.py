"""What state a trial is in: its folder's summary, its process, and its launcher's job.

Each launcher's cluster is asked once per call, for the jobs of all the trials asked about:
`harness status` on a sweep of hundreds of trials is one query, not hundreds.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from harness.sweep.launchers import job_states
from harness.trials import Status, Summary, TrialDir

# A live job says more than these (its trial writes a new summary over an unreadable one).
UNSETTLED = (Status.PENDING, Status.RUNNING, Status.INTERRUPTED, Status.UNREADABLE)


def trial_status(trial_dir: Path | TrialDir) -> str:
    return trial_statuses([trial_dir])[0]


def trial_statuses(trial_dirs: list[Path | TrialDir]) -> list[str]:
    """Each trial's status. A `running` summary whose process is gone is an interrupted
    trial; a trial whose job is still queued or running is that, whatever its folder
    says; a summary.json that cannot be read is `unreadable`, never `pending`."""
    return [status for status, _ in trial_states(trial_dirs)]


def trial_states(trial_dirs: list[Path | TrialDir]) -> list[tuple[str, Summary]]:
    """Each trial's status (as `trial_statuses`) and the summary it was read from: an
    `unreadable` one's `error` names the file and why."""
    trials = [TrialDir(d) for d in trial_dirs]
    summaries = [t.read_summary() or Summary() for t in trials]
    jobs = [launched_job(t) if s.status in UNSETTLED else None
            for t, s in zip(trials, summaries, strict=True)]
    states = job_states([j for j in jobs if j])
    return [(str(_status(s, states.get(j) if j else None)), s)  # plain strings, as summaries
            for s, j in zip(summaries, jobs, strict=True)]


def _status(summary: Summary, job_state: str | None) -> str:
    if job_state is not None:
        return Status.RUNNING if summary.status == Status.RUNNING else job_state
    if summary.status == Status.RUNNING and not _alive(summary):
        return Status.INTERRUPTED
    return summary.status


def _alive(summary: Summary) -> bool:
    """Only a process on this host can be checked; one elsewhere is taken to be running."""
    if summary.get("host", socket.gethostname()) != socket.gethostname():
        return True
    pid = summary.get("pid")
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def launched_job(trial: TrialDir) -> tuple[str, str] | None:
    """The (launcher kind, job id) a trial was submitted in, if it was submitted as a job."""
    launch = trial.read_launch()
    if not launch.get("launcher") or not launch.get("job_id"):
        return None
    return str(launch["launcher"]), str(launch["job_id"])
