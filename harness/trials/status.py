"""How a trial stands: the values of a summary's `status`, and the groups the sweep acts on."""

from __future__ import annotations

from enum import Enum


class Status(str, Enum):
    """A `str` enum: a member equals, hashes and prints as its value, so summary.json files,
    pandas columns and comparisons with plain strings see no difference."""

    PENDING = "pending"  # no summary yet
    RUNNING = "running"  # its process is training (or died without a word: see trial_status)
    INTERRUPTED = "interrupted"  # stopped with a checkpoint; running it again resumes
    QUEUED = "queued"  # its job waits for a slot
    OK = "ok"
    FAILED = "failed"
    OOM = "oom"
    NAN = "nan"  # a non-finite loss
    KILLED = "killed"  # its process was killed (SIGKILL: the kernel's OOM killer, an admin)
    PRUNED = "pruned"  # stopped early by the Optuna study
    UNREADABLE = "unreadable"  # its summary.json is there but cannot be read: never written

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return self.value.__format__(spec)


# A trial that will not run again unless asked; of those, the ones `--retry-failed` re-runs.
# An unreadable record may hide a result, so it is not trained over unless asked either.
FINISHED = (Status.OK, Status.NAN, Status.OOM, Status.KILLED, Status.FAILED, Status.PRUNED,
            Status.UNREADABLE)
FAILED = (Status.FAILED, Status.OOM, Status.NAN, Status.KILLED, Status.UNREADABLE)
