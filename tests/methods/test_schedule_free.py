"""Schedule-Free AdamW: the package's optimizer as the method builds it equals two independent
implementations (pytorch-optimizer's ScheduleFreeAdamW; the package's reference variant, which
keeps x and y as states) at y and at x, plain, layer-wise and host-offloaded; the trainer
evaluates, checkpoints and exports x and resumes exactly; the run's schedule is constant; exact
state bytes; bf16-true and paged states refused with the reason."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import (
    SAMPLE_VOCAB,
    assert_resumes_exactly,
    hf_eval_loss,
    micro_model,
    micro_run,
)

from harness.errors import UserError
from harness.methods import build_method, optimizer_for, schedule_of
from harness.methods.resolve import load_run
from harness.train import train
from harness.train.averaged import averaged
from harness.trials import TrialDir

METHOD = {"name": "schedule_free"}
BETA1 = 0.9


def sf_run(steps: int = 4, memory: dict[str, Any] | None = None, **train_keys: Any) -> dict:
    data = micro_run(steps=steps, grad_clip=None, **train_keys)
    data["eval"] = {"every": 0, "tokens": 256}
    return {**data, "method": METHOD, "memory": memory or {}}


@pytest.mark.parametrize("memory", [{}, {"layerwise": True}, {"optimizer_offload": "host"}],
                         ids=["plain", "layerwise", "host_offload"])
def test_matches_two_references_at_y_and_x(memory):
    """Six steps (three of them warmup) with weight decay on matrices; after each, the weights
    equal pytorch-optimizer's y, and inside `averaged` the reference variant's x."""
    from pytorch_optimizer import ScheduleFreeAdamW
    from schedulefree import AdamWScheduleFreeReference

    torch.manual_seed(0)
    model, po_model, ref_model = micro_model(), micro_model(), micro_model()
    po_model.load_state_dict(model.state_dict())
    ref_model.load_state_dict(model.state_dict())
    run = load_run(sf_run(lr=0.01, weight_decay=0.1, warmup_steps=3, memory=memory))
    ours = optimizer_for(build_method(run), model, run)

    def groups(m: torch.nn.Module) -> list[dict[str, Any]]:
        ps = list(m.parameters())
        return [{"params": [p for p in ps if p.dim() >= 2], "weight_decay": 0.1},
                {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}]

    po = ScheduleFreeAdamW(groups(po_model), lr=0.01, warmup_steps=3)
    ref = AdamWScheduleFreeReference(groups(ref_model), lr=0.01, warmup_steps=3)
    ref.train()
    start = [p.detach().clone() for p in model.parameters()]
    gen = torch.Generator().manual_seed(1)
    for _ in range(6):
        for p, q, r in zip(model.parameters(), po_model.parameters(), ref_model.parameters(),
                           strict=True):
            # at least 1e-2 in size: pytorch-optimizer adds 1e-15 to the second moment inside
            # the root (`apply_ams_bound`), below float32 rounding only away from zero
            g = torch.randn(p.shape, generator=gen)
            g = g.sign() * (g.abs() + 1e-2)
            p.grad, q.grad, r.grad = g.clone(), g.clone(), g.clone()  # each step divides it
        if memory.get("layerwise"):  # its hooks step as backward would
            for p in model.parameters():
                ours._update(p)
        else:
            ours.step()
        po.step()
        ref.step()
        for p, q, r in zip(model.parameters(), po_model.parameters(), ref_model.parameters(),
                           strict=True):
            # measured: bitwise equal to pytorch-optimizer's; at most 2.4e-7 from the
            # reference variant's (two float32 ulps of a norm weight near 1)
            torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(p, ref.state[r]["y"], atol=1e-6, rtol=1e-5)
    with averaged(ours, model):
        for p, r, s in zip(model.parameters(), ref_model.parameters(), start, strict=True):
            torch.testing.assert_close(p, ref.state[r]["x"], atol=1e-6, rtol=1e-5)
            assert (p - s).abs().max() > 1e-3  # x moved: the comparison compares something
    y_gap = max((p - q).abs().max() for p, q in zip(model.parameters(),
                                                       po_model.parameters(), strict=True))
    assert y_gap < 1e-6  # back at y after the block
    assert max((p - ref.state[r]["x"]).abs().max() for p, r in zip(
        model.parameters(), ref_model.parameters(), strict=True)) > 1e-3  # y is not x


def test_the_runs_schedule_is_constant_and_the_warmup_the_optimizers():
    """The LR multiplier is 1 at every step of a cosine run; the warmup goes to the optimizer."""
    run = load_run(sf_run(steps=100, warmup_steps=10, schedule="cosine", min_lr_ratio=0.1))
    method = build_method(run)
    factor = schedule_of(method, run)
    assert [factor(s) for s in (0, 5, 10, 50, 99)] == [1.0] * 5
    optimizer = optimizer_for(method, micro_model(), run)
    assert {g["warmup_steps"] for g in optimizer.param_groups} == {10}
    assert all(g["train_mode"] for g in optimizer.param_groups)  # ready to step


def test_eval_checkpoint_and_export_hold_the_averaged_weights(tmp_path):
    """The final checkpoint is written in eval mode (its weights are x, not y = x + (1 - β1)
    (z - x)), and the exported model's loss is the trial's eval loss."""
    data = {**sf_run(steps=4, keep_final="full"), "eval": {"every": 2, "tokens": 256}}
    summary = train(load_run(data), tmp_path / "t")
    assert summary["status"] == "ok", summary.get("error")
    state = torch.load(TrialDir(tmp_path / "t").checkpoint, weights_only=False)
    groups, states = state["optimizer"]["param_groups"], state["optimizer"]["state"]
    assert [g["train_mode"] for g in groups] == [False] * len(groups)
    named = list(micro_model().named_parameters())  # the groups: matrices, then vectors
    names = [n for n, p in named if p.dim() >= 2] + [n for n, p in named if p.dim() < 2]
    ids = [i for g in groups for i in g["params"]]
    gaps = [(states[i]["z"] - state["model"][n]).abs().max() * (1 - BETA1)
            for i, n in zip(ids, names, strict=True)]
    assert max(gaps) > 1e-4  # y and x differ, so which one was exported shows in the loss
    loss = hf_eval_loss(tmp_path / "t" / "model", data["task"], data["eval"]["tokens"])
    assert loss == pytest.approx(summary["eval_loss"], rel=1e-5)


def test_resume_from_a_checkpoint_of_x_equals_a_run_never_stopped(tmp_path):
    """Checkpoints every 2 steps in both runs (each switches y → x → y), evaluation between."""
    data = {**sf_run(steps=4, checkpoint_every=2), "eval": {"every": 2, "tokens": 256}}
    assert_resumes_exactly(load_run(data), tmp_path, stop=2)


def test_bench_memory_counts_what_it_estimates_peak_included(monkeypatch):
    """`harness bench memory` plain and layer-wise: weights, gradients, two float32 states an
    element and nothing else equal the estimate; the step's peak within its tolerance, the
    optimizer's float32 temporaries counted (`update_bytes`)."""
    from harness.bench import memory

    monkeypatch.setattr(memory, "METHODS", {"schedule_free": {},
                                            "schedule_free_layerwise": {"method": "schedule_free"}})
    records = memory.bench_memory("llama_micro", 3, 32, 2)
    assert len(records) == 2 * 5
    assert all(memory.met(r) for r in records), [r for r in records if not memory.met(r)]
    states = {r["name"].split("/")[2]: r["value"] for r in records
              if r["name"].endswith("optimizer_state_bytes")}
    n = sum(p.numel() for p in micro_model().parameters())
    assert states["schedule_free"] == states["schedule_free_layerwise"] == 2 * 4 * n
    assert n == 1_149_248


