"""Multi-node trials on the loopback: two torchrun launches of one node each (`--nnodes 2
--node_rank 0/1`, static rendezvous at 127.0.0.1), and Slurm-style steps of two "nodes"
(SLURM_NODEID, SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS as Slurm sets them, translated by the
Slurm launcher's code: tests/slurm_tasks.py), train as one process does (every loss within
1e-5 relative, the bound docs/scale-out.md states); a checkpoint the two-node run wrote is
resumed by one process on one node."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest
from conftest import free_port, micro_run, one_torch_thread, train_losses, write_yaml
from slurm_tasks import SlurmTasks, trial_args

from harness.methods.resolve import load_run
from harness.train import train
from harness.trials import read_json

STEPS = 8


def node_run(parallel: str) -> dict[str, Any]:
    """8 sequences a step: 2 micro-batches of 2 on each of 2 ranks, one on each of 4."""
    run = micro_run(steps=STEPS, total_batch_size=8, parallel=parallel)
    return {**run, "eval": {"every": 4, "tokens": 256}}


@pytest.fixture(scope="module")
def one(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One process on one node (which ignores `parallel`), on one thread as each rank."""
    out = tmp_path_factory.mktemp("one") / "one"
    with one_torch_thread():
        summary = train(load_run(node_run("fsdp")), out)
    return {"losses": train_losses(out), "eval_loss": summary["eval_loss"]}


def assert_as_one(losses: dict[int, float], one: dict[str, Any], steps: range) -> float:
    """`losses` at `steps` are one process's within 1e-5 relative; the largest difference."""
    assert sorted(losses) == list(steps)
    assert [losses[s] for s in steps] == pytest.approx([one["losses"][s] for s in steps],
                                                       rel=1e-5, abs=0)
    return max(abs(losses[s] - one["losses"][s]) for s in steps)


def torchrun_node(config: Path, out: Path, node: int, port: int) -> subprocess.Popen:
    """One node's `torchrun` of a 2-node trial, one process on it, as a user starts it on
    each machine."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank",
           str(node), "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port",
           str(port), "-m", "harness.cli", *trial_args(config, out)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_two_torchrun_nodes_train_as_one_and_one_node_resumes_their_checkpoint(tmp_path, one):
    """fsdp over two nodes, stopped after step 2 (SIGINT to node 1's process: both save at the
    same step); one process resumes the sharded checkpoint to the end."""
    config = write_yaml(tmp_path / "run.yaml", node_run("fsdp"))
    trial, port = tmp_path / "two_nodes", free_port()
    nodes = [torchrun_node(config, trial, node, port) for node in (0, 1)]
    for line in nodes[0].stdout:  # rank 0's progress
        if line.startswith("step 2/"):
            break
    (worker,) = psutil.Process(nodes[1].pid).children()
    assert worker.environ()["RANK"] == "1" and worker.environ()["LOCAL_RANK"] == "0"
    worker.send_signal(signal.SIGINT)
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    stopped = read_json(trial / "summary.json")
    assert stopped["status"] == "interrupted" and 2 <= stopped["step"] < STEPS, outputs
    assert stopped["processes"] == 2
    diff = assert_as_one(train_losses(trial), one, range(1, stopped["step"] + 1))
    resumed = train(load_run(node_run("fsdp")), trial)  # here: one process, one node
    assert (resumed["status"], resumed["processes"]) == ("ok", 1)
    diff = max(diff, assert_as_one(train_losses(trial), one, range(1, STEPS + 1)))
    assert resumed["eval_loss"] == pytest.approx(one["eval_loss"], rel=1e-5)
    print(f"2 torchrun nodes to step {stopped['step']}, resumed by 1 process: "
          f"max |loss - one process's| = {diff:.1e}")


@pytest.mark.parametrize(("parallel", "per_node"), [("ddp", 1), ("fsdp", 2)])
def test_a_slurm_step_on_two_nodes_trains_as_one(tmp_path, one, parallel, per_node):
    """2 nodes × `per_node` tasks: the Slurm launcher gives each task's trial the rank Slurm
    numbered it, its place on its node, and node 0 as rank 0's address."""
    config = write_yaml(tmp_path / "run.yaml", node_run(parallel))
    proc = SlurmTasks(trial_args(config, tmp_path / "t"), nodes=2, per_node=per_node)
    world = 2 * per_node
    assert [e["RANK"] for e in proc.envs] == [str(r) for r in range(world)]
    assert [e["LOCAL_RANK"] for e in proc.envs] == [str(r % per_node) for r in range(world)]
    assert {(e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"], e["MASTER_ADDR"]) for e in proc.envs} == {
        (str(world), str(per_node), "localhost")}
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output
    summary = read_json(tmp_path / "t" / "summary.json")
    assert (summary["status"], summary["processes"]) == ("ok", world)
    diff = assert_as_one(train_losses(tmp_path / "t"), one, range(1, STEPS + 1))
    assert summary["eval_loss"] == pytest.approx(one["eval_loss"], rel=1e-5)
    print(f"Slurm-style 2 nodes x {per_node} tasks, {parallel}: "
          f"max |loss - one process's| = {diff:.1e}")
