"""Where trials run. Local: one subprocess per trial, `jobs` at a time, output streamed live."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm import tqdm


def trial_command(trial_dir: Path) -> list[str]:
    """A trial is exactly `harness train` on its resolved config, in its own folder."""
    return [
        sys.executable,
        "-m",
        "harness.cli",
        "train",
        str(trial_dir / "config.yaml"),
        "--out",
        str(trial_dir),
    ]


def _threads_per_trial(jobs: int) -> str:
    return str(max(1, (os.cpu_count() or 1) // jobs))


class LocalLauncher:
    """Runs trials as child processes; Ctrl-C lets each one checkpoint before the sweep exits."""

    def __init__(self, jobs: int) -> None:
        self.jobs = jobs
        self.procs: set[subprocess.Popen] = set()
        self.lock = threading.Lock()
        self.stopping = False

    def _run_one(self, trial_id: str, trial_dir: Path, bar: tqdm) -> int:
        env = {
            **os.environ,
            "OMP_NUM_THREADS": _threads_per_trial(self.jobs),
            "PYTHONUNBUFFERED": "1",
        }
        with self.lock:
            if self.stopping:
                return 130
            stderr = (trial_dir / "stderr.log").open("a")
            proc = subprocess.Popen(
                trial_command(trial_dir), stdout=subprocess.PIPE, stderr=stderr, text=True, env=env
            )
            self.procs.add(proc)
        with stderr:
            for line in proc.stdout:
                bar.write(f"[{trial_id}] {line.rstrip()}")
            code = proc.wait()
        with self.lock:
            self.procs.discard(proc)
        bar.update(1)
        return code

    def run(self, todo: list[tuple[str, Path]]) -> list[int]:
        if not todo:
            return []
        with (
            tqdm(total=len(todo), desc="trials", unit="trial", dynamic_ncols=True) as bar,
            ThreadPoolExecutor(max_workers=self.jobs) as pool,
        ):
            futures = [pool.submit(self._run_one, tid, d, bar) for tid, d in todo]
            try:
                return [f.result() for f in futures]
            except KeyboardInterrupt:
                self._interrupt()
                raise

    def _interrupt(self) -> None:
        """Ask running trials to stop at the end of their step; they save a checkpoint."""
        with self.lock:
            self.stopping = True
            procs = list(self.procs)
        for proc in procs:
            proc.send_signal(signal.SIGINT)
        for proc in procs:
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()


def run_local(todo: list[tuple[str, Path]], jobs: int) -> list[int]:
    return LocalLauncher(jobs).run(todo)
