"""Lion: the update of the reference package (pytorch_optimizer.Lion, 4.1.0) on the same
gradients, through the method's own construction; exact state bytes, plain and layer-wise;
bf16-true's state dtype and compensation; resume (the memory modifiers and precisions:
tests/method_matrix.py; ddp and fsdp: tests/train/test_equality.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import (
    SAMPLE_VOCAB,
    assert_estimate_matches,
    assert_resumes_exactly,
    micro_model,
    micro_run,
)
from package_steps import feed
from pytorch_optimizer import Lion as ReferenceLion

from harness.errors import UserError
from harness.methods import build_method, memory_of, optimizer_for
from harness.methods.resolve import load_run
from harness.models import param_shapes
from harness.modifiers.compensation import KAHAN
from harness.train import train

# llama_micro: 2 layers of q, k, v, o (64x64), gate, up (176x64), down (64x176); embeddings
# and head 2 x SAMPLE_VOCAB x 64; 5 norms of 64.
ELEMENTS = 2 * (4 * 64 * 64 + 3 * 176 * 64) + 2 * SAMPLE_VOCAB * 64 + 5 * 64


def lion_run(steps: int = 4, method: dict[str, Any] | None = None,
             memory: dict | None = None, **train_keys: Any) -> dict[str, Any]:
    data = micro_run(steps=steps, grad_clip=None, **train_keys)
    data["eval"] = {"every": 0, "tokens": 256}
    return {**data, "method": {"name": "lion", **(method or {})}, "memory": memory or {}}


@pytest.mark.parametrize("betas", [(0.9, 0.99), (0.5, 0.9)])
def test_every_weight_steps_as_the_reference_package(betas):
    """Six steps at lr 1e-3, decay 0.5 on matrices (not on norms): every weight bitwise the
    package's, the same three elementwise operations in the same order (decoupled decay, the
    sign of lerp(m, g, 1 − β1), then lerp(m, g, 1 − β2)). Measured at betas (0.5, 0.9): β1
    and β2 swapped move a weight 8e-3 off the package's, decay on the norms 3e-3, decay after
    the signed step 3e-6 (which only bitwise equality sees)."""
    model, ref = micro_model(), micro_model()
    run = load_run(lion_run(method={"betas": list(betas)}, lr=1e-3, weight_decay=0.5))
    ours = optimizer_for(build_method(run), model, run)
    params = list(ref.parameters())
    reference = ReferenceLion([{"params": [p for p in params if p.dim() >= 2],
                                "weight_decay": 0.5},
                               {"params": [p for p in params if p.dim() < 2],
                                "weight_decay": 0.0}], lr=1e-3, betas=betas)
    start = [p.detach().clone() for p in model.parameters()]

    def step() -> None:
        ours.step()
        reference.step()

    feed([model, ref], 6, step)
    for (name, p), q, p0 in zip(model.named_parameters(), ref.parameters(), start, strict=True):
        assert torch.equal(p, q), name
        assert (p - p0).abs().max() > 5e-3, name  # six signed steps of 1e-3, nearly all one way


def test_one_momentum_per_element_counted_and_estimated():
    """One float32 `exp_avg` a trained element and nothing else, counted from the real
    tensors after a step and predicted from shapes alone."""
    model = micro_model()
    run = load_run(lion_run())
    method = build_method(run)
    optimizer = optimizer_for(method, model, run)
    ids = torch.randint(0, SAMPLE_VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    assert sum(p.numel() for p in model.parameters()) == ELEMENTS
    assert all(set(s) == {"exp_avg"} for s in optimizer.state.values())
    measured = memory_of(method).measure(model, optimizer)
    assert measured.optimizer_state_bytes == 4 * ELEMENTS
    assert memory_of(method).estimate(param_shapes("llama_micro", SAMPLE_VOCAB), run) == measured


def test_bench_memory_counts_what_it_estimates_plain_and_layerwise(monkeypatch):
    """`harness bench memory`'s comparison for lion plain and layer-wise: every part met, the
    counted state bytes the hand count above in both."""
    from harness.bench import memory

    monkeypatch.setattr(memory, "METHODS", {"lion": {}, "lion_layerwise": {"method": "lion"}})
    records = memory.bench_memory("llama_micro", 3, 32, 2)
    assert all(memory.met(r) for r in records), [r for r in records if not memory.met(r)]
    states = {r["name"].split("/")[2]: r["value"] for r in records
              if r["name"].endswith("optimizer_state_bytes")}
    assert states == {"lion": 4 * ELEMENTS, "lion_layerwise": 4 * ELEMENTS}


def test_paged_states_are_refused_with_the_reason():
    with pytest.raises(UserError, match=r"^method lion: its momentum is its own tensor"):
        load_run(lion_run(memory={"optimizer_offload": "paged"}))


@pytest.mark.parametrize(("state_dtype", "compensation", "dtype"),
                         [("float32", "kahan", torch.float32),
                          ("bfloat16", "stochastic_rounding", torch.bfloat16)])
def test_bf16_true_honours_state_dtype_and_compensation(tmp_path, state_dtype, compensation,
                                                        dtype):
    run = load_run(lion_run(steps=2, precision="bf16-true", state_dtype=state_dtype,
                            update_compensation=compensation))
    method = build_method(run)
    model = micro_model().to(torch.bfloat16)
    optimizer = optimizer_for(method, model, run)
    ids = torch.randint(0, SAMPLE_VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    state = optimizer.state[model.model.layers[0].self_attn.q_proj.weight]
    assert state["exp_avg"].dtype == dtype
    assert (KAHAN in state) == (compensation == "kahan")
    summary = train(run, tmp_path / "t")
    assert summary["status"] == "ok", summary["error"]
    shapes = param_shapes("llama_micro", SAMPLE_VOCAB)
    assert_estimate_matches(memory_of(method).estimate(shapes, run), summary)


def test_resume_is_exact(tmp_path):
    data = lion_run(steps=4, precision="bf16-true", update_compensation="kahan")
    assert_resumes_exactly(load_run(data), tmp_path, stop=2)
