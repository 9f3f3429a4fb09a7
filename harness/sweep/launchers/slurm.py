"""The Slurm launcher, through submitit: each source a checkpointable submitit job
(`TrialJob`), on Slurm a task of one job array, or with `kind: submitit-local` the same jobs
on this machine. The sweep waits for the jobs and records any that died before their trial
could record its end."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from harness.config.launchers.slurm import SlurmConfig
from harness.errors import UserError, last_line
from harness.sweep.launchers.base import Launcher, register
from harness.sweep.launchers.local import pool
from harness.sweep.launchers.slurm_cluster import SlurmCluster
from harness.sweep.launchers.slurm_job import TrialJob
from harness.sweep.run.stop import raise_if_stopped
from harness.sweep.search.source import Source
from harness.trials import RunsDir, Status, TrialDir

SUBMITS_WITH = ("sbatch", "srun")  # the Slurm commands submitit's executor calls


def make_executor(launcher: SlurmConfig, folder: Path) -> Any:
    """submitit's executor for `submitit-local` or `slurm`, from the sweep's launcher keys."""
    import submitit  # only for a submitit launcher: the CLI does not pay for it

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


def submit(launcher: SlurmConfig, folder: Path, calls: list[Callable[[], Any]]) -> list[Any]:
    """Slurm: one job array (at most `array_parallelism` running); locally one job each."""
    executor = make_executor(launcher, folder)
    if launcher.kind == "slurm":
        with executor.batch():
            jobs = [executor.submit(call) for call in calls]
        return jobs
    return [executor.submit(call) for call in calls]


# A job whose result files are there while Slurm still holds it has either just finished (it
# is completing) or was requeued after they were written: a 2-task job's rank 1 writes its
# result on preemption, and rank 0 an error when the step's cancellation kills its `scontrol
# requeue`. It is looked at again 1 s later, then twice as long each time up to this, so a
# requeued job that runs for hours costs squeue a call every half-minute.
RECHECK_MAX_S = 30.0


def wait(jobs: list[Any], on_done: Callable[[int, Any], None], slurm: bool = False) -> None:
    """Poll until every job has ended, reporting each as it does; Ctrl-C leaves them running."""
    pending = set(range(len(jobs)))
    held: dict[int, tuple[float, float]] = {}  # a job Slurm still held: when to look, and gap
    with tqdm(total=len(jobs), desc="jobs", unit="job", dynamic_ncols=True) as bar:
        try:
            while pending:
                for i in ended(jobs, sorted(pending), held, slurm):
                    pending.discard(i)
                    on_done(i, jobs[i])
                    bar.update(1)
                time.sleep(1)
                raise_if_stopped()
        except KeyboardInterrupt:
            ids = sorted({str(jobs[i].job_id).split("_")[0] for i in pending})
            bar.write(
                f"{len(pending)} jobs keep running ({', '.join(ids)}): watch them with "
                "`harness status`, stop them with `scancel`; run the sweep again to collect them"
            )
            raise


def ended(jobs: list[Any], pending: list[int], held: dict[int, tuple[float, float]],
          slurm: bool) -> list[int]:
    """The pending jobs whose result files are there and, on Slurm, that Slurm no longer holds
    (one squeue for all of them; a job it holds is noted in `held` with when to look again)."""
    now = time.monotonic()
    due = [i for i in pending if i not in held or held[i][0] <= now]
    ready = {i: str(jobs[i].job_id) for i in due if jobs[i].done()}
    listed = SlurmCluster.job_states(list(ready.values())) if slurm else {}
    for i, job_id in ready.items():
        if job_id in listed:
            gap = min(RECHECK_MAX_S, 2 * held[i][1]) if i in held else 1.0
            held[i] = (now + gap, gap)
    return [i for i, job_id in ready.items() if job_id not in listed]


@register
class SlurmLauncher(Launcher):
    """A submitit job per source; the sweep waits for them and reports each as it ends.
    submitit-local has no job array to cap how many run at once: there `jobs` slots each
    submit a grid trial's job when their last one ended."""

    kinds = ("submitit-local", "slurm")
    cluster = SlurmCluster
    config: SlurmConfig

    @classmethod
    def check(cls, config: SlurmConfig) -> None:
        """On Slurm, its commands on PATH: submitit submits with sbatch and runs with srun."""
        if config.kind != "slurm":
            return  # submitit-local runs the jobs here, without Slurm
        missing = [c for c in SUBMITS_WITH if not shutil.which(c)]
        if missing:
            raise UserError(f"launcher.kind slurm needs Slurm's {' and '.join(missing)} on PATH "
                            "(this machine has none); use launcher.kind submitit-local to run "
                            "the same jobs here, or run the sweep on a Slurm login node")

    def launch(self, sources: list[Source], total: int | None = None) -> None:
        launcher, out = self.config, self.out
        if launcher.kind == "submitit-local" and all(s.assigned for s in sources):
            pool(launcher.jobs, [lambda s=s: _run_local_job(launcher, out, s) for s in sources])
            return
        jobs = submit(launcher, RunsDir(out).jobs, [TrialJob(s) for s in sources])
        for source, job in zip(sources, jobs, strict=True):
            _record(source, launcher, job)
        print(_announce(sources, jobs), flush=True)
        wait(jobs, lambda i, job: _collect(sources[i], job), slurm=launcher.kind == "slurm")


def _announce(sources: list[Source], jobs: list[Any]) -> str:
    if all(s.assigned for s in sources):
        trials = sum(len(s.assigned) for s in sources)
        return f"submitted job array {str(jobs[0].job_id).split('_')[0]} ({trials} trials)"
    return f"submitted {len(jobs)} workers: {', '.join(str(j.job_id) for j in jobs)}"


def _run_local_job(launcher: SlurmConfig, out: Path, source: Source) -> None:
    (job,) = submit(launcher, RunsDir(out).jobs, [TrialJob(source)])
    _record(source, launcher, job)
    _collect(source, job)
    for trial_id, trial_dir in source.assigned:
        summary = TrialDir(trial_dir).read_summary()
        print(f"[{trial_id}] {summary.status if summary else 'pending'}", flush=True)


def _record(source: Source, launcher: SlurmConfig, job: Any) -> None:
    """A trial submitted as a job is launched from now: `harness status` sees it queued."""
    for _, trial_dir in source.assigned:
        TrialDir(trial_dir).record_launch(launcher.kind, str(job.job_id))


def _collect(source: Source, job: Any) -> None:
    """A job that died before its trial could record an end (cancelled, node failure)."""
    try:
        job.result()
    except Exception as e:
        oom = _state(job) == "OUT_OF_MEMORY"  # Slurm saw the job's memory limit kill it
        for _, trial_dir in source.assigned:
            if oom:
                TrialDir(trial_dir).mark_end(Status.OOM, f"job {job.job_id}: Slurm state "
                                             "OUT_OF_MEMORY (killed at its memory limit)")
            else:
                TrialDir(trial_dir).mark_end(Status.FAILED, f"job {job.job_id}: {last_line(e)}")
        if not source.assigned:
            print(f"worker {job.job_id} failed: {last_line(e)} (log: {job.paths.stderr})",
                  flush=True)


def _state(job: Any) -> str:
    """The job's Slurm state (`OUT_OF_MEMORY`, `FAILED`, ...), "" where none can be had."""
    try:
        return str(job.state).split()[0] if job.state else ""
    except Exception:  # sacct unreachable: the state is only a better reason
        return ""
