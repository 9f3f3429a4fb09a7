"""Launchers: where a sweep's trials run (this machine, or a cluster's jobs).

Adding a launcher, say `kind: mine`:

1. Its config: `MineConfig(LauncherConfig)` in harness/config/launchers/mine.py, with
   `kind: Literal["mine"]`, its own keys, `processes = True` if it can run a trial of several
   processes, and `runs_here`/`at_once` if they differ; list it in that package's `CONFIGS`.
2. Its cluster, if its jobs can outlive the sweep or it sets the environment of the processes
   it starts: a `Cluster` subclass in harness/sweep/launchers/mine_cluster.py (`job_states` for
   `harness status`, `granted_cpus`, `current_job`, `stop_command`, `requeue_signal`),
   decorated `@register_cluster` and imported below. It imports nothing of the sweep.
3. Its launcher: a `Launcher` subclass in harness/sweep/launchers/mine.py, `kinds =
   ("mine",)`, `cluster = MineCluster`, decorated `@register` and imported in launch.py. Its
   `launch` runs one `Worker` loop per source where its jobs run; see `Launcher` for what
   each trial gets (its launch recorded, its threads, the rank variables of torch's launcher
   for a trial of several processes, the requeue signal before a preemption).

A scheduler's own names (its variables, commands, libraries) stay in those files: the trial
process reads only torch's standard variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT) and OMP_NUM_THREADS, which the launcher sets. docs/launchers.md describes each
launcher for users.
"""

from harness.sweep.launchers import ray_cluster, slurm_cluster  # noqa: F401  (register their clusters)
from harness.sweep.launchers.base import (
    CLUSTERS,
    LAUNCHERS,
    Cluster,
    Launcher,
    Ranks,
    allocated_cpus,
    cluster_of,
    current_job,
    follow_allocation,
    job_states,
    register,
    register_cluster,
    requeue_signals,
    say,
    tasks_on_node,
)

__all__ = [
    "CLUSTERS", "LAUNCHERS", "Cluster", "Launcher", "Ranks", "allocated_cpus", "cluster_of",
    "current_job", "follow_allocation", "job_states", "register", "register_cluster",
    "requeue_signals", "say", "tasks_on_node",
]
