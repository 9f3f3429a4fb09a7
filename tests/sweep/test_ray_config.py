"""The Ray launcher's parts that need no cluster: its config, how a trial's processes share
their node's GPUs, and what `harness status` does without a reachable cluster. The sweeps on
a real cluster are in test_ray.py."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from conftest import free_port
from torch.distributed import TCPStore

from harness.config import SweepConfig
from harness.errors import UserError
from harness.sweep.launchers.ray import node_devices
from harness.sweep.launchers.ray_cluster import RayCluster


def sweep(**launcher) -> SweepConfig:
    return SweepConfig.model_validate({"name": "x", "model": "llama_micro", "methods": {"full": {}},
                                       "launcher": {"kind": "ray", **launcher}})


def test_a_ray_launcher_has_its_own_keys_and_defaults():
    launcher = sweep(address="10.0.0.5:6379", jobs=4, tasks_per_node=2).launcher
    assert (launcher.kind, launcher.address, launcher.jobs, launcher.ranks) == (
        "ray", "10.0.0.5:6379", 4, 2)
    assert (launcher.cpus_per_task, launcher.gpus_per_task, launcher.max_requeues) == (1, 0, 3)
    assert not launcher.runs_here


@pytest.mark.parametrize(("keys", "match"), [
    ({"partition": "gpu"}, "partition"),  # a Slurm key
    ({"tasks_per_node": 2, "gpus_per_task": 2}, "one GPU per process"),
    ({"cpus_per_task": 0}, "cpus_per_task"),
])
def test_a_bad_ray_launcher_key_is_refused(keys, match):
    with pytest.raises((UserError, ValueError), match=match):
        sweep(**keys)


def test_each_process_sees_the_gpus_of_its_nodes_processes_in_local_rank_order():
    """Four processes, two a node, each given one GPU by Ray (ids as Ray numbers them on each
    node): each sees its node's two, its own at cuda:LOCAL_RANK."""
    port, own = free_port(), {0: ["3"], 1: ["5"], 2: ["1"], 3: ["0"]}
    seen: dict[int, str] = {}

    def rank(r: int) -> None:
        store = TCPStore("127.0.0.1", port, 4, is_master=r == 0, timeout=timedelta(seconds=30))
        seen[r] = node_devices(store, r, 2, own[r])
        if r == 0:  # the server stays until every rank has read
            while len(seen) < 4:
                threading.Event().wait(0.05)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert seen == {0: "3,5", 1: "3,5", 2: "1,0", 3: "1,0"}
    assert all(seen[r].split(",")[r % 2] == own[r][0] for r in range(4))


def test_status_without_a_reachable_cluster_leaves_the_trials_to_their_folders():
    """A Ray trial's job names the cluster it ran on; with nothing listening there, status
    asks nobody (no 40 s of Ray's retries) and says nothing of the job."""
    job = f"{'ab' * 24}@127.0.0.1:{free_port()}"
    assert RayCluster.job_states([job]) == {}
