"""`harness train` as the ranks of a Slurm job's step, on this machine: each task gets the
variables Slurm gives it (SLURM_PROCID, SLURM_NODEID, SLURM_LOCALID, SLURM_NTASKS, ...), and
the Slurm launcher's own translation (harness/sweep/launchers/slurm_job.py `job_env`, which
reads them through submitit) turns them into torch's, as inside a real job. The "nodes" all
resolve to the loopback. Ranks are forked warm (harness/sweep/run/starter.py), as tests/ranks.py
forks torchrun's."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from harness.sweep.launchers import Ranks as Place
from harness.sweep.launchers.slurm_job import job_env
from harness.sweep.run.starter import ForkedTrial


def free_job_id() -> str:
    """A job id whose rank-0 port (what every task computes from the id) is free here."""
    for n in range(1000):
        job_id = f"{os.getpid()}{n:03d}"
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", Place.port(job_id)))
            except OSError:
                continue
            return job_id
    raise AssertionError("no free port for a job id")


def slurm_vars(job_id: str, nodes: int, per_node: int, node: int, local: int) -> dict[str, str]:
    """What Slurm sets for task `local` of node `node` in a step of `nodes` × `per_node`
    (and submitit's batch script, which the Slurm launcher submits)."""
    return {
        "SLURM_JOB_ID": job_id, "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_NNODES": str(nodes),
        "SLURM_JOB_NODELIST": ",".join(["localhost"] * nodes), "SLURM_NODEID": str(node),
        "SLURM_NTASKS": str(nodes * per_node), "SLURM_PROCID": str(node * per_node + local),
        "SLURM_LOCALID": str(local), "SLURM_STEP_ID": "0", "SLURM_CPUS_PER_TASK": "1",
        "SLURM_STEP_TASKS_PER_NODE": f"{per_node}(x{nodes})",
        "SUBMITIT_EXECUTOR": "slurm",  # what submitit's batch script exports in the job
    }


@contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class SlurmTasks:
    """A step of `nodes` × `per_node` tasks, each running `harness ARGV` with the environment
    the Slurm launcher gives its trial process; their output one stream. The part of
    `subprocess.Popen` the tests use: `stdout`, `communicate`, `returncode`; `tasks[i].pid`."""

    def __init__(self, argv: list[str], nodes: int = 1, per_node: int = 2) -> None:
        job_id = free_job_id()
        read, write = os.pipe()
        self.envs: list[dict[str, str]] = []
        for node in range(nodes):
            for local in range(per_node):
                with environment(slurm_vars(job_id, nodes, per_node, node, local)):
                    self.envs.append(job_env())
        try:
            self.tasks = [ForkedTrial(argv, env, write, write) for env in self.envs]
        finally:
            os.close(write)
        self.stdout = open(read, encoding="utf-8", errors="replace")  # noqa: SIM115
        self.returncode: int | None = None

    def communicate(self, timeout: float) -> tuple[str, None]:
        """The rest of the output once every task has ended (all killed at `timeout`)."""
        chunks: list[str] = []
        reader = threading.Thread(target=lambda: chunks.append(self.stdout.read()), daemon=True)
        reader.start()
        codes = []
        for task in self.tasks:
            try:
                codes.append(task.wait(timeout))
            except subprocess.TimeoutExpired:
                task.kill()
                codes.append(task.wait(30))
        reader.join(30)
        self.returncode = next((c for c in codes if c), 0)
        return "".join(chunks), None


def trial_args(config: Path, out: Path) -> list[str]:
    return ["train", str(config), "--out", str(out)]
