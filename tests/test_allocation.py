"""The CPUs a process was given (harness/sweep/launchers/); the real srun case is
tests/sweep/test_slurm.py::test_harness_train_started_by_srun_runs_the_threads_of_its_cpus."""

from __future__ import annotations

import os

from harness.sweep.launchers import allocated_cpus, tasks_on_node


def test_allocated_cpus_follow_slurm_then_the_affinity_mask(monkeypatch):
    mask = len(os.sched_getaffinity(0))
    for var in ("SLURM_CPUS_PER_TASK", "SLURM_CPUS_ON_NODE"):
        monkeypatch.delenv(var, raising=False)
    assert allocated_cpus() == mask
    monkeypatch.setenv("SLURM_CPUS_ON_NODE", "64")  # what Slurm granted, capped by the mask
    assert allocated_cpus() == mask
    monkeypatch.setenv("SLURM_CPUS_ON_NODE", "1")
    assert allocated_cpus() == 1
    monkeypatch.setenv("SLURM_CPUS_ON_NODE", str(2 * mask))
    assert allocated_cpus(tasks_here=2) == mask
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "1")
    assert allocated_cpus(tasks_here=2) == 1


def test_tasks_on_node_reads_torchrun_then_the_srun_step_layout(monkeypatch):
    for var in ("LOCAL_WORLD_SIZE", "SLURM_STEP_TASKS_PER_NODE", "SLURM_NODEID"):
        monkeypatch.delenv(var, raising=False)
    assert tasks_on_node() == 1
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "2(x3),1")  # nodes 0-2: 2 tasks, node 3: 1
    assert tasks_on_node() == 2
    monkeypatch.setenv("SLURM_NODEID", "2")
    assert tasks_on_node() == 2
    monkeypatch.setenv("SLURM_NODEID", "3")
    assert tasks_on_node() == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun's own count wins
    assert tasks_on_node() == 4
