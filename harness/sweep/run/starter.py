"""Trial processes forked from a warm process instead of started cold.

A trial process spends most of its start-up importing torch, transformers and datasets before
its first step, which a sweep of short trials pays once per trial (the quickstart's are 30
steps). `start_trial` has multiprocessing's fork server, started once per sweep process with
those imports done, fork each trial instead. The child is the same
`harness train` as `trial_command`, with its own pid, the caller's environment, working
directory, stdout and stderr, its threads set from OMP_NUM_THREADS, and an exit status as a
fresh interpreter's: the launcher cannot tell the two apart, but the second trial on starts in
a fraction of a second.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import importlib
import io
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
from multiprocessing import forkserver, reduction
from pathlib import Path
from typing import IO

import torch

from harness.sweep.run.process import trial_args

# What `harness train` imports before its first step (`python -X importtime`), by name, and what
# its first export builds (harness/train/warm.py): the fork server loads them once. Nothing it
# imports may run a parallel torch op: a child forked after OpenMP's thread pool has started
# hangs in its own first one (seen with a matmul).
PRELOAD = ["harness.sweep.run.fork_safe", "harness.cli", "harness.train.run",
           "harness.sweep.search.prune", "harness.methods.resolve", "harness.data.c4",
           "transformers.models.llama.modeling_llama", "datasets", "harness.train.warm"]

# The signals that ask a sweep to stop. The sweep decides for its trials: its fork server
# ignores them (a terminal's or `timeout`'s signal to the whole process group would end it,
# and every trial would then read as ended; it ignores SIGINT itself, and gives its children
# the handler it started with, which must be Python's, so that a Ctrl-C to a trial that is
# starting is never lost), and a trial ignores SIGHUP, its terminal being its sweep, which
# stops it with a checkpoint.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR2)
SERVER_SIGNALS = {signal.SIGINT: signal.SIG_DFL, signal.SIGTERM: signal.SIG_IGN,
                  signal.SIGHUP: signal.SIG_IGN, signal.SIGUSR2: signal.SIG_IGN}
PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process gets when its parent ends


class _Fd:
    """A file descriptor handed to the forked trial: multiprocessing sends a duplicate over the
    fork server's socket while it pickles the process, and the child gets its own number."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple:
        return _rebuild_fd, (reduction.DupFd(self.fd),)


def _rebuild_fd(dup: reduction.DupFd) -> _Fd:
    return _Fd(dup.detach())


class _Output(io.FileIO):
    """A trial's output: once its reader (the sweep) is gone, what the trial prints goes
    nowhere rather than failing it with BrokenPipeError in the middle of a step."""

    def write(self, data: bytes) -> int:  # type: ignore[override]
        try:
            return super().write(data)
        except BrokenPipeError:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self.fileno())
            os.close(devnull)
            return len(data)


def _text_stream(fd: int) -> IO[str]:
    """An unbuffered text stream on `fd`, as PYTHONUNBUFFERED gives a fresh interpreter."""
    return io.TextIOWrapper(_Output(fd, "w", closefd=False), line_buffering=True,
                            write_through=True)


def _trial_signals() -> None:
    """The stop signals as a fresh interpreter has them (the fork server ignores some), but
    SIGHUP ignored; and SIGINT, as Ctrl-C, when the fork server ends: it leaves with its sweep
    (even one killed with SIGKILL), and the trial then stops with a checkpoint."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGUSR2, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGINT)
    # The fork server hands each child the pipe that keeps it alive, for children of the
    # child's own; a trial has none, and holding it would keep the server past its sweep.
    server = forkserver._forkserver
    if getattr(server, "_forkserver_alive_fd", None) is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None


def _run_trial(argv: list[str], env: dict[str, str], out: _Fd, err: _Fd, module: str) -> None:
    """The forked child: stdio and environment as a fresh `harness ...` would have them."""
    # What the fork server imported lives as long as the trial: out of the collector's sight,
    # a full collection (the end of every trial has one) walks only the trial's own objects,
    # not the server's hundreds of thousands, and pages shared with the server stay so.
    gc.freeze()
    _trial_signals()
    os.dup2(out.fd, 1)
    os.dup2(err.fd, 2)
    os.close(out.fd)
    os.close(err.fd)
    sys.stdout, sys.stderr = _text_stream(1), _text_stream(2)
    os.environ.clear()
    os.environ.update(env)
    # torch sized its pool when the fork server imported it; a fresh process reads this then
    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    sys.argv = ["harness", *argv]
    entry = importlib.import_module(module)  # harness.cli by name, as `trial_command` runs it
    try:
        code = entry.main(argv)
    finally:
        atexit._run_exitfuncs()  # multiprocessing leaves by os._exit; an interpreter runs them
    sys.exit(code)


class ForkedTrial:
    """A forked `harness` process with the part of `subprocess.Popen` a launcher uses: `poll`,
    `wait`, `send_signal`, `kill` and, started by `start_trial`, its stdout as lines."""

    stdout: IO[str] | None = None

    def __init__(self, argv: list[str], env: dict[str, str], stdout: int, stderr: int,
                 module: str = "harness.cli") -> None:
        """`stdout`, `stderr`: the file descriptors the child writes to (it gets copies);
        `module`: whose `main(argv)` it runs (the tests fork their own measuring scripts so)."""
        self.process = _context().Process(
            target=_run_trial, args=(argv, env, _Fd(stdout), _Fd(stderr), module), name="harness")
        self.process.start()
        self.pid = self.process.pid

    def poll(self) -> int | None:
        return self.process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(["harness", "train"], timeout or 0)
        if self.stdout is not None:
            self.stdout.close()
        return self.process.exitcode

    def send_signal(self, sig: int) -> None:
        """As `subprocess.Popen.send_signal`: nothing to do for a process already gone, even
        when the fork server has reaped it and its exit status is not read yet."""
        if self.process.exitcode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _context() -> multiprocessing.context.ForkServerContext:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


def start_server() -> None:
    """Start the fork server now with SERVER_SIGNALS (it keeps them, and a trial sets its
    own); from the main thread only, where signal dispositions can be set. Elsewhere, or when
    it runs already, the first trial starts it as it is."""
    if threading.current_thread() is not threading.main_thread():
        return
    _context()
    saved = {sig: signal.signal(sig, how) for sig, how in SERVER_SIGNALS.items()}
    try:
        forkserver.ensure_running()
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def start_trial(trial_dir: Path, env: dict[str, str], stderr: IO[str]) -> ForkedTrial:
    """`harness train` on the trial's config, forked warm; `env` must set OMP_NUM_THREADS."""
    read, write = os.pipe()
    try:
        trial = ForkedTrial(trial_args(trial_dir), env, write, stderr.fileno())
    finally:
        os.close(write)  # the child holds its own copy: EOF comes when it ends
    trial.stdout = open(read, encoding="utf-8", errors="replace")  # noqa: SIM115
    return trial
