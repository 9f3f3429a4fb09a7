"""Under hsdp a rank's share is 1/(shard group) of each tensor, not 1/W: in the estimate
(`estimate_run`, `harness estimate`) and in `harness plan --gpus N --nodes M`. Expected bytes
are counted by hand from llama_micro's shapes: rank 0 holds ceil(m / G) of each tensor's m
rows; AdamW adds two moments of those and a 4-byte step counter a tensor."""

from __future__ import annotations

import json

import pytest

from harness.cli import main
from harness.config import RunConfig
from harness.cost.estimate import estimate_run
from harness.errors import UserError
from harness.methods.resolve import load_run
from harness.models import param_shapes

SHAPES = param_shapes("llama_micro", 8192)  # the sample tokenizer's vocabulary


def share(group: int) -> int:
    """Rank 0's float32 weight bytes when every tensor's rows are split over `group` ranks."""
    return 4 * sum(-(-s[0] // group) * (s.numel() // s[0]) for s in SHAPES.values())


def run(**train) -> RunConfig:
    return load_run({"model": "llama_micro", "task": {"tokenizer": "sample", "seq_len": 32},
                     "train": {"batch_size": 1, "total_batch_size": 64, **train},
                     "method": {"name": "full"}})


@pytest.mark.parametrize(("train", "local", "group"), [
    ({"parallel": "hsdp", "shard_group": 8}, None, 8),
    ({"parallel": "hsdp"}, 8, 8),  # unset: a node's processes
    ({"parallel": "hsdp", "shard_group": 4}, 8, 4),
    ({"parallel": "fsdp"}, 8, 64),  # every rank, however many a node holds
])
def test_a_ranks_share_is_its_shard_groups(train, local, group):
    record = estimate_run(run(**train), 64, local=local)
    assert record["weight_bytes"] == record["grad_bytes"] == share(group)
    assert record["optimizer_state_bytes"] == 2 * share(group) + 4 * len(SHAPES)


def test_a_shard_group_that_does_not_divide_the_launchers_processes_is_refused():
    with pytest.raises(UserError, match="train.shard_group: 3 does not divide the 64 processes "
                       r"\(launcher: nodes x tasks_per_node\)"):
        estimate_run(run(parallel="hsdp", shard_group=3), 64)


def plan_json(capfd, *flags: str) -> dict:
    assert main(["plan", "llama_micro", "--memory", "10GB", "--tokenizer", "sample",
                 "--seq-len", "32", "--token-batch", "32", "--top", "0", "--json",
                 *flags]) == 0
    return json.loads(capfd.readouterr().out)


def test_plan_on_several_nodes_shards_within_a_node(capfd):
    """4 GPUs on 2 nodes: each holds half of each weight (its node's 2 GPUs share it), where
    the same 4 GPUs on one node hold a quarter."""
    def full_weights(plan: dict) -> set[int]:
        return {c["breakdown"]["weight_bytes"] for c in plan["fits"]
                if c["label"] == "full" and c["precision"] == "bf16-mixed"}

    nodes = plan_json(capfd, "--gpus", "4", "--nodes", "2")
    assert nodes["gpus"] == 4 and nodes["nodes"] == 2
    assert full_weights(nodes) == {share(2)}
    assert full_weights(plan_json(capfd, "--gpus", "4")) == {share(4)}


def test_plan_refuses_nodes_that_do_not_hold_the_gpus_equally(capfd):
    assert main(["plan", "llama_micro", "--memory", "10GB", "--gpus", "4", "--nodes",
                 "3"]) == 2
    err = capfd.readouterr().err
    assert "--nodes 3 does not split --gpus 4 into whole nodes of equal GPUs; allowed: 1, 2, 4" \
        in err and "Traceback" not in err
