"""The CPUs this process may run on, and torch's thread pool sized to a count of them.

A sweep's launcher sets OMP_NUM_THREADS for each trial it starts. A `harness train` started
straight by a scheduler's step or by `torchrun` has no such launcher, and torch would size its
pool by the node's cores: a scheduler does not bind a task to its CPUs on every cluster, and
two such trials each running 2 threads on 1 CPU run several times slower than two 1-thread
trials. What a scheduler granted is its launcher's to read (harness/sweep/launchers/).
"""

from __future__ import annotations

import os

import torch


def affinity_cpus() -> int:
    """The CPUs of this process's affinity mask (taskset, a container's cpuset)."""
    return len(os.sched_getaffinity(0))


def use_threads(threads: int) -> None:
    """torch's intra-op pool, and its children's OpenMP and MKL pools, at `threads`."""
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
