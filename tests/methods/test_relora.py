"""ReLoRA: jagged schedule, function-preserving merges, moment pruning, warm start, resume."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import assert_estimate_matches, micro_model, micro_run
from test_lora import (
    VOCAB,
    adapter_count,
    estimate_and_measure,
    fast_run,
    learns,
    non_target_count,
    one_thread,  # noqa: F401  (autouse: these tests run on one thread too)
    resumes_exactly,
)

from harness.config.steps import lr_factor
from harness.methods import build_memory, build_method, optimizer_for
from harness.methods.lora import adapter_params, lora_layers
from harness.methods.relora import reset_moments
from harness.methods.resolve import load_run
from harness.models import param_shapes
from harness.train import train
from harness.train.pretrain import loss_sum
from harness.trials import read_jsonl

SPEC = {
    "name": "relora",
    "reset_every": 8,
    "restart_warmup_steps": 3,
    "warm_start_steps": 4,
    "prune_ratio": 0.9,
    "warm_start": "joint",
}


def prepared(**params: Any):
    """A ReLoRA-wrapped micro model, its optimizer and method, plus a fixed batch."""
    run = load_run(fast_run({"name": "relora", **params}))
    method = build_method(run)
    model = method.prepare(micro_model(seed=0), run)
    ids = torch.randint(VOCAB, (2, 16))
    return method, model, optimizer_for(method, model, run), ids


def steps(method, model, optimizer, ids, n: int, first: int = 1) -> None:
    for step in range(first, first + n):
        loss_sum(model, ids, ids).backward()
        optimizer.step()
        method.on_step(step, model, optimizer)
        optimizer.zero_grad()


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    data = fast_run(SPEC)
    out = tmp_path_factory.mktemp("relora") / "straight"
    return data, out, train(load_run(data), out)


def test_relora_learns_merges_and_logs_the_events(straight):
    _, out, summary = straight
    assert summary["status"] == "ok" and learns(out)
    events = [r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "event"]
    assert [e["step"] for e in events] == [4, 8, 16, 24]
    assert events[0]["warm_start"] == "done"
    assert [e["relora_merge"] for e in events[1:]] == [1, 2, 3]
    assert all(e["optimizer_reset"] == "prune 0.9" for e in events[1:])
    assert all(e["moments_zeroed"] == pytest.approx(0.9, abs=0.01) for e in events[1:])


def test_relora_counts_and_estimate_with_warm_start_on_micro(straight):
    data, _, summary = straight
    run = load_run(data)
    adapters = adapter_count("llama_micro", 8)
    # the counts are taken after step 1, inside the warm start: the targets train too
    targets = sum(s.numel() for n, s in param_shapes(run.model, VOCAB).items() if "proj" in n)
    non_targets = non_target_count("llama_micro", VOCAB)
    assert summary["trainable_params"] == adapters + non_targets + targets
    estimate = build_memory(run).estimate(param_shapes(run.model, VOCAB), run)
    assert_estimate_matches(estimate, summary)


def test_relora_resumes_exactly_across_warm_start_and_merges(straight, tmp_path):
    data, out, _ = straight
    assert resumes_exactly(data, tmp_path, out, stop=10)  # past the warm start and a merge


@pytest.mark.parametrize(
    "warm_start",
    [{}, {"warm_start_steps": 2, "warm_start": "joint"},
     {"warm_start_steps": 2, "reset_every": 4, "restart_warmup_steps": 1}],  # two runs: 6 = 2 + 4
)
def test_relora_estimate_equals_the_real_tensors_on_60m(warm_start):
    estimate, measured = estimate_and_measure(
        {"name": "relora", "rank": 16, **warm_start}, "llama_60m", 32000
    )
    assert estimate == measured


def test_schedule_drops_at_each_merge_and_ramps_back_to_the_global_cosine():
    run = load_run(
        {
            **micro_run(steps=100, warmup_steps=10),
            "method": {"name": "relora", "reset_every": 30, "restart_warmup_steps": 5},
        }
    )
    method = build_method(run)
    factor = [method.check(run).lr_factor(s) for s in range(100)]
    cosine = [lr_factor(s, run.train) for s in range(100)]
    assert factor[:30] == cosine[:30]  # warmup and cosine untouched before the first merge
    for reset in (30, 60, 90):
        ramp = factor[reset : reset + 5]
        assert ramp[0] == pytest.approx(cosine[reset + 4] / 5) and ramp[0] < 0.2 * cosine[reset]
        assert ramp == pytest.approx([cosine[reset + 4] * k / 5 for k in range(1, 6)])
        assert factor[reset + 4 : reset + 30] == cosine[reset + 4 : reset + 30]


def test_both_factors_get_gradients_at_step_1_and_the_model_starts_unchanged():
    base = micro_model(seed=0)
    _, model, _, ids = prepared()
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits, base(input_ids=ids).logits, atol=1e-5)
    loss_sum(model, ids, ids).backward()
    assert all(p.grad.abs().sum() > 0 for p in adapter_params(model))
    _, model, _, ids = prepared(init="lora")  # the reference init: A waits for B
    loss_sum(model, ids, ids).backward()
    grads = adapter_params(model)
    assert not any(a.grad.any() for a in grads[0::2]) and all(b.grad.any() for b in grads[1::2])


@pytest.mark.parametrize("init", ["orthogonal", "lora"])
def test_merge_keeps_the_function_and_redraws_the_adapters(init):
    method, model, optimizer, ids = prepared(reset_every=4, restart_warmup_steps=2, init=init)
    steps(method, model, optimizer, ids, 3)
    layers = lora_layers(model)
    weights = [layer.get_base_layer().weight.clone() for layer in layers]
    deltas = [layer.get_delta_weight("default") for layer in layers]
    adapters = [p.clone() for p in adapter_params(model)]
    held = set(map(id, adapter_params(model)))
    with torch.no_grad():
        before = model(input_ids=ids).logits
    event = method.on_step(4, model, optimizer)
    assert event["relora_merge"] == 1
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits, before, atol=1e-5, rtol=0)
    for layer, w, d in zip(layers, weights, deltas, strict=True):
        assert d.abs().max() > 1e-3  # the adapters had learnt something to merge
        assert torch.allclose(layer.get_base_layer().weight, w + d, atol=1e-7)
        assert layer.get_delta_weight("default").abs().max() < 1e-6
    assert all(not torch.equal(p, c) for p, c in zip(adapter_params(model), adapters, strict=True))
    assert set(map(id, adapter_params(model))) == held  # the optimizer still holds them


def test_optimizer_reset_prunes_the_smallest_moments_or_zeroes_them():
    method, model, optimizer, ids = prepared(prune_ratio=0.9, reset_every=1000)
    steps(method, model, optimizer, ids, 3)
    params = adapter_params(model)
    moments = {
        (id(p), k): optimizer.state[p][k].clone() for p in params for k in ("exp_avg", "exp_avg_sq")
    }
    assert reset_moments(optimizer, params, method.config) == pytest.approx(0.9, abs=0.002)
    for p in params:
        for key in ("exp_avg", "exp_avg_sq"):
            old, new = moments[id(p), key].flatten(), optimizer.state[p][key].flatten()
            kept = new != 0
            assert int(kept.sum()) == old.numel() - int(0.9 * old.numel())
            assert torch.equal(new[kept], old[kept])  # survivors keep their values
            assert old[~kept].abs().max() <= old[kept].abs().min()  # the smallest went
        assert int(optimizer.state[p]["step"]) == 3
    method.config.optimizer_reset = "full"
    assert reset_moments(optimizer, params, method.config) == 1.0


def test_warm_start_trains_the_base_then_freezes_it_also_after_a_resume():
    method, model, optimizer, ids = prepared(warm_start_steps=2, warm_start="joint")
    base = [layer.get_base_layer().weight for layer in lora_layers(model)]
    start = [w.clone() for w in base]
    steps(method, model, optimizer, ids, 2)
    assert all(not torch.equal(w, s) for w, s in zip(base, start, strict=True))
    assert not any(w.requires_grad or w in optimizer.state for w in base)
    after = [w.clone() for w in base]
    steps(method, model, optimizer, ids, 2, first=3)
    assert all(torch.equal(w, a) for w, a in zip(base, after, strict=True))
    saved = optimizer.state_dict()
    # a resume rebuilds both
    method, model, optimizer, _ = prepared(warm_start_steps=2, warm_start="joint")
    assert all(layer.get_base_layer().weight.requires_grad for layer in lora_layers(model))
    optimizer.load_state_dict(saved)
    assert not any(layer.get_base_layer().weight.requires_grad for layer in lora_layers(model))


def test_odd_rank_with_orthogonal_init_is_refused():
    with pytest.raises(Exception, match="even rank"):
        load_run(fast_run({"name": "relora", "rank": 7}))


@pytest.mark.parametrize("decay_vectors", [False, True])
def test_vectors_are_decayed_only_with_decay_vectors(decay_vectors):
    """The reference decays every trainable parameter (its 1B config at 0.01); ours the
    matrices, and the norms too with `decay_vectors`: a norm weight with no gradient left
    shrinks by (1 - lr·λ) a step exactly then, and stays put otherwise."""
    data = fast_run({"name": "relora", "decay_vectors": decay_vectors})
    data["train"].update(weight_decay=0.1, lr=0.01)
    run = load_run(data)
    method = build_method(run)
    model = method.prepare(micro_model(seed=0), run)
    optimizer = optimizer_for(method, model, run)
    norm = model.base_model.model.model.norm.weight
    before = norm.detach().clone()
    for p in model.parameters():
        p.grad = torch.zeros_like(p) if p.requires_grad else None
    optimizer.step()
    expected = before * (1 - 0.01 * 0.1) if decay_vectors else before
    assert torch.equal(norm.detach(), expected)
