"""What Slurm says about its jobs (one `squeue` for all a call asks about: `harness status` on
a sweep of hundreds of trials is one call, not hundreds) and about the processes it starts
(SLURM_* variables): the Slurm launcher's cluster."""

from __future__ import annotations

import os
import re
import signal
import subprocess

from harness.sweep.launchers.base import Cluster, register_cluster
from harness.trials import Status

# A job in one of these states waits for a slot (`queued`); any other it holds runs.
WAITING = ("PENDING", "REQUEUED", "REQUEUE_HOLD")


@register_cluster
class SlurmCluster(Cluster):
    kinds = ("slurm",)
    title = "Slurm"
    requeue_signal = signal.SIGUSR2  # sent `signal_delay_s` before a time limit or preemption

    @classmethod
    def job_states(cls, job_ids: list[str]) -> dict[str, str]:
        """From one `squeue` (`-r`: an array's pending tasks one per line, not folded into
        `<array>_[2-5]`); Slurm unreachable: none."""
        ids = sorted(set(job_ids))
        if not ids:
            return {}
        try:
            out = subprocess.run(
                ["squeue", "-h", "-r", "-j", ",".join(ids), "-o", "%i %T"],
                capture_output=True, text=True, timeout=30,
            ).stdout
        except (OSError, subprocess.TimeoutExpired):
            return {}
        wanted, states = set(ids), {}
        for line in out.splitlines():
            job_id, _, state = line.strip().partition(" ")
            if job_id in wanted and state:
                states[job_id] = Status.QUEUED if state.strip() in WAITING else Status.RUNNING
        return states

    @classmethod
    def granted_cpus(cls, tasks_here: int = 1) -> int | None:
        """Slurm's grant per task where it says, else its CPUs on this node shared by the
        tasks here."""
        per_task = os.environ.get("SLURM_CPUS_PER_TASK", "")
        if per_task.isdigit():
            return int(per_task)
        on_node = os.environ.get("SLURM_CPUS_ON_NODE", "")
        if on_node.isdigit():
            return int(on_node) // max(1, tasks_here)
        return None

    @classmethod
    def step_tasks(cls) -> int | None:
        """The srun step's count for this node (SLURM_STEP_TASKS_PER_NODE, e.g. "2(x3),1": 2
        on nodes 0-2, 1 on node 3)."""
        counts: list[int] = []
        for count, repeat in re.findall(r"(\d+)(?:\(x(\d+)\))?", os.environ.get(
                "SLURM_STEP_TASKS_PER_NODE", "")):
            counts += [int(count)] * int(repeat or 1)
        node = int(os.environ.get("SLURM_NODEID", "0") or 0)
        return max(1, counts[node]) if node < len(counts) else None

    @classmethod
    def started_this_process(cls) -> bool:
        return "SLURM_STEP_ID" in os.environ

    @classmethod
    def current_job(cls) -> str | None:
        return os.environ.get("SLURM_JOB_ID") or None

    @classmethod
    def stop_command(cls, job_id: str) -> str:
        return f"scancel {job_id}"
