"""HSDP (`train.parallel: hsdp`): 4 processes as 2 shard groups of 2 train as one process does,
within fsdp's bounds (tests/train/test_fsdp.py), each rank holding the rows of its place in its
group; a shard group that does not divide the processes is refused before any joining.

One launch trains every case (tests/train/hsdp_cases.py): a launch per case costs more than the
cases themselves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from conftest import free_port, micro_run, write_yaml
from ranks import Ranks
from test_fsdp import assert_same_losses, losses, run_procs, state, stop_after

from harness.errors import UserError
from harness.methods.resolve import load_run
from harness.train import setup, train
from harness.trials import read_json

# The methods whose ranks share work or states beyond their rows: GaLore's SVDs shared out and
# left-side sums, APOLLO's norms summed over a weight's rows, Muon's Newton–Schulz shared out,
# 8-bit Adam's blocks of each rank's rows.
METHODS = {"full": {"name": "full"},
           "galore": {"name": "galore", "rank": 8, "update_proj_gap": 3},
           "apollo": {"name": "apollo", "rank": 8, "update_proj_gap": 3},
           "muon": {"name": "muon"},
           "adam8bit": {"name": "adam8bit", "min_8bit_size": 256}}  # fmt: skip
# fsdp's bounds on the final weights against one process (tests/train/test_fsdp.py
# WEIGHT_ATOL, where each is derived), the same reductions in the same order within a group
WEIGHT_ATOL = {"full": 5e-5, "galore": 3e-4, "apollo": 5e-5, "muon": 2e-2, "adam8bit": 2e-3}


def hsdp_run(method: dict, **train_keys) -> dict:
    """8 sequences a step in micro-batches of 2: one a rank; 2 groups of 2."""
    keys = {"total_batch_size": 8, **train_keys}
    data = micro_run(steps=6, parallel="hsdp", shard_group=2, keep_final="full", **keys)
    return {**data, "method": method, "eval": {"every": 3, "tokens": 256}}


@pytest.fixture(scope="module")
def hsdp_trained(tmp_path_factory) -> Path:
    """Each method, full AdamW accumulating 2 micro-batches and layer-wise GaLore, trained on
    2 x 2 ranks."""
    folder = tmp_path_factory.mktemp("hsdp")
    runs = {name: hsdp_run(method) for name, method in METHODS.items()}
    runs["full-accumulating"] = hsdp_run(METHODS["full"], total_batch_size=16)
    # each hook steps its weight's reduced shard, after the replicas' all-reduce
    runs["galore-layerwise"] = {**hsdp_run(METHODS["galore"]), "memory": {"layerwise": True}}
    paths = [write_yaml(folder / f"{name}.yaml", data) for name, data in runs.items()]
    done = Ranks([str(p) for p in paths], 4, free_port(), "hsdp_cases")
    log, _ = done.communicate(timeout=900)
    assert done.returncode == 0, log
    return folder


@pytest.mark.parametrize("case", [*METHODS, "full-accumulating", "galore-layerwise"])
def test_hsdp_2x2_trains_as_one_process(hsdp_trained, tmp_path, case):
    """Losses and evaluations within fsdp's 1e-5; the final weights, read whole from the
    checkpoint each group wrote its rows of once, within fsdp's bound for the method; each
    rank holds ceil(m / 2) rows of every weight (its place in its group of 2, not among 4)."""
    data = yaml.safe_load((hsdp_trained / f"{case}.yaml").read_text())
    one = train(load_run(data), tmp_path / "one")
    assert one["status"] == "ok"
    many = hsdp_trained / case
    a, b = losses(tmp_path / "one"), losses(many)
    assert [x[:2] for x in a] == [x[:2] for x in b] and len(a) == 8  # 6 steps, 2 evaluations
    assert [x[2] for x in b] == pytest.approx([x[2] for x in a], rel=1e-5, abs=0)
    whole = state(tmp_path / "one")["model"]
    places = json.loads((many / "ranks.json").read_text())
    # ranks 0, 1 form the first group and 2, 3 the second: places 0, 1, 0, 1 among 2
    assert [p[:2] for p in places] == [[2, 0], [2, 1], [2, 0], [2, 1]]
    first = sum(-(-v.shape[0] // 2) * (v.numel() // v.shape[0]) for v in whole.values())
    total = sum(v.numel() for v in whole.values())
    assert places[0][2] == places[2][2] == first  # a group's first rows, once a group
    assert places[0][2] + places[1][2] == total
    theirs = state(many)["model"]
    atol = WEIGHT_ATOL[case.split("-")[0]]
    for key, value in whole.items():
        torch.testing.assert_close(theirs[key], value, rtol=0, atol=atol)
    apart = max(float((theirs[k] - v).abs().max()) for k, v in whole.items())
    print(f"{case}: losses {max(abs(y[2] / x[2] - 1) for x, y in zip(a, b, strict=True)):.1e} "
          f"relative, weights {apart:.1e}")  # pytest -s: the figures of docs/scale-out.md


def test_a_trial_stopped_as_2x2_resumes_on_2_processes(tmp_path):
    """Stopped at step >= 2 on 4 processes as 2 groups of 2 (a 2-D mesh, each group's ranks
    writing their rows once) and resumed by the same config on 2 (one group: a 1-D mesh), each
    rank reading the rows it now holds: the losses are the unbroken one-process run's within
    fsdp's 1e-5. The same folder resumed under train.parallel fsdp is another config's,
    refused in one line before anything is read or written."""
    data = hsdp_run(METHODS["full"])
    data["train"]["steps"] = 10
    out = tmp_path / "trial"
    stopped = stop_after(data, out, 4, step=2)
    assert 2 <= stopped < 10
    fsdp = {**data, "train": {k: v for k, v in data["train"].items() if k != "shard_group"}}
    fsdp["train"]["parallel"] = "fsdp"
    with pytest.raises(UserError, match=r"state\.pt: written by a different config"):
        train(load_run(fsdp), out)
    output = run_procs(data, out, 2)
    assert f"resumed from {out / 'checkpoint' / 'state.pt'} at step {stopped}" in output
    assert read_json(out / "summary.json")["step"] == 10
    train(load_run(data), tmp_path / "one")
    assert_same_losses(tmp_path / "one", out)
    apart = max(abs(y[2] / x[2] - 1) for x, y in zip(losses(tmp_path / "one"), losses(out),
                                                     strict=True))
    print(f"hsdp 2 x 2 stopped at step {stopped}, resumed on 2: losses {apart:.1e} relative")


@pytest.mark.parametrize(("shard_group", "local", "said"), [
    (3, "4", "train.shard_group: 3 does not divide the 4 processes (WORLD_SIZE) into whole "
             "groups; allowed: 1, 2, 4"),
    (None, "3", "train.shard_group: unset, so a node's 3 processes (LOCAL_WORLD_SIZE), does "
                "not divide the 4 processes (WORLD_SIZE) into whole groups; allowed: 1, 2, 4"),
])
def test_a_shard_group_that_does_not_divide_the_world_is_refused_before_joining(
        monkeypatch, shard_group, local, said):
    """Refused by the step's shape, which `setup.join` checks before the process group: a
    rank joining alone would wait for peers that never come."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    keys = {"shard_group": shard_group} if shard_group else {}
    run = load_run({**micro_run(total_batch_size=8, parallel="hsdp", **keys)})
    with pytest.raises(UserError) as e:
        setup.join(run)
    assert str(e.value) == said


def test_shard_group_belongs_to_hsdp():
    with pytest.raises(UserError, match="shard_group applies to parallel hsdp only"):
        load_run(micro_run(parallel="fsdp", shard_group=2))
