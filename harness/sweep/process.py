"""A trial's process: `harness train` on its folder's config, wherever it starts.

Every launcher runs a trial the same way, as `harness train` on the folder's config in a child
process, so a trial behaves identically everywhere and a crash of the child is recorded by its
parent. Inside a submitit job the child is a `ChildProcess`, which the job stops (the trial
saves a checkpoint) before it requeues itself.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

from harness.trials import TrialDir


def trial_command(trial_dir: Path) -> list[str]:
    """A trial is exactly `harness train` on its resolved config, in its own folder."""
    return [
        sys.executable,
        "-m",
        "harness.cli",
        "train",
        str(TrialDir(trial_dir).config),
        "--out",
        str(trial_dir),
    ]


def trial_env(threads: int | None) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def rank_env() -> dict[str, str]:
    """torchrun's variables from submitit's environment: a multi-task job is one DDP trial."""
    import submitit  # only inside a job: the CLI does not pay for it

    job = submitit.JobEnvironment()
    threads = os.environ.get("SLURM_CPUS_PER_TASK")
    env = trial_env(int(threads) if threads else None)
    if job.num_tasks > 1:
        env.update(
            RANK=str(job.global_rank),
            WORLD_SIZE=str(job.num_tasks),
            LOCAL_RANK=str(job.local_rank),
            MASTER_ADDR=job.hostnames[0],
            MASTER_PORT=str(20000 + zlib.crc32(job.job_id.encode()) % 20000),
        )
    return env


def is_rank_zero() -> bool:
    import submitit

    return submitit.JobEnvironment().global_rank == 0


class ChildProcess:
    """The trial process of a submitit job; stopping it makes it save its checkpoint."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None

    def run(self, trial_dir: Path) -> int:
        """Run the trial; rank 0 records a crash the trial could not record itself."""
        self.proc = subprocess.Popen(trial_command(trial_dir), env=rank_env())
        code = self.proc.wait()
        self.proc = None
        if is_rank_zero():
            TrialDir(trial_dir).record_crash(code)
        return code

    def stop(self, timeout_s: float = 600) -> None:
        """Runs inside submitit's signal handler, which interrupted `run`'s `Popen.wait` while
        it holds the Popen's lock: so wait on the pid directly, never through the Popen."""
        if self.proc is None:
            return
        pid = self.proc.pid
        try:
            os.kill(pid, signal.SIGUSR2)
            deadline = time.time() + timeout_s
            while os.waitpid(pid, os.WNOHANG) == (0, 0):
                if time.time() > deadline:
                    os.kill(pid, signal.SIGKILL)
                time.sleep(0.2)
        except (ProcessLookupError, ChildProcessError):
            pass  # it had already ended
