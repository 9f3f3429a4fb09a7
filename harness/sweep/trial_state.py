"""What state a trial is in: its folder's summary, its process, and its Slurm job.

Slurm is asked once per call, for the jobs of all the trials asked about: `harness status`
on a sweep of hundreds of trials is one `squeue`, not hundreds.
"""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

from harness.trials import Status, Summary, TrialDir

# A live Slurm job says more than these (its trial writes a new summary over an unreadable
# one); it is `queued` while Slurm lists it in these states.
UNSETTLED = (Status.PENDING, Status.RUNNING, Status.INTERRUPTED, Status.UNREADABLE)
WAITING = ("PENDING", "REQUEUED", "REQUEUE_HOLD")


def trial_status(trial_dir: Path | TrialDir) -> str:
    return trial_statuses([trial_dir])[0]


def trial_statuses(trial_dirs: list[Path | TrialDir]) -> list[str]:
    """Each trial's status. A `running` summary whose process is gone is an interrupted
    trial; a trial whose Slurm job is still queued or running is that, whatever its folder
    says; a summary.json that cannot be read is `unreadable`, never `pending`."""
    return [status for status, _ in trial_states(trial_dirs)]


def trial_states(trial_dirs: list[Path | TrialDir]) -> list[tuple[str, Summary]]:
    """Each trial's status (as `trial_statuses`) and the summary it was read from: an
    `unreadable` one's `error` names the file and why."""
    trials = [TrialDir(d) for d in trial_dirs]
    summaries = [t.read_summary() or Summary() for t in trials]
    jobs = [slurm_job(t) if s.status in UNSETTLED else None
            for t, s in zip(trials, summaries, strict=True)]
    states = slurm_states([j for j in jobs if j])
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


def slurm_job(trial: TrialDir) -> str | None:
    """The Slurm job a trial was submitted in (`<array>_<task>` in an array), if any."""
    launch = trial.read_launch()
    if launch.get("launcher") != "slurm" or not launch.get("job_id"):
        return None
    return str(launch["job_id"])


def slurm_states(job_ids: list[str]) -> dict[str, str]:
    """`queued` or `running` for each of the jobs Slurm still holds, from one `squeue`
    (`-r`: an array's pending tasks one per line, not folded into `<array>_[2-5]`)."""
    ids = sorted(set(job_ids))
    if not ids:
        return {}
    try:
        out = subprocess.run(
            ["squeue", "-h", "-r", "-j", ",".join(ids), "-o", "%i %T"],
            capture_output=True, text=True, timeout=30,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    wanted, states = set(ids), {}
    for line in out.splitlines():
        job_id, _, state = line.strip().partition(" ")
        if job_id in wanted and state:
            states[job_id] = Status.QUEUED if state.strip() in WAITING else Status.RUNNING
    return states
