"""A run's step arithmetic (harness/config/steps.py): computed once, from the config and the
number of processes, and the same for the trainer, the method and the estimator."""

from __future__ import annotations

import pytest
import yaml
from conftest import micro_run

from harness.config.steps import Steps
from harness.cost.activations import activations
from harness.cost.estimate import estimate_run, vocab_size
from harness.errors import UserError
from harness.methods import build_method, memory_of
from harness.methods.resolve import load_run
from harness.models import param_shapes
from harness.sweep.plan.expand import estimate_sweep, load_sweep

LAYERWISE = {  # the two layer-wise forms whose gradient bytes depend on accumulation
    "galore_layerwise": ({"name": "galore", "rank": 8}, True),
    "qgalore": ({"name": "qgalore", "rank": 8}, False),
}


def layerwise_run(case: str, total_batch_size: int = 4):
    method, layerwise = LAYERWISE[case]
    data = micro_run(steps=1, total_batch_size=total_batch_size)
    return load_run({**data, "method": method, "memory": {"layerwise": layerwise}})


def test_the_global_batch_is_split_over_the_processes():
    t = load_run(micro_run(batch_size=2, total_batch_size=8)).train
    one, two = Steps.of(t, 32), Steps.of(t, 32, 2)
    assert (one.world, one.micro_batch, one.accumulation) == (1, 2, 4)
    assert (two.world, two.micro_batch, two.accumulation) == (2, 2, 2)
    assert one.global_accumulation == two.global_accumulation == t.accumulation == 4
    assert one.sequences == two.sequences == t.total_batch_size == 8
    assert one.tokens == two.tokens == 8 * 32


def test_a_global_batch_that_does_not_split_over_the_processes_is_refused():
    t = load_run(micro_run(batch_size=2, total_batch_size=8)).train
    with pytest.raises(UserError, match=r"over 3 processes \(WORLD_SIZE\); use a multiple of 6"):
        Steps.of(t, 32, 3)
    assert Steps.of(t, 32, 4).accumulation == 1


@pytest.mark.parametrize("case", LAYERWISE)
def test_a_layerwise_estimate_counts_one_process_s_micro_batches(case):
    """4 sequences of 2 over 2 processes: one micro-batch each, so every gradient is freed in
    its own backward (the largest is the peak); one process accumulates two (all of them)."""
    run = layerwise_run(case)
    shapes = param_shapes(run.model, vocab_size(run.task.tokenizer))
    sizes = [s.numel() for s in shapes.values()]
    assert estimate_run(run)["grad_bytes"] == 4 * sum(sizes)
    assert estimate_run(run, world=2)["grad_bytes"] == 4 * max(sizes)
    method = build_method(run, Steps.of(run.train, run.task.seq_len, 2))
    assert method.steps.accumulation == 1
    assert activations(run, shapes, memory_of(method), "cpu").micro_batches == 1


def test_estimate_takes_the_process_count_from_the_sweep_s_launcher(tmp_path):
    data = {k: v for k, v in micro_run(steps=1, total_batch_size=4).items() if k != "method"}
    sweep = {**data, "methods": {"galore": {"rank": 8}}, "memory": {"layerwise": True}}
    path = tmp_path / "sweep.yaml"
    records = {}
    for ranks in (1, 2):
        launcher = {"kind": "submitit-local", "tasks_per_node": ranks}
        path.write_text(yaml.safe_dump({**sweep, "launcher": launcher}))
        (records[ranks],) = estimate_sweep(load_sweep(path, {}))
    assert records[2]["grad_bytes"] < records[1]["grad_bytes"]
    assert records[2]["grad_bytes"] == estimate_run(layerwise_run("galore_layerwise"),
                                                    world=2)["grad_bytes"]
    path.write_text(yaml.safe_dump({**sweep, "launcher": {"kind": "submitit-local",
                                                          "tasks_per_node": 3}}))
    with pytest.raises(UserError, match=r"3 processes \(launcher: nodes x tasks_per_node\)"):
        estimate_sweep(load_sweep(path, {}))


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_lr_schedule_warms_up_linearly_then_decays_to_the_floor(schedule):
    from harness.config import TrainConfig
    from harness.config.steps import lr_factor

    t = TrainConfig(steps=12, warmup_steps=4, schedule=schedule, min_lr_ratio=0.1)
    factors = [lr_factor(step, t) for step in range(13)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]  # step counts from 0: the 4th reaches 1
    assert factors[4] == 1.0  # decay starts from the peak
    if schedule == "constant":
        assert set(factors[4:]) == {1.0}
        return
    assert factors[12] == pytest.approx(0.1)  # the floor at the last step, and after it
    assert lr_factor(20, t) == pytest.approx(0.1)
    assert all(later <= factors[k] for k, later in enumerate(factors[5:], 4))  # never rises
    halfway = 0.1 + 0.9 * 0.5  # cosine and linear agree at the middle of the decay
    assert factors[8] == pytest.approx(halfway)
    if schedule == "linear":
        assert factors[6] == pytest.approx(0.1 + 0.9 * 0.75)
    else:
        assert factors[6] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + 2**-0.5))
