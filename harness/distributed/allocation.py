"""The CPUs this process was given, and torch's thread pool sized to them.

A sweep's launcher sets OMP_NUM_THREADS for each trial it starts. A `harness train` started
straight by `srun` or `torchrun` has no such launcher, and torch would size its pool by the
node's cores: `srun -n1 -c1` does not bind the task on every cluster (this one's does not), so
two such trials each ran 2 threads on 1 CPU at 0.32x the tokens/s of two 1-thread trials.
"""

from __future__ import annotations

import os
import re

import torch


def allocated_cpus(tasks_here: int = 1) -> int:
    """The CPUs this process was given: Slurm's grant per task where it says (a job sees every
    core of the node unless Slurm binds tasks, so the affinity mask alone would oversubscribe),
    else the affinity mask (taskset, a container's cpuset)."""
    cpus = len(os.sched_getaffinity(0))
    per_task = os.environ.get("SLURM_CPUS_PER_TASK", "")
    if per_task.isdigit():
        return max(1, min(cpus, int(per_task)))
    on_node = os.environ.get("SLURM_CPUS_ON_NODE", "")
    if on_node.isdigit():
        return max(1, min(cpus, int(on_node) // max(1, tasks_here)))
    return cpus


def tasks_on_node() -> int:
    """This trial's processes on this node: torchrun's LOCAL_WORLD_SIZE, else the srun step's
    count for this node (SLURM_STEP_TASKS_PER_NODE, e.g. "2(x3),1": 2 on nodes 0-2, 1 on 3)."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if local.isdigit():
        return max(1, int(local))
    counts: list[int] = []
    for count, repeat in re.findall(r"(\d+)(?:\(x(\d+)\))?", os.environ.get(
            "SLURM_STEP_TASKS_PER_NODE", "")):
        counts += [int(count)] * int(repeat or 1)
    node = int(os.environ.get("SLURM_NODEID", "0") or 0)
    return max(1, counts[node]) if node < len(counts) else 1


def launched_by_srun_or_torchrun() -> bool:
    return "SLURM_STEP_ID" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ


def follow_allocation() -> None:
    """Size torch's pool (and its children's, through the environment) by the allocation, when
    srun or torchrun started this process and nobody set OMP_NUM_THREADS; a plain `harness
    train`, or one whose launcher chose, keeps torch's own choice."""
    if os.environ.get("OMP_NUM_THREADS") or not launched_by_srun_or_torchrun():
        return
    threads = allocated_cpus(tasks_on_node())
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
