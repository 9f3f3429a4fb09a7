"""The launcher interface: a `Cluster` (what a scheduler says about its jobs and the processes
it starts) and a `Launcher` (how a sweep's worker loops get there), each registered by kind.

A launcher is two classes because they sit at two heights of the sweep: a trial's state
(harness/sweep/run/trial_state.py) asks the cluster whether the trial's job is still queued, and
the sweep's sources ask for trial states, while a launcher runs those sources. So a `Cluster`
imports nothing of the sweep, and a `Launcher` may import all of it. See
harness/sweep/launchers/__init__.py for how to add one.
"""

from __future__ import annotations

import os
import signal
import zlib
from abc import ABC, abstractmethod
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, ClassVar, TypeVar

from tqdm import tqdm

from harness.config import LauncherConfig

if TYPE_CHECKING:
    from harness.sweep.search.source import Source


class Cluster:
    """What a launcher's scheduler says about its jobs and about the processes it starts; the
    defaults are this machine's, where no job outlives the sweep that started it."""

    kinds: ClassVar[tuple[str, ...]] = ()  # the launch.json kinds whose jobs it answers for
    title: ClassVar[str] = ""  # how lines name the scheduler: "3 still in ...", "... job 12"
    # What a trial process takes as "save a checkpoint, stop, and expect to be resumed": the
    # launcher sends it (preemption, a time limit coming) and the trial catches it.
    requeue_signal: ClassVar[signal.Signals] = signal.SIGUSR2

    @classmethod
    def job_states(cls, job_ids: list[str]) -> dict[str, str]:
        """`queued` or `running` (harness.trials.Status) for each of `job_ids` the scheduler
        still holds, from one query for all of them; a job it no longer holds is left out."""
        return {}

    @classmethod
    def granted_cpus(cls, tasks_here: int = 1) -> int | None:
        """The CPUs the scheduler granted this process, one of `tasks_here` on its node; None
        where it says nothing (this process is none of its jobs)."""
        return None

    @classmethod
    def step_tasks(cls) -> int | None:
        """How many tasks of the scheduler's step this process runs in share its node; None
        outside one."""
        return None

    @classmethod
    def started_this_process(cls) -> bool:
        """The scheduler started this process itself, as a task of a step (not through a
        sweep's launcher, which sizes its trials' threads)."""
        return False

    @classmethod
    def current_job(cls) -> str | None:
        """The job this process runs in, if any (a sweep's lock names it)."""
        return None

    @classmethod
    def stop_command(cls, job_id: str) -> str:
        """The command a person runs to stop `job_id`."""
        return ""


class Launcher(ABC):
    """Runs a sweep's worker loops (`harness.sweep.run.worker.Worker`, one per source) where its
    cluster's jobs run: each loop takes trials from its source and runs each as `harness
    train` on the trial's folder (harness/sweep/run/process.py). A launcher records each trial's
    launch (`TrialDir.record_launch(kind, job_id)`, which `harness status` follows through
    `cluster.job_states`), gives each trial process `trial_env(threads)` and, for a trial of
    several processes, each one its `Ranks.env()`, asks a running trial to checkpoint with
    `cluster.requeue_signal` before its job is preempted or requeued, and records the end of a
    trial process that could not record its own (`record_end`)."""

    kinds: ClassVar[tuple[str, ...]] = ()  # the `launcher.kind`s it runs
    cluster: ClassVar[type[Cluster]] = Cluster  # where its jobs run, for every kind of it

    def __init__(self, config: LauncherConfig, out: Path) -> None:
        self.config, self.out = config, out

    @classmethod  # noqa: B027  (a default: the local launcher needs nothing)
    def check(cls, config: LauncherConfig) -> None:
        """UserError (one line) when what `config` needs on this machine is missing (a
        package, a scheduler's commands, a cluster that answers); the sweep asks before it
        reads its data or writes anything."""

    @abstractmethod
    def launch(self, sources: list[Source], total: int | None = None) -> None:
        """Work every source to its end, `config.at_once` loops at a time, and return when all
        have ended; `total`, a grid's trial count, may draw a progress bar. A stop signal
        (harness/sweep/run/stop.py) arrives as KeyboardInterrupt where the launcher polls
        (`raise_if_stopped`): running trials are stopped with a checkpoint, or jobs that
        outlive the sweep are left running and named, and it is re-raised."""