@pytest.mark.parametrize(("keys", "memory", "reason"), [
    ({"precision": "bf16-true"}, {}, r"its train/eval switch moves bfloat16 weights"),
    ({}, {"optimizer_offload": "paged"}, r"its z and second moments are its own tensors"),
])
def test_bf16_true_and_paged_states_are_refused_with_the_reason(keys, memory, reason):
    with pytest.raises(UserError, match=rf"^method schedule_free: {reason}"):
        load_run(sf_run(memory=memory, **keys))


def test_under_fsdp_the_forwards_around_an_evaluation_see_the_switched_shards(tmp_path):
    """fsdp on a one-rank gloo group: after two steps, a forward that leaves the root's weights
    gathered (no backward), then one inside `averaged` (x: the loss of an unsharded copy
    holding x = (y − (1 − β1)·z) / β1, the paper's relation), then one after (y again)."""
    import torch.distributed as dist

    from harness.distributed import fsdp
    from harness.modifiers.recompute import decoder_layers

    run = load_run(sf_run(lr=0.01))
    torch.manual_seed(0)
    model, plain = micro_model(), micro_model()
    ids = torch.randint(0, SAMPLE_VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        fsdp.shard(model, decoder_layers(model), torch.device("cpu"), True, False)
        optimizer = optimizer_for(build_method(run), model, run)
        for _ in range(2):
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        with torch.no_grad():
            at_y = float(model(input_ids=ids, labels=ids).loss)
            with averaged(optimizer, model):
                at_x = float(model(input_ids=ids, labels=ids).loss)
            again = float(model(input_ids=ids, labels=ids).loss)
            fsdp.regather(model)  # the root's parameters the shards again, the states' keys
            z = {id(p): fsdp.full(optimizer.state[p]["z"]) for p in model.parameters()}
            x = {n: (fsdp.full(p) - (1 - BETA1) * z[id(p)]) / BETA1
                 for n, p in model.named_parameters()}
    finally:
        dist.destroy_process_group()
    plain.load_state_dict(x)
    with torch.no_grad():
        expected = float(plain(input_ids=ids, labels=ids).loss)
    assert at_x == pytest.approx(expected, rel=1e-6)  # measured: equal; x rebuilt: rounding
    assert again == pytest.approx(at_y, rel=1e-6) and abs(at_x - at_y) > 1e-3
