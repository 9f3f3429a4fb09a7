"""One sweep process at a time in a runs folder.

Two sweeps on one `--out` would each run every unfinished trial: two processes in one trial's
folder, each measuring half the machine. So a sweep holds the folder's `sweep.lock` while it
runs (`hold`): created with O_EXCL (atomic on local file systems and NFS alike), recording who
took it (host, pid and that process's start time, its job if any, command, since when), touched
every BEAT_S while held and removed at the end. A second sweep is refused with one line naming
the holder. A crash cannot leave the folder locked: a lock is taken over when its holder is
gone, on the same host as soon as its pid is no longer that process, from another host (a
node sharing the file system) once the lock has gone untouched for STALE_S.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import psutil

from harness.errors import UserError
from harness.sweep.launchers import cluster_of, current_job
from harness.trials import RunsDir

BEAT_S = 30.0  # the holder touches its lock this often
STALE_S = 300.0  # a lock from another host untouched this long has lost its holder
WRITING_S = 5.0  # a lock with no readable record yet, younger than this, is being written


@dataclass(frozen=True)
class Holder:
    """The sweep process that holds a folder."""

    host: str
    pid: int
    process_start: float  # the process's start time: the same pid later is another process
    since: float
    job: str | None = None  # the scheduler's job this process runs in
    launcher: str | None = None  # that job's launcher kind
    command: str = ""

    @classmethod
    def me(cls) -> Holder:
        pid = os.getpid()
        argv = sys.argv[1:]
        kind, job = current_job() or (None, None)
        return cls(socket.gethostname(), pid, _process_start(pid) or 0.0, time.time(), job, kind,
                   "harness " + shlex.join(argv) if argv[:1] == ["sweep"] else "")

    @classmethod
    def parse(cls, text: str) -> Holder | None:
        """None for a record that is not one (half-written, damaged)."""
        try:
            data = json.loads(text)
            holder = cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})
        except (ValueError, TypeError):
            return None
        return holder if isinstance(holder.pid, int) and isinstance(holder.host, str) else None

    def gone(self, age_s: float) -> str | None:
        """Why the holder no longer runs, or None while it may."""
        if self.host == socket.gethostname():
            start = _process_start(self.pid)
            if start is None:
                return f"pid {self.pid} has ended"
            if abs(start - self.process_start) > 1.0:
                return f"pid {self.pid} is another process now"
            return None
        if age_s > STALE_S:
            return f"its lock was last touched {age_s:.0f} s ago (a live sweep touches it " \
                   f"every {BEAT_S:.0f} s)"
        return None

    def __str__(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.since))
        job = f", {cluster_of(self.launcher or '').title} job {self.job}" if self.job else ""
        command = f" ({self.command})" if self.command else ""
        return f"pid {self.pid} on {self.host}{job} since {when}{command}"


def _process_start(pid: int) -> float | None:
    """When process `pid` started; None if there is none (or only its zombie)."""
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return None
        return process.create_time()
    except psutil.NoSuchProcess:
        return None
    except psutil.AccessDenied:  # another user's live process: it runs
        return float("inf")


def _read(path: Path) -> tuple[str | None, float]:
    """The lock's text and seconds since it was last touched; None if there is no lock."""
    try:
        age = time.time() - path.stat().st_mtime
        return path.read_text(), age
    except FileNotFoundError:
        return None, 0.0


@contextmanager
def hold(out: Path) -> Iterator[None]:
    """The runs folder `out` is this sweep's until the block ends (UserError if another
    sweep holds it)."""
    path = RunsDir(out).lock
    text = _take(path)
    stop = threading.Event()
    beat = threading.Thread(target=_beat, args=(path, text, stop), daemon=True,
                            name="sweep-lock")
    beat.start()
    try:
        yield
    finally:
        stop.set()
        beat.join()
        if _read(path)[0] == text:
            path.unlink(missing_ok=True)


def _take(path: Path) -> str:
    """Create the lock (taking over a stale one); its text. UserError while it is held."""
    deadline = time.time() + WRITING_S + 5
    while time.time() < deadline:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            text, age = _read(path)
            if text is None:
                continue  # released meanwhile
            holder = Holder.parse(text)
            if holder is None and age < WRITING_S:
                time.sleep(0.2)
                continue
            why = holder.gone(age) if holder else "its record is unreadable"
            if why is None:
                raise UserError(refusal(path, holder, age)) from None
            print(f"{path.parent}: taking over from a sweep that is gone ({holder or 'unknown'}"
                  f": {why})", flush=True)
            _remove_if_unchanged(path, text)
            continue
        text = json.dumps(asdict(Holder.me()))
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        return text
    raise UserError(f"{path.parent}: other sweeps kept taking its lock ({path}); try again")


def _remove_if_unchanged(path: Path, text: str) -> None:
    """Remove a stale lock, unless another sweep replaced it meanwhile with its own: it is
    moved aside (atomic; only one sweep can), checked, and put back if it was a new one."""
    aside = path.with_name(f"{path.name}.{socket.gethostname()}.{os.getpid()}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return
    if _read(aside)[0] != text:
        with suppress(FileExistsError):  # a third sweep made its own: that one stands
            os.link(aside, path)
    aside.unlink(missing_ok=True)


def refusal(path: Path, holder: Holder, age_s: float) -> str:
    """One line: who holds the folder, and what to do."""
    here = holder.host == socket.gethostname()
    cancel = cluster_of(holder.launcher or "").stop_command(holder.job) if holder.job else ""
    stop = (f"`{cancel}`" if cancel
            else f"`kill {holder.pid}`" + ("" if here else f" on {holder.host}"))
    stale = "" if here else (
        f"; if that machine is down, the lock is taken over once untouched for {STALE_S:.0f} s "
        f"(last touched {age_s:.0f} s ago), or delete {path}")
    return (f"{path.parent} is in use by another sweep: {holder}. Wait for it, stop it "
            f"({stop}), or give this sweep another --out; sweep processes that share a "
            f"study through a database storage: take no lock (docs/sweeps.md){stale}")


def _beat(path: Path, text: str, stop: threading.Event) -> None:
    """Touch the lock every BEAT_S while it is still this sweep's."""
    while not stop.wait(BEAT_S):
        try:
            if _read(path)[0] != text:
                print(f"warning: {path} is no longer this sweep's (another sweep took it over "
                      "after it went untouched); this sweep goes on", file=sys.stderr, flush=True)
                return
            os.utime(path)
        except OSError:  # a file system hiccup: the next beat tries again
            continue
