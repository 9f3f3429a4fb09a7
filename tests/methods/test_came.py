"""CAME against the authors' package (came-pytorch 0.1.3, `came_pytorch.CAME`) and
pytorch-optimizer's `CAME`, through the method's own construction; bf16 weights against the
authors' package on bf16 weights (bitwise); exact state bytes, plain and layer-wise;
bf16-true states and compensation; resume; paged states refused (the memory modifiers and
precisions: tests/method_matrix.py; ddp and fsdp: tests/train/test_equality.py)."""

from __future__ import annotations

from typing import Any

import came_pytorch
import pytest
import pytorch_optimizer
import torch
from conftest import (
    SAMPLE_VOCAB,
    assert_estimate_matches,
    assert_resumes_exactly,
    micro_model,
    micro_run,
)
from package_steps import feed

from harness.errors import UserError
from harness.methods import build_method, memory_of, optimizer_for
from harness.methods.resolve import load_run
from harness.models import param_shapes
from harness.modifiers.compensation import KAHAN
from harness.train import train

# llama_micro by hand: an m×n matrix keeps m·n + 2(m + n) values (momentum, row and column
# statistics of G² and of the instability), a vector of n 2n (momentum, second moment).
# 2 layers of q, k, v, o (64×64), gate, up (176×64), down (64×176); embeddings and head
# SAMPLE_VOCAB×64; 5 norms of 64.
LAYER = 4 * (64 * 64 + 2 * 128) + 3 * (176 * 64 + 2 * 240)
STATE_VALUES = 2 * LAYER + 2 * (SAMPLE_VOCAB * 64 + 2 * (SAMPLE_VOCAB + 64)) + 5 * 2 * 64


def came_run(steps: int = 4, method: dict[str, Any] | None = None,
             memory: dict | None = None, **train_keys: Any) -> dict[str, Any]:
    data = micro_run(steps=steps, grad_clip=None, **train_keys)
    data["eval"] = {"every": 0, "tokens": 256}
    return {**data, "method": {"name": "came", **(method or {})}, "memory": memory or {}}


def decay_matrices(model: torch.nn.Module, decay: float) -> list[dict[str, Any]]:
    params = list(model.parameters())
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


CASES = {  # -> (method settings, weight decay): the paper's defaults, each setting moved
    "defaults_decay": ({}, 0.1),
    "moved_no_decay": ({"betas": (0.8, 0.99, 0.995), "eps": (1e-20, 1e-12),
                        "clip_threshold": 0.5}, 0.0),
}


@pytest.mark.parametrize("case", CASES)
def test_steps_as_the_authors_package_and_pytorch_optimizer(case):
    """20 steps at lr 1e-2 of rows of very different scales (decay on the matrices only).
    Without decay every weight is bitwise the authors' package's; with it the norms still
    are, and the matrices are within float32 rounding (decay and update added in one sum
    here, in two there): measured, the difference's norm over the motion's 1.3e-7, bound
    5e-7. pytorch-optimizer is as far from the authors' package (its momentum a lerp:
    measured 2.9e-6 element-wise at most; bound 5e-6)."""
    settings, decay = CASES[case]
    kwargs = dict(settings)
    model, ref, other = micro_model(), micro_model(), micro_model()
    run = load_run(came_run(method=settings, lr=1e-2, weight_decay=decay))
    ours = optimizer_for(build_method(run), model, run)
    eps = kwargs.pop("eps", (1e-30, 1e-16))
    authors = came_pytorch.CAME(decay_matrices(ref, decay), lr=1e-2, eps=eps, **kwargs)
    package = pytorch_optimizer.CAME(decay_matrices(other, decay), lr=1e-2, eps1=eps[0],
                                     eps2=eps[1], foreach=False, **kwargs)
    start = [p.detach().clone() for p in model.parameters()]

    def step() -> None:
        ours.step()
        authors.step()
        package.step()

    feed([model, ref, other], 20, step)
    for (name, p), q, r, p0 in zip(model.named_parameters(), ref.parameters(),
                                   other.parameters(), start, strict=True):
        assert (p - p0).abs().max() > 1e-2, name
        if p.dim() < 2 or not decay:
            assert torch.equal(p, q), name
        else:
            assert (p - q).norm() < 5e-7 * (q - p0).norm(), name
        assert (r - q).abs().max() < 5e-6, name  # the two packages' own spread


