"""What state a trial is in: its folder's summary, its process, and its Slurm job."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path
from typing import Any

from harness.sweep.launchers import LAUNCH
from harness.trials import read_json

FINISHED = ("ok", "nan", "oom", "failed", "pruned")
FAILED = ("failed", "oom", "nan")


def trial_status(trial_dir: Path) -> str:
    """A `running` summary whose process is gone is an interrupted trial; a trial whose Slurm
    job is still queued or running is that, whatever its folder says."""
    summary = read_json(trial_dir / "summary.json")
    status = (summary or {}).get("status", "pending")
    if status in ("pending", "running", "interrupted"):
        job = live_job(trial_dir)
        if job is not None:
            return "running" if status == "running" else job
    if status == "running" and not _alive(summary):
        return "interrupted"
    return status


def _alive(summary: dict[str, Any]) -> bool:
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


def slurm_state(job_id: str) -> str | None:
    """`queued` or `running` while Slurm still holds the job, else None."""
    try:
        out = subprocess.run(
            ["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=30
        ).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        return None
    if not out:
        return None
    return "queued" if out[0] in ("PENDING", "REQUEUED", "REQUEUE_HOLD") else "running"


def live_job(trial_dir: Path) -> str | None:
    """The state of the Slurm job a trial was submitted in, if it is still queued or running."""
    launch = read_json(trial_dir / LAUNCH) or {}
    if launch.get("launcher") != "slurm" or not launch.get("job_id"):
        return None
    return slurm_state(launch["job_id"])
