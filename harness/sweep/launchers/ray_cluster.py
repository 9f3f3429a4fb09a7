"""What a Ray cluster says about a sweep's trials: the Ray launcher's cluster.

A Ray trial's job is its rank 0 task, recorded as `<task id>@<cluster address>`, so that
`harness status` asks the cluster that runs it, through Ray's state API (one query per
cluster), whether the task still waits for resources (`queued`) or runs. Ray is imported only
here and in the launcher, and only when a Ray trial is asked about: without it (or without the
cluster) a trial's folder says what it knows.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from harness.errors import UserError
from harness.sweep.launchers.base import Cluster, register_cluster
from harness.trials import Status

INSTALL = "launcher.kind ray needs Ray: pip install 'harness[ray]'"
TASK_NAME = "harness-trial"  # every trial process's task, as the state API lists it
CONNECT_S = 5.0  # Ray itself retries an address where nothing listens for 40 s
# A task in one of these states waits for resources, arguments or a worker (`queued`).
WAITING = ("PENDING_ARGS_AVAIL", "PENDING_NODE_ASSIGNMENT", "PENDING_OBJ_STORE_MEM_AVAIL",
           "PENDING_ARGS_FETCH", "SUBMITTED_TO_WORKER")


def import_ray() -> Any:
    """Ray, or the one line naming what to install."""
    try:
        import ray
    except ImportError:
        raise UserError(INSTALL) from None
    return ray


def cluster_address(address: str | None) -> str:
    """The launcher's address, else RAY_ADDRESS, else the cluster this machine runs."""
    return address or os.environ.get("RAY_ADDRESS") or "auto"


def unreachable(address: str) -> UserError:
    return UserError(
        f"launcher.address {address}: no Ray cluster answers there; start one with `ray start "
        "--head` (or `bash scripts/ray.sh start`), or name its host:port in launcher.address or "
        "RAY_ADDRESS")


def answers(address: str) -> bool:
    """Whether something listens at a host:port address (others, `auto` and `ray://`, are left
    to Ray)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or "://" in address:
        return True
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_S).close()
    except OSError:
        return False
    return True


def reachable(address: str | None) -> str:
    """The cluster's address (`cluster_address`), or the one line saying nothing answers
    there."""
    resolved = cluster_address(address)
    if not answers(resolved):
        raise unreachable(resolved)
    return resolved


def job_id(task_id: str, address: str) -> str:
    return f"{task_id}@{address}"


@register_cluster
class RayCluster(Cluster):
    kinds = ("ray",)
    title = "Ray"

    @classmethod
    def job_states(cls, job_ids: list[str]) -> dict[str, str]:
        states: dict[str, str] = {}
        by_address: dict[str, set[str]] = {}
        for job in job_ids:
            task, _, address = job.partition("@")
            by_address.setdefault(address, set()).add(task)
        for address, tasks in by_address.items():
            live = _live_tasks(address)
            states.update({job_id(t, address): live[t] for t in tasks if t in live})
        return states


def _live_tasks(address: str) -> dict[str, str]:
    """`queued` or `running` for each trial task the cluster at `address` has not finished;
    none where Ray or the cluster is missing."""
    if not address or not answers(address):
        return {}
    try:
        from ray.util.state import list_tasks

        tasks = list_tasks(address=address, filters=[
            ("name", "=", TASK_NAME), ("state", "!=", "FINISHED"), ("state", "!=", "FAILED")],
            limit=10_000, detail=False, raise_on_missing_output=False, timeout=30)
    except Exception:  # Ray not installed, or its state API unreachable: the folder speaks
        return {}
    return {t.task_id: Status.QUEUED if t.state in WAITING else Status.RUNNING
            for t in tasks if t.state != "NIL"}