def test_bf16_weights_step_as_the_authors_package_on_bf16_weights():
    """bf16-true with float32 states (the default train.state_dtype) and round to nearest is
    what the authors' package does with bfloat16 weights (float32 gradient copy and states,
    the float32 update rounded into the weight once): bitwise, over 10 steps at lr 1e-3 with
    no decay (the package rounds its decay into the weight apart), 99.9% of weights moved."""
    model, ref = micro_model().to(torch.bfloat16), micro_model().to(torch.bfloat16)
    run = load_run(came_run(lr=1e-3, weight_decay=0.0, precision="bf16-true"))
    ours = optimizer_for(build_method(run), model, run)
    authors = came_pytorch.CAME(ref.parameters(), lr=1e-3)
    start = [p.detach().clone() for p in model.parameters()]
    gen = torch.Generator().manual_seed(1)
    for _ in range(10):
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            p.grad = torch.randn(p.shape, generator=gen).to(torch.bfloat16)
            q.grad = p.grad.clone()
        ours.step()
        authors.step()
    moved = 0
    for (name, p), q, p0 in zip(model.named_parameters(), ref.parameters(), start, strict=True):
        assert all(s.dtype == torch.float32 for s in ours.state[p].values()
                   if isinstance(s, torch.Tensor)), name
        assert torch.equal(p, q), name
        moved += int((p != p0).sum())
    assert moved > 0.99 * sum(p.numel() for p in model.parameters())


def test_state_bytes_of_llama_micro_counted_and_estimated():
    """The hand count above, float32, counted from the real tensors after a step and predicted
    from shapes alone; a matrix's states and their shapes."""
    model = micro_model()
    run = load_run(came_run())
    method = build_method(run)
    optimizer = optimizer_for(method, model, run)
    ids = torch.randint(0, SAMPLE_VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    gate = optimizer.state[model.model.layers[0].mlp.gate_proj.weight]
    assert {k: tuple(v.shape) for k, v in gate.items() if k != "step"} == {
        "exp_avg": (176, 64), "exp_avg_sq_row": (176,), "exp_avg_sq_col": (64,),
        "exp_avg_res_row": (176,), "exp_avg_res_col": (64,)}
    assert set(optimizer.state[model.model.norm.weight]) == {"step", "exp_avg", "exp_avg_sq"}
    measured = memory_of(method).measure(model, optimizer)
    assert measured.optimizer_state_bytes == 4 * STATE_VALUES
    assert memory_of(method).estimate(param_shapes("llama_micro", SAMPLE_VOCAB), run) == measured


def test_bench_memory_counts_what_it_estimates_plain_and_layerwise(monkeypatch):
    """`harness bench memory`'s comparison for came plain and layer-wise: every part met, the
    counted state bytes the hand count in both."""
    from harness.bench import memory

    monkeypatch.setattr(memory, "METHODS", {"came": {}, "came_layerwise": {"method": "came"}})
    records = memory.bench_memory("llama_micro", 3, 32, 2)
    assert all(memory.met(r) for r in records), [r for r in records if not memory.met(r)]
    states = {r["name"].split("/")[2]: r["value"] for r in records
              if r["name"].endswith("optimizer_state_bytes")}
    assert states == {"came": 4 * STATE_VALUES, "came_layerwise": 4 * STATE_VALUES}


def test_fsdp_estimate_holds_row_shares_and_whole_columns():
    """Rank 0 of 4 under fsdp: the momentum and row statistics of ceil(m/4) rows, a matrix's
    column statistics of all n columns, a norm's two of its 16 elements (by hand)."""
    run = load_run(came_run())
    shapes = {"w": torch.Size((176, 64)), "norm": torch.Size((64,))}
    estimate = memory_of(build_method(run)).estimate_sharded(shapes, run, 4)
    assert estimate.optimizer_state_bytes == 4 * (44 * 64 + 2 * (44 + 64) + 2 * 16)


def test_bf16_true_keeps_float32_states_and_the_kahan_buffer(tmp_path):
    """train.state_dtype float32 (the default): every moment float32 of a bfloat16 weight, and
    its bfloat16 Kahan buffer; the trained run's bytes as estimated."""
    run = load_run(came_run(steps=2, precision="bf16-true", update_compensation="kahan"))
    method = build_method(run)
    model = micro_model().to(torch.bfloat16)
    optimizer = optimizer_for(method, model, run)
    ids = torch.randint(0, SAMPLE_VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    state = optimizer.state[model.model.layers[0].self_attn.q_proj.weight]
    assert {k: v.dtype for k, v in state.items() if k != "step"} == {
        "exp_avg": torch.float32, "exp_avg_sq_row": torch.float32,
        "exp_avg_sq_col": torch.float32, "exp_avg_res_row": torch.float32,
        "exp_avg_res_col": torch.float32, KAHAN: torch.bfloat16}
    summary = train(run, tmp_path / "t")
    assert summary["status"] == "ok", summary["error"]
    assert_estimate_matches(memory_of(method).estimate(
        param_shapes("llama_micro", SAMPLE_VOCAB), run), summary)


def test_paged_states_are_refused_with_the_reason():
    with pytest.raises(UserError, match="factored moments are its own tensors"):
        load_run(came_run(memory={"optimizer_offload": "paged"}))


def test_resume_is_exact(tmp_path):
    data = came_run(steps=4, precision="bf16-true", update_compensation="kahan")
    assert_resumes_exactly(load_run(data), tmp_path, stop=2)