@dataclass(frozen=True)
class Ranks:
    """One process of a trial of several: its place, and where rank 0 listens."""

    rank: int
    world: int
    local_rank: int
    master_addr: str
    master_port: int
    local_world: int = 0  # the trial's processes on this node; 0: not known

    def env(self) -> dict[str, str]:
        """torch's standard variables, the only ones a trial reads (harness.distributed), with
        LOCAL_WORLD_SIZE where the node's share is known, as torchrun sets it."""
        local = {"LOCAL_WORLD_SIZE": str(self.local_world)} if self.local_world else {}
        return {"RANK": str(self.rank), "WORLD_SIZE": str(self.world),
                "LOCAL_RANK": str(self.local_rank), "MASTER_ADDR": self.master_addr,
                "MASTER_PORT": str(self.master_port), **local}

    @staticmethod
    def port(job_id: str) -> int:
        """A port for rank 0 from the job's id: every rank computes the same one, and two jobs
        on one node rarely share it."""
        return job_port(job_id)


def job_port(key: str) -> int:
    """A port every task of a job computes alike from `key`, below Linux's ephemeral range
    (32768-60999): there, a client's own end of a connection could hold it before rank 0
    listens, or a client on rank 0's node connect to itself while it waits."""
    return 20000 + zlib.crc32(key.encode()) % 12768


CLUSTERS: dict[str, type[Cluster]] = {}
LAUNCHERS: dict[str, type[Launcher]] = {}
C = TypeVar("C", bound=Cluster)
L = TypeVar("L", bound=Launcher)


def register_cluster(cls: type[C]) -> type[C]:
    """A class decorator: `cls` answers for each of its kinds."""
    CLUSTERS.update(dict.fromkeys(cls.kinds, cls))
    return cls


def register(cls: type[L]) -> type[L]:
    """A class decorator: `cls` launches each of its kinds."""
    LAUNCHERS.update(dict.fromkeys(cls.kinds, cls))
    return cls


def cluster_of(kind: str) -> type[Cluster]:
    """The cluster of a recorded launch's kind; this machine's for any other (a trial its job
    asked for records "worker")."""
    return CLUSTERS.get(kind, Cluster)


def job_states(jobs: list[tuple[str, str]]) -> dict[tuple[str, str], str]:
    """The state of each (kind, job id) whose cluster still holds it: one query per kind."""
    states = {}
    for kind in sorted({kind for kind, _ in jobs}):
        ids = [job for k, job in jobs if k == kind]
        states.update({(kind, job): s for job, s in cluster_of(kind).job_states(ids).items()})
    return states


def clusters() -> list[type[Cluster]]:
    return list(dict.fromkeys([Cluster, *CLUSTERS.values()]))


def allocated_cpus(tasks_here: int = 1) -> int:
    """The CPUs this process was given: what a scheduler granted it where one says (a job sees
    every core of its node unless the scheduler binds tasks, so the affinity mask alone would
    oversubscribe), capped by the affinity mask (taskset, a container's cpuset)."""
    # imported here: `harness status` reads the clusters without torch, which
    # harness.distributed's package imports
    from harness.distributed.allocation import affinity_cpus

    cpus = affinity_cpus()
    granted = next((g for c in clusters() if (g := c.granted_cpus(tasks_here)) is not None),
                   None)
    return max(1, min(cpus, granted)) if granted is not None else cpus


def tasks_on_node() -> int:
    """This process's step's tasks on this node: torchrun's LOCAL_WORLD_SIZE, else the
    scheduler's step layout, else 1."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if local.isdigit():
        return max(1, int(local))
    return next((n for c in clusters() if (n := c.step_tasks()) is not None), 1)


def follow_allocation() -> None:
    """Size torch's pool (and its children's, through the environment) by the allocation, when
    torchrun or a scheduler started this process and nobody set OMP_NUM_THREADS; a plain
    `harness train`, or one whose launcher chose, keeps torch's own choice."""
    started = "TORCHELASTIC_RUN_ID" in os.environ or any(
        c.started_this_process() for c in clusters())
    if not os.environ.get("OMP_NUM_THREADS") and started:
        from harness.distributed.allocation import use_threads  # as in allocated_cpus

        use_threads(allocated_cpus(tasks_on_node()))


def requeue_signals() -> tuple[signal.Signals, ...]:
    """Every cluster's requeue signal: a trial catches each (they all mean the same)."""
    return tuple(dict.fromkeys(c.requeue_signal for c in clusters()))


def current_job() -> tuple[str, str] | None:
    """(kind, id) of the job this process runs in, if any."""
    return next(((c.kinds[0], job) for c in CLUSTERS.values() if (job := c.current_job())),
                None)


def say(text: str, file: IO[str] | None = None) -> None:
    """One line of the sweep's output, above its progress bar (stdout by default); a reader
    that is gone (a pipe closed, a terminal hung up) costs the line, never the sweep."""
    with suppress(OSError):
        tqdm.write(text, file=file)
