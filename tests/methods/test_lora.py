"""LoRA through peft: what trains, that it learns, exact resume, estimator == real tensors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import SAMPLE_VOCAB, assert_estimate_matches, micro_model, micro_run, one_torch_thread

from harness.methods import MemoryEstimate, build_memory, build_method, memory_of, optimizer_for
from harness.methods.lora import adapter_params, lora_layers
from harness.methods.resolve import load_run
from harness.models import PRESETS, param_shapes
from harness.train import train
from harness.train.pretrain import loss_sum
from harness.trials import read_jsonl

VOCAB = SAMPLE_VOCAB  # the sample tokenizer's


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """On a busy 2-core machine OpenMP's spinning threads can slow a step 20x: use one."""
    with one_torch_thread():
        yield


def fast_run(method: dict[str, Any], steps: int = 24, lr: float = 0.01) -> dict[str, Any]:
    """micro_run with a small eval every 3 steps: the same tokens each time show the learning."""
    data = micro_run(steps=steps, lr=lr)
    return {**data, "method": method}


def losses(out: Path) -> list[tuple[int, float]]:
    return [
        (r["step"], r["loss"]) for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"
    ]


def learns(out: Path) -> bool:
    """Train losses (later batches) and eval losses (the same tokens each time) both fall."""
    values = [loss for _, loss in losses(out)]
    evals = [r["eval_loss"] for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "eval"]
    return sum(values[-3:]) < sum(values[:3]) and evals[-1] < evals[0] - 0.02


def resumes_exactly(data: dict[str, Any], tmp: Path, straight: Path, stop: int) -> bool:
    """Stopped at `stop` and resumed, a run logs the straight run's losses step for step."""
    run = load_run(data)
    first = train(run, tmp / "resumed", should_stop=lambda step: step == stop)
    assert (first["status"], first["step"]) == ("interrupted", stop)
    assert train(run, tmp / "resumed")["status"] == "ok"
    return losses(tmp / "resumed") == losses(straight)


def adapter_count(preset: str, rank: int) -> int:
    """r·(in + out) per target: q, k, v, o are h×h; gate, up are i×h; down is h×i."""
    p = PRESETS[preset]
    per_layer = 4 * rank * 2 * p.hidden + 3 * rank * (p.hidden + p.intermediate)
    return p.layers * per_layer


def non_target_count(preset: str, vocab: int) -> int:
    """Embeddings, lm_head, two norms per layer and the final norm."""
    p = PRESETS[preset]
    return 2 * vocab * p.hidden + (2 * p.layers + 1) * p.hidden


def estimate_and_measure(
    method: dict[str, Any], preset: str, vocab: int
) -> tuple[MemoryEstimate, MemoryEstimate]:
    """One real step on a tiny batch (one sequence of 8 tokens), as the trainer runs it."""
    run = load_run({**micro_run(), "model": preset, "method": method})
    m = build_method(run)
    model = m.prepare(micro_model(0, preset, vocab, run.task.seq_len), run)
    optimizer = optimizer_for(m, model, run)
    ids = torch.randint(vocab, (1, 8))
    loss_sum(model, ids, ids).backward()
    optimizer.step()
    m.on_step(1, model, optimizer)
    return memory_of(m).estimate(param_shapes(preset, vocab), run), memory_of(m).measure(
        model, optimizer
    )


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> tuple[dict[str, Any], Path, dict[str, Any]]:
    data = fast_run({"name": "lora"})
    out = tmp_path_factory.mktemp("lora") / "straight"
    return data, out, train(load_run(data), out)


def test_lora_learns_and_trains_adapters_plus_non_targets(straight):
    _, out, summary = straight
    assert summary["status"] == "ok" and learns(out)
    assert adapter_count("llama_micro", 8) == 19_712
    expected = adapter_count("llama_micro", 8) + non_target_count("llama_micro", VOCAB)
    assert summary["trainable_params"] == expected == 1_068_608


def test_lora_estimate_equals_the_real_tensors_on_micro(straight):
    data, _, summary = straight
    run = load_run(data)
    estimate = build_memory(run).estimate(param_shapes(run.model, VOCAB), run)
    assert_estimate_matches(estimate, summary)
    assert summary["extra_bytes"] == 0


def test_lora_resumes_exactly(straight, tmp_path):
    data, out, _ = straight
    assert resumes_exactly(data, tmp_path, out, stop=10)


@pytest.mark.parametrize("non_targets", [True, False])
def test_lora_estimate_equals_the_real_tensors_on_60m(non_targets):
    estimate, measured = estimate_and_measure(
        {"name": "lora", "rank": 16, "train_non_targets": non_targets}, "llama_60m", 32000
    )
    assert estimate == measured
    trainable = adapter_count("llama_60m", 16) + non_targets * non_target_count("llama_60m", 32000)
    assert measured.grad_bytes == 4 * trainable


def test_lora_starts_as_the_base_model_and_freezes_fp32_base_linears():
    run = load_run(fast_run({"name": "lora", "train_non_targets": False}))
    base = micro_model(seed=0)
    ids = torch.randint(VOCAB, (2, 16))
    with torch.no_grad():
        before = base(input_ids=ids).logits
    m = build_method(run)
    model = m.prepare(base, run)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, before)  # B = 0: a no-op at init
    frozen = [layer.get_base_layer().weight for layer in lora_layers(model)]
    assert len(frozen) == 2 * 7
    assert all(w.dtype == torch.float32 and not w.requires_grad for w in frozen)
    assert {id(p) for p in model.parameters() if p.requires_grad} == {
        id(p) for p in adapter_params(model)
    }
    copies = [w.clone() for w in frozen]
    optimizer = optimizer_for(m, model, run)
    loss_sum(model, ids, ids).backward()
    a, b = adapter_params(model)[:2]
    assert not a.grad.any() and b.grad.any()  # peft's init: only B moves at the first step
    optimizer.step()
    assert all(torch.equal(w, c) for w, c in zip(frozen, copies, strict=True))
