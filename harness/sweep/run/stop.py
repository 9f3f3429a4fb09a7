"""Every signal that asks a sweep to stop does what Ctrl-C does.

Ctrl-C reaches a sweep as KeyboardInterrupt: its launcher asks each running trial to stop,
the trials save a checkpoint and end `interrupted`, and the command exits 130 naming the
command that resumes them. SIGTERM (`kill`, `timeout`), SIGHUP (a closed terminal) and SIGUSR2
(a scheduler's warning before a time limit) take the same path, as `Stopped`. The first signal stops
the sweep; one more within FORCE_AFTER_S changes nothing (`timeout` signals the sweep and
then its process group), a later one ends the sweep at once: its trials, left without a
parent, still stop with a checkpoint (harness/sweep/run/starter.py). A signal the sweep was
started with ignored (`nohup`) stays ignored. While trials run (`deferred`), a signal is
noted and acted on where the launcher polls (`raise_if_stopped`): raised at any bytecode it
could leave a lock of tqdm or of the thread pool held, and the sweep would hang instead of
stopping.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from harness.sweep.run.starter import STOP_SIGNALS

FORCE_AFTER_S = 2.0  # a stop signal this long after the first ends the sweep at once


class Stopped(KeyboardInterrupt):
    """A stop signal, raised where Ctrl-C raises KeyboardInterrupt; `name` says which."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


def signal_name(stop: KeyboardInterrupt) -> str:
    return stop.name if isinstance(stop, Stopped) else "SIGINT"


class _Handler:
    def __init__(self) -> None:
        self.name: str | None = None  # the first stop signal's
        self.first_at = 0.0
        self.raised = False
        self.deferred = 0  # inside `deferred` blocks: noted, raised by `raise_if_stopped`
        self.ttys = [fd for fd in (1, 2) if os.isatty(fd)]

    def __call__(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGHUP:
            self.leave_hung_up_terminal()
        name = signal.Signals(signum).name
        if self.name is None:
            self.name, self.first_at = name, time.monotonic()
            if not self.deferred:
                self.raise_if_stopped()
        elif time.monotonic() - self.first_at > FORCE_AFTER_S:
            try:
                os.write(2, f"\n{name} again: the sweep ends now; its running trials stop "
                         "with a checkpoint by themselves\n".encode())
            finally:
                os._exit(130)

    def raise_if_stopped(self) -> None:
        if self.name is not None and not self.raised:
            self.raised = True
            raise Stopped(self.name)

    def leave_hung_up_terminal(self) -> None:
        """A terminal that hung up fails every write (EIO): what the sweep still prints, as it
        stops, goes nowhere instead of ending it before its trials have saved."""
        for fd in self.ttys:
            if not os.isatty(fd):  # a hung-up terminal answers no terminal request
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, fd)
                os.close(devnull)


_handler: _Handler | None = None  # the running sweep's, inside `stop_on_signals`


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """While the sweep runs, the first stop signal raises `Stopped` (main thread only: Python
    runs signal handlers there, and only there may they be set)."""
    global _handler
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handler, outer = _Handler(), _handler
    saved = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS
             if signal.getsignal(sig) is not signal.SIG_IGN}
    _handler = handler
    try:
        yield
    finally:
        _handler = outer
        for sig, old in saved.items():
            signal.signal(sig, old)


@contextmanager
def deferred() -> Iterator[None]:
    """Inside, a stop signal is only noted; `raise_if_stopped` raises it, and so does the
    block's end if nothing did."""
    handler = _handler
    if handler is None:
        yield
        return
    handler.deferred += 1
    try:
        yield
    finally:
        handler.deferred -= 1
    handler.raise_if_stopped()


def raise_if_stopped() -> None:
    """`Stopped` if a stop signal came and has not been raised yet."""
    if _handler is not None:
        _handler.raise_if_stopped()
