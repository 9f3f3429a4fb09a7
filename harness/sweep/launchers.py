"""Where trials run: local subprocesses, or submitit jobs (its local executor, or Slurm).

Every launcher runs a trial the same way, as `harness train` on the folder's config in a child
process, so a trial behaves identically everywhere and a crash of the child is recorded by its
parent. Under submitit the parent is a checkpointable job: on preemption or time limit (USR2)
it lets the child save a checkpoint, counts the requeue in `summary.json` and requeues itself.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tqdm import tqdm

from harness.config import LauncherConfig
from harness.trials import read_json, write_json

LAUNCH = "launch.json"


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


def trial_env(threads: int | None) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def record_launch(trial_dir: Path, launcher: str, job_id: str | None = None) -> None:
    """When and how a trial was launched: `harness status` asks Slurm about queued jobs."""
    trial_dir.mkdir(parents=True, exist_ok=True)
    write_json(
        trial_dir / LAUNCH,
        {"launcher": launcher, "job_id": job_id, "host": socket.gethostname(),
         "submitted_at": time.time()},
    )


def record_crash(trial_dir: Path, code: int) -> None:
    """A child that died without its final summary (killed, segfault) ends `failed`."""
    if code != 0:
        reason = f"signal {-code}" if code < 0 else f"exit code {code}"
        mark_failed(trial_dir, f"trial process ended with {reason}")


def mark_failed(trial_dir: Path, error: str) -> None:
    """Record a failure the trial could not record itself; a final status already written
    (ok, interrupted, failed, ...) is left as it is."""
    summary = read_json(trial_dir / "summary.json") or {"trial": trial_dir.name}
    if summary.get("status") in (None, "pending", "running"):
        write_json(trial_dir / "summary.json", {**summary, "status": "failed", "error": error})


def count_requeue(trial_dir: Path) -> None:
    summary = read_json(trial_dir / "summary.json")
    if summary is not None:
        summary["requeues"] = summary.get("requeues", 0) + 1
        write_json(trial_dir / "summary.json", summary)


class LocalLauncher:
    """Runs trials as child processes; Ctrl-C lets each one checkpoint before the sweep exits."""

    def __init__(self, jobs: int) -> None:
        self.jobs = jobs
        self.procs: set[subprocess.Popen] = set()
        self.lock = threading.Lock()
        self.stopping = False
        self.bar: tqdm | None = None

    def run_one(self, trial_id: str, trial_dir: Path) -> int:
        """Run one trial, its output streamed with a prefix; a slot frees when it ends."""
        threads = max(1, (os.cpu_count() or 1) // self.jobs)
        with self.lock:
            if self.stopping:
                return 130
            record_launch(trial_dir, "local")
            stderr = (trial_dir / "stderr.log").open("a")
            proc = subprocess.Popen(
                trial_command(trial_dir), stdout=subprocess.PIPE, stderr=stderr, text=True,
                env=trial_env(threads),
            )
            self.procs.add(proc)
        with stderr:
            for line in proc.stdout:
                (self.bar or tqdm).write(f"[{trial_id}] {line.rstrip()}")
            code = proc.wait()
        with self.lock:
            self.procs.discard(proc)
        if not self.stopping:
            record_crash(trial_dir, code)
        if self.bar is not None:
            self.bar.update(1)
        return code

    def run(self, todo: list[tuple[str, Path]]) -> list[int]:
        if not todo:
            return []
        with tqdm(total=len(todo), desc="trials", unit="trial", dynamic_ncols=True) as bar:
            self.bar = bar
            return self.pool([lambda t=t: self.run_one(*t) for t in todo])

    def pool(self, tasks: list[Callable[[], Any]]) -> list[Any]:
        """`jobs` slots, each refilled as soon as its task ends; Ctrl-C checkpoints them all."""
        with ThreadPoolExecutor(max_workers=self.jobs) as pool:
            futures = [pool.submit(task) for task in tasks]
            try:
                return [f.result() for f in futures]
            except KeyboardInterrupt:
                self.interrupt()
                raise

    def interrupt(self) -> None:
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


def rank_env() -> dict[str, str]:
    """torchrun's variables from submitit's environment: a multi-task job is one DDP trial."""
    import submitit

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
            record_crash(trial_dir, code)
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


class TrialJob:
    """A submitit job that runs one trial and requeues itself, checkpointed, when signalled."""

    def __init__(self, trial_dir: Path) -> None:
        self.trial_dir = Path(trial_dir)
        self.child = ChildProcess()

    def __call__(self) -> int:
        return self.child.run(self.trial_dir)

    def checkpoint(self) -> Any:
        """Called by submitit on USR2 (preemption or time limit), before it requeues the job."""
        from submitit.helpers import DelayedSubmission

        self.child.stop()
        count_requeue(self.trial_dir)
        return DelayedSubmission(TrialJob(self.trial_dir))

    def __getstate__(self) -> dict[str, Any]:
        return {"trial_dir": self.trial_dir}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["trial_dir"])


def make_executor(launcher: LauncherConfig, folder: Path) -> Any:
    """submitit's executor for `submitit-local` or `slurm`, from the sweep's launcher keys."""
    import submitit

    cluster = "local" if launcher.kind == "submitit-local" else "slurm"
    executor = submitit.AutoExecutor(
        folder=folder / "%j", cluster=cluster, slurm_max_num_timeout=launcher.max_timeouts
    )
    params: dict[str, Any] = {
        "timeout_min": launcher.timeout_min,
        "nodes": launcher.nodes,
        "tasks_per_node": launcher.tasks_per_node,
        "gpus_per_node": launcher.gpus_per_node,
        "cpus_per_task": launcher.cpus_per_task,
        "slurm_partition": launcher.partition,
        "slurm_account": launcher.account,
        "slurm_qos": launcher.qos,
        "slurm_constraint": launcher.constraint,
        "slurm_mem": launcher.mem,
        "slurm_signal_delay_s": launcher.signal_delay_s,
        "slurm_array_parallelism": launcher.array_parallelism or launcher.jobs,
        "slurm_additional_parameters": launcher.sbatch or None,
        "slurm_setup": launcher.setup or None,
    }
    executor.update_parameters(**{k: v for k, v in params.items() if v is not None})
    return executor


def submit(launcher: LauncherConfig, folder: Path, calls: list[Callable[[], Any]]) -> list[Any]:
    """Slurm: one job array (at most `array_parallelism` running); locally one job each."""
    executor = make_executor(launcher, folder)
    if launcher.kind == "slurm":
        with executor.batch():
            jobs = [executor.submit(call) for call in calls]
        return jobs
    return [executor.submit(call) for call in calls]


def wait(jobs: list[Any], on_done: Callable[[int, Any], None]) -> None:
    """Poll until every job has ended, reporting each as it does; Ctrl-C leaves them running."""
    pending = set(range(len(jobs)))
    with tqdm(total=len(jobs), desc="jobs", unit="job", dynamic_ncols=True) as bar:
        try:
            while pending:
                for i in sorted(pending):
                    if jobs[i].done():
                        pending.discard(i)
                        on_done(i, jobs[i])
                        bar.update(1)
                time.sleep(1)
        except KeyboardInterrupt:
            ids = sorted({str(jobs[i].job_id).split("_")[0] for i in pending})
            bar.write(
                f"{len(pending)} jobs keep running ({', '.join(ids)}): watch them with "
                "`harness status`, stop them with `scancel`; run the sweep again to collect them"
            )
            raise


def run_jobs(todo: list[tuple[str, Path]], launcher: LauncherConfig, out: Path) -> None:
    """Grid trials as submitit jobs; the sweep waits for them and reports each as it ends."""
    if not todo:
        return
    if launcher.kind == "submitit-local":
        slots = LocalLauncher(launcher.jobs)
        slots.pool([lambda t=t: _run_local_job(launcher, out, *t) for t in todo])
        return
    jobs = submit(launcher, out / "jobs", [TrialJob(d) for _, d in todo])
    for (_, trial_dir), job in zip(todo, jobs, strict=True):
        record_launch(trial_dir, launcher.kind, str(job.job_id))
    print(f"submitted job array {str(jobs[0].job_id).split('_')[0]} ({len(jobs)} trials)")
    wait(jobs, lambda i, job: _collect(todo[i][1], job))


def run_workers(workers: list[Any], launcher: LauncherConfig, out: Path) -> None:
    """Optuna workers as submitit jobs (on Slurm one array); the sweep waits for them all."""
    jobs = submit(launcher, out / "jobs", workers)
    print(f"submitted {len(jobs)} workers: {', '.join(str(j.job_id) for j in jobs)}", flush=True)
    wait(jobs, lambda i, job: _report_worker(job))


def _report_worker(job: Any) -> None:
    try:
        job.result()
    except Exception as e:
        print(f"worker {job.job_id} failed: {last_line(e)} (log: {job.paths.stderr})", flush=True)


def last_line(error: Exception) -> str:
    """submitit's errors carry the job's whole traceback: its last line says what happened."""
    return (str(error).strip().splitlines() or [type(error).__name__])[-1]


def _run_local_job(launcher: LauncherConfig, out: Path, trial_id: str, trial_dir: Path) -> None:
    (job,) = submit(launcher, out / "jobs", [TrialJob(trial_dir)])
    record_launch(trial_dir, launcher.kind, str(job.job_id))
    _collect(trial_dir, job)
    summary = read_json(trial_dir / "summary.json") or {}
    print(f"[{trial_id}] {summary.get('status', 'pending')}", flush=True)


def _collect(trial_dir: Path, job: Any) -> None:
    """A job that died before its trial could record an end (cancelled, node failure)."""
    try:
        job.result()
    except Exception as e:
        mark_failed(trial_dir, f"job {job.job_id}: {last_line(e)}")




