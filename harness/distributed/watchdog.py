"""A trial's ranks watch each other: a peer that stops answering ends the trial `interrupted`
within a bound (`train.peer_timeout_s`), instead of the others waiting in a collective for the
process group's timeout.

Each rank's daemon thread adds to its own counter in the process group's store every tenth of
the bound and reads the others'; a second thread judges. A peer whose counter has not moved
for the bound (its process stopped, its node frozen or cut off), or a store that has not
answered for that long or fails (the process hosting it is gone), is lost: `on_lost` records
it and the process exits EXIT_CODE at once, as an interrupted `harness train` does. It is told
whether rank 0 may be the one lost (rank 0 itself silent, or the store, which rank 0 or its
node's agent hosts), so that another rank can record the end rank 0 cannot. A gloo
collective cannot be woken from another thread, so leaving is the only way out; checkpoints
publish atomically, so the last one stays whole. The threads beat while the main thread works
alone (a checkpoint, an evaluation), so only a process that is gone or stopped is lost this
way; a live process stuck in a collective is left to the collective timeout.

A collective that fails because a peer's process is gone (gloo: connection closed or reset;
NCCL: DistBackendError) is `peer_lost`. A rank that fails by itself posts why first
(`post_failure`), so the others record that failure (`peer_failure`), not an interruption.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from typing import Any

import torch.distributed as dist

from harness.errors import first_line

EXIT_CODE = 130  # an interrupted `harness train`'s exit code (harness/cli_args.py)
BEATS = 10  # beats within one bound: a peer is lost after missing about this many
PREFIX = "harness/peers/"
FAILED_KEY = "failed"  # a rank that failed by itself: "<status> rank R: <error>"
DONE_KEY = "done"  # ranks that ended normally: the others stop judging
# What a collective says when a peer's process is gone (gloo's messages; NCCL raises
# DistBackendError or DistNetworkError for the same).
GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
        "Timed out waiting", "Socket Timeout")


def peer_lost(error: BaseException) -> bool:
    """`error` is what a collective raises when a peer's process is gone or stopped."""
    if isinstance(error, dist.DistBackendError | dist.DistNetworkError | dist.DistStoreError):
        return True
    return isinstance(error, RuntimeError) and any(m in str(error) for m in GONE)


class Watchdog:
    """The heartbeat of one rank of a trial of several; a no-op in one process. Used as a
    context manager around the trial: it starts beating once the process group exists, and
    `stop` (or leaving the block) ends it before the group is torn down."""

    def __init__(self, bound_s: float, on_lost: Callable[[str, bool], None]) -> None:
        """`on_lost(why, main_lost)`: record the end; `main_lost`, rank 0 may be gone."""
        self.bound, self.every = bound_s, bound_s / BEATS
        self.on_lost = on_lost
        self.store: Any = None
        self.rank, self.world = 0, 1
        self.seen: dict[int, tuple[int, float]] = {}  # peer -> (its counter, when it moved)
        self.answered = time.monotonic()  # the store's last answer
        self.done = False  # a peer ended normally
        self.lock = threading.Lock()
        self.stopped = threading.Event()

    def __enter__(self) -> Watchdog:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            threading.Thread(target=self._start, name="peer-watchdog", daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """No more judging; peers see this rank as done, not lost."""
        with self.lock:
            if self.stopped.is_set():
                return
            self.stopped.set()
        if self.store is not None:  # a store that is gone: the peers are ending too
            with suppress(RuntimeError, dist.DistError):
                self.store.add(DONE_KEY, 1)

    def _start(self) -> None:
        """Wait for the process group (the trial joins it while building), then beat and
        judge; nothing if the trial ends first."""
        while not (dist.is_available() and dist.is_initialized()):
            if self.stopped.wait(0.05):
                return
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.store = dist.PrefixStore(PREFIX, dist.distributed_c10d._get_default_store())
        now = time.monotonic()
        self.answered = now
        self.seen = {r: (0, now) for r in range(self.world) if r != self.rank}
        threading.Thread(target=self._beat, name="peer-heartbeat", daemon=True).start()
        self._judge()

    def _beat(self) -> None:
        """Add to this rank's counter, read the peers' (a blocked store call is judged by
        `_judge` from the time it has not answered)."""
        while not self.stopped.is_set():
            try:
                self.store.add(str(self.rank), 1)
                counts = {r: self.store.add(str(r), 0) for r in self.seen}
                self.done = self.store.add(DONE_KEY, 0) > 0
            except (RuntimeError, dist.DistError) as e:
                self._lose(f"the process group's store stopped answering ({first_line(e)})",
                           main_lost=True)
                return
            now = self.answered = time.monotonic()
            for r, count in counts.items():
                if count != self.seen[r][0]:
                    self.seen[r] = (count, now)
            self.stopped.wait(self.every)

    def _judge(self) -> None:
        while not self.stopped.wait(self.every):
            now = time.monotonic()
            if self.done:
                continue
            if now - self.answered > self.bound:
                self._lose(f"the process group's store has not answered for {self.bound:g} s",
                           main_lost=True)
                return
            stale = sorted(r for r, (_, moved) in self.seen.items() if now - moved > self.bound)
            if stale:
                self._lose(f"rank {stale[0]} has not answered for {self.bound:g} s "
                           "(stopped, frozen or cut off)", main_lost=stale[0] == 0)
                return

    def _lose(self, reason: str, main_lost: bool) -> None:
        """Record the loss and leave: once, and never after `stop`."""
        with self.lock:
            if self.stopped.is_set():
                return
            self.stopped.set()
            print(f"rank {self.rank}: {reason}; the trial ends interrupted (resumable)",
                  file=sys.stderr, flush=True)
            try:
                self.on_lost(reason, main_lost)
            finally:
                os._exit(EXIT_CODE)

    def post_failure(self, status: str, error: str) -> None:
        """Tell the peers this rank failed by itself (before it leaves the group), so they
        record that failure rather than a lost peer."""
        if self.store is None:
            return
        try:
            self.store.set(FAILED_KEY, f"{status} rank {self.rank}: {error}")
            self.store.check([FAILED_KEY])  # a round trip: the set has landed before we leave
        except (RuntimeError, dist.DistError):
            pass  # no store: the peers see a lost peer, which is all there is to say

    def peer_failure(self) -> tuple[str, str] | None:
        """(status, error) a peer that failed by itself posted, if one did."""
        if self.store is None:
            return None
        try:
            if self.store.check([FAILED_KEY]):
                status, _, error = self.store.get(FAILED_KEY).decode().partition(" ")
                return status, error
        except (RuntimeError, dist.DistError):
            pass  # the store's host is gone with the peer: lost, no failure posted
        return None
