"""The local launcher: each trial a child process of the sweep, `jobs` of them at a time in
the sweep's own thread slots, each trial's output prefixed by its id above a progress bar."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from tqdm import tqdm

from harness.config import LauncherConfig
from harness.sweep.launchers.base import Launcher, allocated_cpus, register, say
from harness.sweep.run.process import record_end, trial_env
from harness.sweep.run.starter import ForkedTrial, start_server, start_trial
from harness.sweep.run.stop import raise_if_stopped
from harness.sweep.run.worker import Worker
from harness.sweep.search.source import Source
from harness.trials import TrialDir

POLL_S = 0.5  # how often a sweep's main thread looks for a stop signal while trials run


@register
class LocalLauncher(Launcher):
    """Runs trials as child processes; Ctrl-C (or any stop signal, harness/sweep/run/stop.py)
    lets each one checkpoint before the sweep exits."""

    kinds = ("local",)

    def __init__(self, config: LauncherConfig, out: Path) -> None:
        super().__init__(config, out)
        self.jobs = config.jobs
        self.procs: set[ForkedTrial] = set()
        self.lock = threading.Lock()
        self.stopping = False
        self.bar: tqdm | None = None

    def launch(self, sources: list[Source], total: int | None = None) -> None:
        """A Worker loop per source, each running its trials here."""
        start_server()
        self.work(sources, total)

    def work(self, sources: list[Source], total: int | None) -> None:
        """A Worker loop per source on `run_one`, in `jobs` slots, under a progress bar of
        `total` trials (a grid's count)."""
        bar = tqdm(total=total, desc="trials", unit="trial", dynamic_ncols=True) if total else None
        with bar or nullcontext():
            self.bar = bar
            self.pool([Worker(source, self.run_one).run for source in sources])

    def run_one(self, trial_id: str, trial_dir: Path) -> int:
        """Run one trial, its output streamed with a prefix; a slot frees when it ends."""
        threads = max(1, allocated_cpus() // self.jobs)
        trial = TrialDir(trial_dir)
        with self.lock:
            if self.stopping:
                return 130
            trial.record_launch("local")
            stderr = trial.open_stderr()
            proc = start_trial(trial_dir, trial_env(threads), stderr)
            self.procs.add(proc)
        with stderr:
            for line in proc.stdout:
                say(f"[{trial_id}] {line.rstrip()}")
            code = proc.wait()
        with self.lock:
            self.procs.discard(proc)
        if not self.stopping:
            record_end(trial_dir, code)
        if self.bar is not None:
            self.bar.update(1)
        return code

    def pool(self, tasks: list[Callable[[], Any]]) -> list[Any]:
        """`jobs` slots; Ctrl-C checkpoints the running trials."""
        return pool(self.jobs, tasks, self.interrupt)

    def interrupt(self) -> None:
        """Ask running trials to stop at the end of their step; they save a checkpoint."""
        with self.lock:
            self.stopping = True
            procs = list(self.procs)
        if procs:
            say(f"stopping: {len(procs)} running trials save a checkpoint", sys.stderr)
        for proc in procs:
            proc.send_signal(signal.SIGINT)
        for proc in procs:
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()


def pool(jobs: int, tasks: list[Callable[[], Any]],
         interrupt: Callable[[], None] = lambda: None) -> list[Any]:
    """Run `tasks` in `jobs` slots, each refilled as soon as its task ends; their results. A
    stop signal calls `interrupt` before it propagates."""
    with ThreadPoolExecutor(max_workers=jobs) as slots:
        futures = [slots.submit(task) for task in tasks]
        try:
            pending = set(futures)
            while pending:
                pending = wait_futures(pending, timeout=POLL_S)[1]
                raise_if_stopped()
            return [f.result() for f in futures]
        except KeyboardInterrupt:
            interrupt()
            raise
