"""ReLoRA against the reference code (Guitaricet/relora at 176f376): dropout, random and
magnitude pruning, the two-run warm start (its LR trace, merges, fresh optimizer, resume),
and the load-time warning or refusal of cycles the reference's scheduler rejects.

The reference's code imports CUDA-only bitsandbytes and wandb, so its pure-torch pieces are
transcribed below from peft_pretraining/training_utils.py and checked against ours."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from conftest import micro_run
from test_lora import fast_run, learns, one_thread, resumes_exactly  # noqa: F401 (autouse)
from test_relora import prepared, steps

from harness.config.steps import lr_factor
from harness.errors import UserError
from harness.methods import build_method
from harness.methods.lora import adapter_params, lora_layers
from harness.methods.relora import magnitude_threshold, reset_moments
from harness.methods.resolve import load_run
from harness.train import train
from harness.trials import read_jsonl


# --- transcribed from the reference: training_utils.py, random_pruning_ / magnitude_pruning_
def reference_random_pruning_(tensor: torch.Tensor, prune_ratio: float) -> None:
    tensor.mul_(torch.rand_like(tensor) > prune_ratio)


def reference_magnitude_pruning_(tensor: torch.Tensor, prune_ratio: float) -> None:
    magnitude = torch.abs(tensor)
    threshold = torch.quantile(magnitude.flatten().to(dtype=torch.float32), prune_ratio)
    tensor.mul_((magnitude > threshold.to(dtype=tensor.dtype)).to(dtype=tensor.dtype))


# --- and _get_cosine_schedule_with_multiple_warmups_lambda (adjust_step 0)
def reference_lambda(current_step: int, *, num_training_steps: int, first_warmup_steps: int,
                     restart_warmup_steps: int, restart_every: int, min_lr_ratio: float) -> float:
    assert first_warmup_steps <= restart_every and num_training_steps % restart_every == 0
    if current_step < first_warmup_steps:
        return float(current_step) / float(max(1, first_warmup_steps))
    restart_step = current_step % restart_every
    restart_number = current_step // restart_every
    if restart_step < restart_warmup_steps and current_step >= restart_every:
        end_of_warmup_progress = float(
            restart_number * restart_every + restart_warmup_steps - first_warmup_steps
        ) / float(max(1, num_training_steps - first_warmup_steps))
        decay = 0.5 * (1.0 + math.cos(math.pi * end_of_warmup_progress))
        multiplier = min_lr_ratio + (1.0 - min_lr_ratio) * decay
        return float(restart_step) / float(max(1, restart_warmup_steps)) * multiplier
    progress = float(current_step - first_warmup_steps) / float(
        max(1, num_training_steps - first_warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


# Two runs in one: 8 full-rank steps, then 16 = 4 cycles of 4 with their own 2-step warmup.
TWO_RUNS = {"name": "relora", "warm_start_steps": 8, "reset_every": 4, "restart_warmup_steps": 2,
            "warm_start_warmup_steps": 2, "prune_ratio": 0.9}


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    data = fast_run(TWO_RUNS)
    out = tmp_path_factory.mktemp("relora_two_runs") / "straight"
    return data, out, train(load_run(data), out)


def test_dropout_acts_in_train_mode_only_and_the_merge_ignores_it():
    method, model, optimizer, ids = prepared(dropout=0.5, reset_every=4, restart_warmup_steps=2)
    assert all(layer.lora_dropout["default"].p == 0.5 for layer in lora_layers(model))
    model.train()
    steps(method, model, optimizer, ids, 3)  # the adapters learn: B·A ≠ 0, dropout shows
    with torch.no_grad():
        assert not torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits)
        model.eval()
        before = model(input_ids=ids).logits
        assert torch.equal(before, model(input_ids=ids).logits)
        weights = [layer.get_base_layer().weight.clone() for layer in lora_layers(model)]
        deltas = [layer.get_delta_weight("default") for layer in lora_layers(model)]
    method.on_step(4, model, optimizer)
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits, before, atol=1e-5, rtol=0)
    for layer, w, d in zip(lora_layers(model), weights, deltas, strict=True):
        assert torch.allclose(layer.get_base_layer().weight, w + d, atol=1e-7)


@pytest.mark.parametrize("ratio", [0.5, 0.9, 0.999])
def test_magnitude_pruning_equals_the_references_on_real_moments(ratio):
    method, model, optimizer, ids = prepared(prune_ratio=ratio, reset_every=1000)
    steps(method, model, optimizer, ids, 3)
    params = adapter_params(model)
    expected = {(id(p), k): optimizer.state[p][k].clone()
                for p in params for k in ("exp_avg", "exp_avg_sq")}
    for moment in expected.values():
        reference_magnitude_pruning_(moment, ratio)
    zeroed = reset_moments(optimizer, params, method.config)
    for p in params:
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(optimizer.state[p][key], expected[id(p), key])
    assert zeroed == pytest.approx(ratio, abs=0.01)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_magnitude_threshold_is_the_references_quantile_with_ties_and_low_precision(dtype):
    torch.manual_seed(0)
    tied = torch.randint(-4, 5, (37, 11)).to(dtype)  # many equal magnitudes, zeros among them
    smooth = torch.randn(1001, dtype=dtype)
    for tensor in (tied, smooth):
        for ratio in (0.0, 0.1, 0.5, 0.9, 0.999, 1.0):
            want = torch.quantile(tensor.abs().flatten().float(), ratio).to(dtype)
            assert magnitude_threshold(tensor, ratio) == want
            ours, theirs = tensor.clone(), tensor.clone()
            reset_moments(SimpleNamespace(state={0: {"exp_avg": ours}}), [0],
                          SimpleNamespace(optimizer_reset="prune", prune="magnitude",
                                          prune_ratio=ratio))
            reference_magnitude_pruning_(theirs, ratio)
            assert torch.equal(ours, theirs)


def test_random_pruning_equals_the_references_and_keeps_one_minus_ratio():
    method, model, optimizer, ids = prepared(prune="random", prune_ratio=0.9, reset_every=1000)
    steps(method, model, optimizer, ids, 3)
    params = adapter_params(model)
    old = [optimizer.state[p][k].clone() for p in params for k in ("exp_avg", "exp_avg_sq")]
    expected = [m.clone() for m in old]
    torch.manual_seed(7)
    for moment in expected:  # the reference's order: each parameter, then its state keys
        reference_random_pruning_(moment, 0.9)
    torch.manual_seed(7)
    zeroed = reset_moments(optimizer, params, method.config)
    new = [optimizer.state[p][k] for p in params for k in ("exp_avg", "exp_avg_sq")]
    assert all(torch.equal(n, e) for n, e in zip(new, expected, strict=True))
    kept = [n != 0 for n in new]
    assert all(torch.equal(n[k], o[k]) for n, o, k in zip(new, old, kept, strict=True))
    assert zeroed == pytest.approx(0.9, abs=0.01)  # each kept with probability 0.1
    big = torch.ones(200_000)
    reset_moments(SimpleNamespace(state={0: {"exp_avg": big}}), [0], method.config)
    assert float(big.mean()) == pytest.approx(0.1, abs=0.003)  # not the largest: at random


def test_two_runs_lr_trace_is_the_global_one_then_the_references_restarted_schedule():
    run = load_run({**micro_run(steps=40, warmup_steps=5),
                    "method": {"name": "relora", "warm_start_steps": 10, "reset_every": 10,
                               "restart_warmup_steps": 3, "warm_start_warmup_steps": 2}})
    method = build_method(run)
    factor = [method.check(run).lr_factor(s) for s in range(40)]
    assert factor[:10] == [lr_factor(s, run.train) for s in range(10)]
    reference = [reference_lambda(k, num_training_steps=30, first_warmup_steps=2,
                                  restart_warmup_steps=3, restart_every=10, min_lr_ratio=0.1)
                 for k in range(30)]
    assert factor[10:] == pytest.approx(reference, abs=1e-12)
    assert factor[10] == factor[20] == factor[30] == 0.0 and factor[11] == 0.5
    assert factor[21] == pytest.approx(reference_lambda(13, num_training_steps=30,
        first_warmup_steps=2, restart_warmup_steps=3, restart_every=10, min_lr_ratio=0.1) / 3)


def test_two_runs_merge_only_after_the_warm_start_on_the_references_steps(two_runs):
    data, out, summary = two_runs
    assert summary["status"] == "ok" and learns(out)
    events = [r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "event"]
    # the switch at 8; merges after steps k = 5, 9, 13 of the ReLoRA phase (8 + k)
    assert [e["step"] for e in events] == [8, 13, 17, 21]
    assert events[0]["warm_start"] == "done" and "relora_merge" not in events[0]
    assert [e["relora_merge"] for e in events[1:]] == [1, 2, 3]
    assert all(e["optimizer_reset"] == "prune 0.9" for e in events[1:])
    lrs = {r["step"]: r["lr"] for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"}
    run = load_run(data)
    method = build_method(run)
    assert [lrs[s] for s in range(1, 25)] == pytest.approx(
        [run.train.lr * method.check(run).lr_factor(s - 1) for s in range(1, 25)])
    assert lrs[9] == lrs[13] == lrs[17] == lrs[21] == 0.0  # each merge follows a step at LR 0


@pytest.mark.parametrize("stop", [6, 8, 14])  # before the switch, at it, past a merge
def test_two_runs_resume_exactly_across_the_switch(two_runs, tmp_path, stop):
    data, out, _ = two_runs
    assert resumes_exactly(data, tmp_path, out, stop=stop)


def test_two_runs_train_the_base_alone_then_the_adapters_on_a_fresh_optimizer():
    spec = {"warm_start_steps": 2, "reset_every": 11, "restart_warmup_steps": 2}  # 24 = 2 + 22
    method, model, optimizer, ids = prepared(**spec)
    base = [layer.get_base_layer().weight for layer in lora_layers(model)]
    adapters = adapter_params(model)
    start = [p.clone() for p in base + adapters]
    steps(method, model, optimizer, ids, 1)
    mid_warm_start = optimizer.state_dict()
    steps(method, model, optimizer, ids, 1, first=2)
    changed = [not torch.equal(p, s) for p, s in zip(base + adapters, start, strict=True)]
    assert all(changed[: len(base)]) and not any(changed[len(base):])  # no adapter trained
    assert len(optimizer.state) == 0  # the reference's new optimizer, from step 0
    assert not any(w.requires_grad for w in base) and all(p.requires_grad for p in adapters)
    steps(method, model, optimizer, ids, 1, first=3)
    assert all(int(s["step"]) == 1 for s in optimizer.state.values())
    assert set(map(id, optimizer.state)) >= set(map(id, adapters))
    after = optimizer.state_dict()
    for saved, done in ((mid_warm_start, False), (after, True)):
        method, model, optimizer, _ = prepared(**spec)  # a resume rebuilds both
        optimizer.load_state_dict(saved)
        layers = lora_layers(model)
        assert all(layer.get_base_layer().weight.requires_grad != done for layer in layers)
        assert all(p.requires_grad == done for p in adapter_params(model))


@pytest.mark.parametrize(("train_", "said"), [
    ({"steps": 60000, "warmup_steps": 6000}, ["1 merge(s) fall inside train.warmup_steps 6000",
                                             "use e.g. reset_every 6000"]),
    ({"steps": 100000, "warmup_steps": 10000}, ["1 merge(s) fall inside", "reset_every 10000"]),
])
def test_merges_inside_the_warmup_or_a_cut_cycle_are_said_at_load(train_, said):
    run = load_run({**micro_run(**train_), "method": {"name": "relora", "reset_every": 5000}})
    warning = build_method(run).check(run).warning
    assert warning.startswith("method.reset_every 5000: ") and all(s in warning for s in said)
    fine = load_run({**micro_run(steps=60000, warmup_steps=6000),
                     "method": {"name": "relora", "reset_every": 6000}})
    assert build_method(fine).check(fine).warning is None


def test_the_warning_is_kept_in_the_summary(tmp_path):
    data = {**micro_run(steps=3, warmup_steps=2),
            "method": {"name": "relora", "reset_every": 2, "restart_warmup_steps": 1}}
    summary = train(load_run(data), tmp_path / "run")
    assert any("not a whole number of cycles (the last has 1 steps)" in w
               for w in summary["warnings"])


@pytest.mark.parametrize(("method", "train_", "match"), [
    ({"warm_start_steps": 10, "reset_every": 6}, {}, r"20 must be a whole number of reset_every"
                                                    r" 6 cycles.*use e.g. reset_every 5"),
    ({"warm_start_steps": 10, "reset_every": 10}, {"warmup_steps": 11}, "must fit in the first"),
    ({"warm_start_steps": 10, "reset_every": 10}, {"schedule": "linear"}, "schedule cosine"),
])
def test_two_runs_refuse_what_the_references_scheduler_asserts(method, train_, match):
    spec = {"name": "relora", "restart_warmup_steps": 2, **method}
    with pytest.raises(UserError, match=match):
        load_run({**micro_run(steps=30, **train_), "method": spec})
    load_run({**micro_run(steps=30, **train_), "method": {**spec, "warm_start": "joint"}})
