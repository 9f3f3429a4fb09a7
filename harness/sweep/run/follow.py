"""A multi-process trial in an Optuna worker's job: rank 0 asks, the other ranks follow.

A grid job's trial is fixed when the job is submitted, so each of its tasks knows what to run.
An Optuna worker asks for its trials inside the job, and only one task may ask: each ask makes
a new trial. So rank 0 works the study and posts each trial folder it runs on a small
key-value store it serves for the job's life (torch's TCPStore); the other ranks run what it
posts, as their rank of the same trial, until it posts the end. A requeued job serves a fresh
store, so nothing a previous attempt posted is read again.
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

from harness.sweep.launchers.base import job_port

POLL_S = 0.2  # a follower polls, so that a signal (a preemption) is handled while it waits
FAREWELL_S = 60  # rank 0 waits this long for the followers to read the end before it leaves


class Board:
    """Rank 0 posts trial folders, in order, then the end; each other rank takes them. Every
    rank of the job makes one, with the job's id, rank 0's host, its rank and the job's
    ranks (its launcher reads them)."""

    def __init__(self, job_id: str, host: str, rank: int, world: int) -> None:
        from torch.distributed import TCPStore  # only in a multi-task job

        self.leads = rank == 0
        port = job_port(f"{job_id}/board")  # not the trial's port
        # A follower waits for rank 0's next trial as long as that trial trains: no timeout.
        self.store = TCPStore(host, port, world, is_master=rank == 0,
                              timeout=timedelta(days=30), wait_for_workers=False)
        self.world, self.posted = world, 0

    def post(self, trial_dir: Path | None) -> None:
        """Rank 0: the next trial folder, or None for the end."""
        self.store.set(f"pick/{self.posted}", "" if trial_dir is None else str(trial_dir))
        self.posted += 1

    def take(self) -> Path | None:
        """Another rank: the next trial folder rank 0 runs, or None at the end."""
        key = f"pick/{self.posted}"
        try:
            while not self.store.check([key]):
                time.sleep(POLL_S)
        except RuntimeError:  # rank 0 is gone (killed): its store with it
            return None
        value = self.store.get(key).decode()
        self.posted += 1
        if not value:
            self.store.add("left", 1)
        return Path(value) if value else None

    def close(self) -> None:
        """Rank 0, after posting the end: the store lives until every follower has read it."""
        deadline = time.time() + FAREWELL_S
        while self.store.add("left", 0) < self.world - 1 and time.time() < deadline:
            time.sleep(POLL_S)
