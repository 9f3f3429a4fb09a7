"""The Ray launcher: each trial process a Ray task holding the trial's CPUs and GPUs, running
`harness train` as the local launcher does; a trial of several processes a placement group of
such tasks (one bundle per node), each given torch's rank variables.

A task forks its trial from a fork server it keeps (harness/sweep/run/starter.py), and Ray reuses
the worker process for the sweep's next task, so from its second trial on a worker starts
trials warm, as the local launcher does. A task streams back its process's id, each line the
process prints and its exit status; the sweep prints the lines under the trial's id.

A stop signal to the sweep reaches every running trial process as SIGINT, sent by a small task
on its node: the trial saves a checkpoint and ends `interrupted`. A worker that dies (killed,
its node lost) takes its process group along, the trial process with it, and the trial is
recorded `interrupted`: the sweep resubmits it (`max_requeues`), and it resumes from its newest
checkpoint (`train.checkpoint_every` bounds what a lost worker costs).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import suppress
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil
from torch.distributed import TCPStore

from harness.config.launchers.ray import RayConfig
from harness.sweep.launchers.base import Ranks, register, say
from harness.sweep.launchers.local import LocalLauncher
from harness.sweep.launchers.ray_cluster import (
    TASK_NAME,
    RayCluster,
    import_ray,
    job_id,
    reachable,
    unreachable,
)
from harness.sweep.run.process import record_end, trial_env
from harness.sweep.run.starter import STOP_SIGNALS, start_trial
from harness.sweep.search.source import Source
from harness.trials import Status, TrialDir

STOP_WAIT_S = 120  # a trial asked to stop gets this long to checkpoint, then SIGKILL
EXCHANGE = timedelta(minutes=30)  # a trial's processes wait this long for each other to start
# What the worker sets for its own resources and threads; the rest of the sweep's environment
# reaches the trial, as a batch scheduler exports a submitting shell's.
OWNED = ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "PYTHONUNBUFFERED")


def owned(name: str) -> bool:
    return name in OWNED or name.startswith("RAY_")


# ------------------------------------------------------------ run by Ray on a cluster node


def run_trial(trial_dir: str, cwd: str, sweep_env: dict[str, str], threads: int,
              place: tuple[int, int, int, int] | None = None,
              master: tuple[str, int, int] | None = None) -> Iterator[tuple]:
    """A trial process's task: `harness train` on the trial, forked warm, in the sweep's
    working directory and environment; `place` (rank, world, local rank, local world) and
    `master` (rank 0's address, its port and a port for the GPU exchange) for a process of
    several. Yields ("pid", node, pid), ("out", line) for each line it prints, then ("exit",
    code)."""
    import ray

    os.chdir(cwd)  # the trial's relative paths are the sweep's
    env = {k: v for k, v in sweep_env.items() if not owned(k)}
    env.update({k: v for k, v in trial_env(threads).items() if owned(k)})
    store = None  # rank 0's serves the GPU exchange as long as the trial runs
    if place is not None and master is not None:
        rank, world, local, local_world = place
        addr, port, store_port = master
        env.update(Ranks(rank, world, local, addr, port).env(), LOCAL_WORLD_SIZE=str(local_world))
        gpus = ray.get_runtime_context().get_accelerator_ids().get("GPU", [])
        if gpus:
            store = TCPStore(addr, store_port, world, is_master=rank == 0, timeout=EXCHANGE)
            env["CUDA_VISIBLE_DEVICES"] = node_devices(store, rank, local_world, gpus)
    with TrialDir(trial_dir).open_stderr() as stderr:
        proc = start_trial(Path(trial_dir), env, stderr)
        yield ("pid", ray.get_runtime_context().get_node_id(), proc.pid)
        try:
            for line in proc.stdout:
                yield ("out", line.rstrip("\n"))
        except KeyboardInterrupt:  # the task cancelled as it started: the trial checkpoints
            proc.send_signal(signal.SIGINT)
        yield ("exit", proc.wait())
    del store


def node_devices(store: TCPStore, rank: int, local_world: int, own: list[str]) -> str:
    """The GPUs of every process of the trial on this node, in local-rank order: Ray shows a
    task only its own, but a trial process takes cuda:LOCAL_RANK among its node's, as under
    torchrun (and NCCL reaches its peers' GPUs directly when it sees them)."""
    store.set(f"gpus/{rank}", ",".join(own))
    first = rank - rank % local_world
    return ",".join(store.get(f"gpus/{r}").decode() for r in range(first, first + local_world))


def rendezvous() -> tuple[str, int, int]:
    """Rank 0's node address and two free ports there: torch.distributed's, the GPU
    exchange's."""
    import ray

    with socket.socket() as a, socket.socket() as b:
        a.bind(("", 0))
        b.bind(("", 0))
        ports = a.getsockname()[1], b.getsockname()[1]
    return ray.util.get_node_ip_address(), *ports


def stop_pids(pids: list[int], sig: int, wait_s: float) -> None:
    """`sig` to processes of this node (0: none), then wait up to `wait_s` until they are
    gone, and SIGKILL what is left."""
    for pid in pids:
        if sig:
            with suppress(ProcessLookupError):
                os.kill(pid, sig)
    deadline = time.time() + wait_s
    while wait_s and any(psutil.pid_exists(pid) for pid in pids):
        if time.time() > deadline:
            for pid in pids:
                with suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            return
        time.sleep(0.2)


# ------------------------------------------------------------ the sweep's side


class Remote:
    """The sweep's connection to its cluster and the Ray functions it submits."""

    def __init__(self, address: str | None) -> None:
        self.ray = ray = import_ray()
        self.address = reachable(address)  # checked again: the cluster may have gone
        # Ray's driver installs its own SIGTERM handler (it aborts): the sweep's stay.
        handlers = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
        try:
            self.context = ray.init(address=self.address, log_to_driver=False,
                                    logging_level="ERROR", configure_logging=False)
        except ConnectionError:
            raise unreachable(self.address) from None
        finally:
            if threading.current_thread() is threading.main_thread():  # only it sets them
                for sig, handler in handlers.items():
                    if handler is not None:
                        signal.signal(sig, handler)
        self.gcs = self.context.address_info["gcs_address"]
        self.run = ray.remote(num_returns="streaming", max_retries=0)(run_trial)
        self.rendezvous = ray.remote(num_cpus=0, max_retries=0)(rendezvous)
        self.stop = ray.remote(num_cpus=0, max_retries=0)(stop_pids)

    def on_node(self, node: str) -> Any:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        return NodeAffinitySchedulingStrategy(node, soft=False)

    def in_bundle(self, group: Any, bundle: int) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=bundle)


class RayTrial:
    """One trial's tasks, with the part of `subprocess.Popen` that `LocalLauncher.interrupt`
    uses (`send_signal`, `wait`, `kill`)."""

    def __init__(self, remote: Remote, config: Any, trial_dir: Path) -> None:
        self.remote, self.config = remote, config
        self.pids: dict[int, tuple[str, int]] = {}  # rank -> (node, pid)
        self.code: int | None = None  # rank 0's exit status
        self.died: str | None = None  # why a worker of the trial died
        self.ended = threading.Event()
        self.group: Any = None
        self.tasks = self.submit(trial_dir)

    @property
    def job_id(self) -> str:
        return job_id(self.tasks[0]._generator_ref.task_id().hex(), self.remote.gcs)

    def submit(self, trial_dir: Path) -> list[Any]:
        """One task per process; several in a placement group of one bundle per node, told
        rank 0's address once the group is placed (submitting never waits for it)."""
        c, r = self.config, self.remote
        per_task = {"name": TASK_NAME, "num_cpus": c.cpus_per_task, "num_gpus": c.gpus_per_task}
        args = (str(trial_dir), os.getcwd(), dict(os.environ), c.cpus_per_task)
        if c.ranks == 1:
            return [r.run.options(**per_task).remote(*args)]
        from ray.util.placement_group import placement_group

        bundle = {"CPU": c.cpus_per_task * c.tasks_per_node}
        if c.gpus_per_task:
            bundle["GPU"] = c.gpus_per_task * c.tasks_per_node
        self.group = placement_group([bundle] * c.nodes,
                                     strategy="STRICT_SPREAD" if c.nodes > 1 else "PACK")
        master = r.rendezvous.options(scheduling_strategy=r.in_bundle(self.group, 0)).remote()
        return [r.run.options(**per_task, scheduling_strategy=r.in_bundle(
            self.group, rank // c.tasks_per_node)).remote(
                *args, (rank, c.ranks, rank % c.tasks_per_node, c.tasks_per_node), master)
            for rank in range(c.ranks)]

    def stream(self, trial_id: str) -> int | None:
        """Print the trial's output as it comes (rank k > 0's under `[trial:k]`); rank 0's exit
        status, or None if a worker died (`died` says how)."""
        others = [threading.Thread(target=self.follow, args=(rank, f"[{trial_id}:{rank}]"),
                                   daemon=True) for rank in range(1, len(self.tasks))]
        for thread in others:
            thread.start()
        self.follow(0, f"[{trial_id}]")
        for thread in others:
            thread.join()
        if self.died is not None:
            self.signal(0, STOP_WAIT_S)  # every process of the trial gone before it runs again
        if self.group is not None:
            self.remote.ray.util.remove_placement_group(self.group)
        self.ended.set()
        return None if self.died is not None else self.code

    def follow(self, rank: int, prefix: str) -> None:
        ray = self.remote.ray
        try:
            for ref in self.tasks[rank]:
                item = ray.get(ref)
                if item[0] == "pid":
                    self.pids[rank] = (item[1], item[2])
                elif item[0] == "out":
                    say(f"{prefix} {item[1]}")
                elif rank == 0:
                    self.code = item[1]
        except ray.exceptions.TaskCancelledError:  # stopped before it started
            self.code = 130 if rank == 0 else self.code
        except ray.exceptions.RayError as e:
            self.died = self.died or str(e).strip().splitlines()[0]
            self.signal(signal.SIGINT, 0)  # its other ranks stop with it

    def signal(self, sig: int, wait_s: float) -> None:
        """`sig` to every started process of the trial, by a task on its node; then wait up to
        `wait_s` until they are gone."""
        by_node: dict[str, list[int]] = {}
        for node, pid in list(self.pids.values()):
            by_node.setdefault(node, []).append(pid)
        refs = [self.remote.stop.options(scheduling_strategy=self.remote.on_node(node)).remote(
            pids, sig, wait_s) for node, pids in by_node.items()]
        for ref in refs:
            with suppress(self.remote.ray.exceptions.RayError):  # its node is gone: they are
                self.remote.ray.get(ref)

    def send_signal(self, sig: int) -> None:
        if len(self.pids) < len(self.tasks):  # a task still queued never starts
            for task in self.tasks:
                with suppress(Exception):
                    self.remote.ray.cancel(task)
        self.signal(sig, 0)

    def wait(self, timeout: float | None = None) -> int:
        if not self.ended.wait(timeout):
            raise subprocess.TimeoutExpired(["harness", "train"], timeout or 0)
        return self.code if self.code is not None else 1

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


@register
class RayLauncher(LocalLauncher):
    """`jobs` trials at a time on a Ray cluster, each process of a trial a task with
    `cpus_per_task` CPUs (its threads) and `gpus_per_task` GPUs."""

    kinds = ("ray",)
    cluster = RayCluster
    config: RayConfig

    @classmethod
    def check(cls, config: RayConfig) -> None:
        """Ray installed, and something listening at the cluster's address."""
        import_ray()
        reachable(config.address)

    def launch(self, sources: list[Source], total: int | None = None) -> None:
        self.remote = Remote(self.config.address)
        dashboard = self.remote.context.dashboard_url
        say(f"ray: trials run on the cluster at {self.remote.gcs}"
            + (f" (dashboard http://{dashboard})" if dashboard else ""))
        try:
            self.work(sources, total)
        finally:
            self.remote.ray.shutdown()

    def run_one(self, trial_id: str, trial_dir: Path) -> int:
        """Run one trial on the cluster, its output streamed with a prefix; a worker that died
        leaves it `interrupted`, for the sweep to resubmit."""
        trial_dir = Path(trial_dir).resolve()
        trial = TrialDir(trial_dir)
        with self.lock:
            if self.stopping:
                return 130
            proc = RayTrial(self.remote, self.config, trial_dir)  # submitted: never waits
            trial.record_launch("ray", proc.job_id)
            self.procs.add(proc)
        code = proc.stream(trial_id)
        with self.lock:
            self.procs.discard(proc)
        if code is None:
            trial.mark_end(Status.INTERRUPTED, f"its Ray worker died: {proc.died}")
            say(f"[{trial_id}] its Ray worker died ({proc.died}): interrupted", sys.stderr)
            code = 1
        elif not self.stopping:
            record_end(trial_dir, code)
        if self.bar is not None:
            self.bar.update(1)
        return code
