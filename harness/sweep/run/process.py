"""A trial's process: `harness train` on its folder's config, wherever it starts.

Every launcher runs a trial the same way, as `harness train` on the folder's config in a child
process, so a trial behaves identically everywhere and a crash of the child is recorded by its
parent. Inside a launcher's job the child is a `ChildProcess`, which the job stops (the trial
saves a checkpoint) before it is requeued.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from harness.trials import Status, TrialDir

RESEND_S = 2.0  # a stop request is repeated this often until the trial process has ended


def trial_args(trial_dir: Path) -> list[str]:
    """A trial is exactly `harness train` on its resolved config, in its own folder."""
    return ["train", str(TrialDir(trial_dir).config), "--out", str(trial_dir)]


def trial_command(trial_dir: Path) -> list[str]:
    return [sys.executable, "-m", "harness.cli", *trial_args(trial_dir)]


def trial_env(threads: int | None) -> dict[str, str]:
    """The trial's environment; `threads` sets its torch threads and its children's OpenMP
    and MKL pools (torch reads OMP_NUM_THREADS as it starts; the trial logs and records it)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if threads:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    return env


def record_end(trial_dir: Path, code: int) -> None:
    """The end of a trial process that could not write its own (a crash): SIGKILL is the
    kernel's (the OOM killer) or an admin's, so `killed`; any other death or exit code
    without a final summary is `failed`."""
    if code == -signal.SIGKILL:
        TrialDir(trial_dir).mark_end(Status.KILLED, "trial process killed by signal 9 (SIGKILL)")
    else:
        TrialDir(trial_dir).record_crash(code)


def _ignore(signum: signal.Signals) -> None:
    """The child starts with the requeue signal ignored, so one that a scheduler sends to the
    whole job step while the child imports torch cannot kill it; `harness train` installs its
    own handler, and `ChildProcess.stop` repeats its request until that handler has it."""
    signal.signal(signum, signal.SIG_IGN)


class ChildProcess:
    """The trial process of a launcher's job; stopping it (with `stop_signal`, the launcher's
    requeue signal) makes it save its checkpoint."""

    def __init__(self, env: Callable[[], dict[str, str]], stop_signal: signal.Signals) -> None:
        """`env`: the trial process's environment, read as it starts."""
        self.env, self.stop_signal = env, stop_signal
        self.proc: subprocess.Popen | None = None
        self.code: int | None = None  # the exit status `stop` reaped, if it did

    def run(self, trial_dir: Path) -> int:
        """Run the trial; rank 0 records a crash the trial could not record itself."""
        self.code = None
        env = self.env()
        self.proc = subprocess.Popen(trial_command(trial_dir), env=env,
                                     preexec_fn=partial(_ignore, self.stop_signal))
        code = self.proc.wait()
        self.proc = None
        code = self.code if self.code is not None else code  # `stop` reaped it first
        if env.get("RANK", "0") == "0":
            record_end(trial_dir, code)
        return code

    def stop(self, timeout_s: float = 600) -> None:
        """Ask the trial to stop with a checkpoint, and wait until it has. Runs inside a
        signal handler, which interrupted `run`'s `Popen.wait` while it holds the Popen's
        lock: so wait on the pid directly, never through the Popen."""
        if self.proc is None or self.code is not None:
            return
        pid = self.proc.pid
        deadline, asked = time.time() + timeout_s, 0.0
        try:
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    self.code = os.waitstatus_to_exitcode(status)
                    return
                if time.time() > deadline:
                    os.kill(pid, signal.SIGKILL)
                elif time.time() - asked > RESEND_S:  # idempotent for the trial
                    os.kill(pid, self.stop_signal)
                    asked = time.time()
                time.sleep(0.1)
        except (ProcessLookupError, ChildProcessError):
            pass  # `run`'s wait reaped it just before the signal: its code stands
