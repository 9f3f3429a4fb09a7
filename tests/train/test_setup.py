"""The trainer's setup steps (harness/train/setup.py), one test each, and the trainer's own
resume, meters and hooks: each checked against values worked out by hand or real tensors."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import micro_run

from harness.methods.resolve import load_run
from harness.modifiers.recompute import decoder_layers
from harness.train import Trainer, checkpointing, setup, train
from harness.trials import Records, rng_state


def run_of(method: str = "full", memory: dict[str, Any] | None = None, **train: Any) -> Any:
    return load_run({**micro_run(**train), "method": {"name": method},
                     **({"memory": memory} if memory else {})})


def built(run: Any) -> tuple[torch.nn.Module, Any, Any]:
    """The model step's output on the CPU, with the join step's batch shape."""
    steps, device = setup.join(run)
    return setup.model(run, steps, device)


def test_join_splits_the_step_into_micro_batches_on_this_device():
    steps, device = setup.join(run_of(batch_size=2, total_batch_size=8))
    assert (steps.world, steps.micro_batch, steps.accumulation) == (1, 2, 4)  # 8 = 2 × 4 × 1
    assert device.type == "cpu"


def test_model_is_seeded_two_builds_equal_bitwise_and_another_seed_differs():
    first, second = built(run_of())[0], built(run_of())[0]
    other = built(run_of().model_copy(update={"seed": 1234}))[0]
    a, b, c = first.state_dict(), second.state_dict(), other.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.layers.0.self_attn.q_proj.weight"],
                           c["model.layers.0.self_attn.q_proj.weight"])


def test_budget_turns_epochs_into_steps_and_leaves_steps_alone():
    run = run_of(steps=6)
    assert setup.budget(run, SimpleNamespace(steps_per_epoch=5)) is run
    t = run.train.model_copy(update={"steps": None, "epochs": 3})
    by_epochs = run.model_copy(update={"train": t})
    assert setup.budget(by_epochs, SimpleNamespace(steps_per_epoch=5)).train.steps == 15


def test_method_says_a_rank_that_saves_nothing():
    run = load_run({**micro_run(), "method": {"name": "lora", "rank": 64}})  # hidden is 64
    model = built(run)[0]
    chosen, warnings = setup.method(run, setup.join(run)[0], model)
    assert chosen.name == "lora"
    assert len(warnings) == 1 and warnings[0].startswith("method.rank 64 is at or above")
    assert setup.method(run_of("lora"), setup.join(run)[0], model)[1] == []


def test_modifiers_cast_after_prepare_and_wrap_the_decoder_layers():
    run = run_of("lora", precision="bf16-true")
    model, chosen = built(run)[0], setup.method(run, setup.join(run)[0], built(run)[0])[0]
    prepared, offloader = setup.modifiers(model, chosen, run, torch.device("cpu"))
    adapters = [p for n, p in prepared.named_parameters() if "lora_" in n]
    assert adapters and {p.dtype for p in prepared.parameters()} == {torch.bfloat16}
    assert offloader is None
    assert all("checkpointed" not in layer.forward.__name__ for layer in decoder_layers(prepared))

    run = run_of(memory={"recompute": "full"})
    model, chosen = built(run)[0], setup.method(run, setup.join(run)[0], built(run)[0])[0]
    prepared, _ = setup.modifiers(model, chosen, run, torch.device("cpu"))
    layers = decoder_layers(prepared)
    assert len(layers) == 2 and all(layer.forward.__name__ == "checkpointed" for layer in layers)


def test_parallelize_shards_nothing_in_one_process():
    run = run_of(parallel="fsdp")
    model = built(run)[0]
    before = {n: p for n, p in model.named_parameters()}
    assert setup.parallelize(model, run, setup.join(run)[0], torch.device("cpu")) is False
    assert all(p is before[n] for n, p in model.named_parameters())  # the same tensors


@pytest.mark.parametrize("method", ["full", "lora", "galore"])
def test_optimizer_groups_hold_every_trainable_parameter_once(method):
    run = run_of(method)
    steps = setup.join(run)[0]
    model = built(run)[0]
    chosen = setup.method(run, steps, model)[0]
    model = setup.modifiers(model, chosen, run, torch.device("cpu"))[0]
    opt = setup.optimizer(chosen, model, run, torch.device("cpu"))[0]
    grouped = [id(p) for group in opt.param_groups for p in group["params"]]
    trainable = [id(p) for p in model.parameters() if p.requires_grad]
    assert len(grouped) == len(set(grouped)) == len(trainable)
    assert set(grouped) == set(trainable)
    if method == "lora":  # frozen base weights: fewer tensors train than exist
        assert len(trainable) < len(list(model.parameters()))


def test_optimizer_precision_autocasts_bf16_mixed():
    """Under every strategy: fsdp gathers float32 weights and autocasts as one process does."""
    run = run_of(precision="bf16-mixed")
    model = built(run)[0]
    chosen = setup.method(run, setup.join(run)[0], model)[0]
    assert setup.optimizer(chosen, model, run, torch.device("cpu"))[1].dtype == torch.bfloat16


def test_schedule_warms_up_then_decays_by_cosine_to_the_floor():
    # lr 0.003, warmup 2 of 6 steps, cosine to min_lr_ratio 0.1
    run = run_of(warmup_steps=2, steps=6, min_lr_ratio=0.1)
    chosen = setup.method(run, setup.join(run)[0], torch.nn.Linear(2, 2))[0]
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.003)
    sched = setup.schedule(opt, chosen, run)
    lrs = [opt.param_groups[0]["lr"]]
    for _ in range(6):
        opt.step()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    # step 0: 1/2 of warmup; step 1 ends it; step 4: halfway, 0.1 + 0.9 × 0.5; step 6: floor
    assert lrs[0] == pytest.approx(0.0015, rel=1e-12)
    assert lrs[1] == lrs[2] == pytest.approx(0.003, rel=1e-12)
    assert lrs[4] == pytest.approx(0.00165, rel=1e-12)
    assert lrs[6] == pytest.approx(0.0003, rel=1e-12)


def test_resume_restores_step_schedule_and_rng_from_a_short_run(tmp_path, monkeypatch):
    # the loop draws no random numbers, so the checkpoint is given a torch state that seeding
    # and building never reach: only a restore brings it back
    marked = torch.Generator().manual_seed(7).get_state()
    monkeypatch.setattr(checkpointing, "rng_state", lambda: {**rng_state(), "torch": marked})
    run = run_of(steps=6, warmup_steps=1)
    first = train(run, tmp_path, should_stop=lambda step: step == 3)
    assert (first["status"], first["step"]) == ("interrupted", 3)
    saved = Records(tmp_path, run).load_checkpoint()
    trainer = Trainer(run, Records(tmp_path, run), lambda step: False)
    try:
        assert (trainer.step, trainer.first_step, trainer.tokens) == (3, 3, saved["tokens"])
        assert torch.equal(torch.get_rng_state(), marked)
        # step 3 of 6 after 1 warmup: cosine progress 2/5
        factor = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.4))
        assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.003 * factor, rel=1e-12)
        assert trainer.grad_peak is None  # the costs came back with the checkpoint
    finally:
        trainer.close()


def test_meters_and_hooks_register_in_the_documented_order(tmp_path):
    run = run_of(memory={"offload": ["mlp"]})
    trainer = Trainer(run, Records(tmp_path, run), lambda step: False)
    try:
        names = {event: [c.__name__ for c in trainer.hooks._callbacks[event]]
                 for event in ("update", "step", "step_end", "eval")}
        assert names == {
            "update": ["_count_offloaded", "_method_step", "_count_costs", "_keep_loss"],
            "step": [],
            "step_end": ["_time", "_log", "_eval", "_checkpoint"],
            "eval": ["_prune"],
        }
        assert trainer.grad_peak is not None and trainer.first_step == 0
        assert trainer.eval_every == 3  # micro_run's eval.every
    finally:
        trainer.close()
