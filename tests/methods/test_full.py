"""The two baselines without an end-to-end file of their own (methods/full.py, adam8bit.py):
their estimate equals the real tensors after a step on the micro model, and 8-bit moments
are what bitsandbytes keeps."""

from __future__ import annotations

import pytest
import torch
from conftest import SAMPLE_VOCAB, micro_model, micro_run

from harness.methods import build_method, memory_of, optimizer_for
from harness.methods.resolve import load_run
from harness.models import param_shapes


def one_step(model, method: dict, **train):
    run = load_run({**micro_run(**train), "method": method})
    m = build_method(run)
    optimizer = optimizer_for(m, model, run)
    ids = torch.randint(0, SAMPLE_VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    return m, run, optimizer


@pytest.mark.parametrize("method", [{"name": "full"}, {"name": "adam8bit"},
                                    {"name": "adam8bit", "min_8bit_size": 256}])
def test_estimate_equals_the_real_tensors_after_a_step(tiny_model, method):
    m, run, optimizer = one_step(tiny_model, method)
    estimate = memory_of(m).estimate(param_shapes("llama_micro", SAMPLE_VOCAB), run)
    assert estimate == memory_of(m).measure(tiny_model, optimizer)
    n = sum(p.numel() for p in tiny_model.parameters())
    assert (estimate.weight_bytes, estimate.grad_bytes, estimate.extra_bytes) == (4 * n, 4 * n, 0)


def test_full_is_fused_adamw_with_two_fp32_moments(tiny_model):
    m, run, optimizer = one_step(tiny_model, {"name": "full", "betas": [0.8, 0.9]})
    assert type(optimizer) is torch.optim.AdamW and optimizer.defaults["fused"] is True
    assert optimizer.defaults["betas"] == (0.8, 0.9) and optimizer.defaults["lr"] == run.train.lr
    state = optimizer.state[tiny_model.lm_head.weight]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    assert memory_of(m).measure(tiny_model, optimizer).optimizer_state_bytes == (
        8 * sum(p.numel() for p in tiny_model.parameters())
        + 4 * len(list(tiny_model.parameters())))


def test_8bit_moments_are_bytes_above_the_threshold(tiny_model):
    m, _, optimizer = one_step(tiny_model, {"name": "adam8bit"})
    big, small = tiny_model.lm_head.weight, tiny_model.model.norm.weight  # 524,288 and 64
    assert optimizer.state[big]["state1"].dtype == torch.uint8
    assert optimizer.state[small]["state1"].dtype == torch.float32  # under min_8bit_size
    plain = micro_model()
    full, _, full_optimizer = one_step(plain, {"name": "full"})
    ratio = (memory_of(m).measure(tiny_model, optimizer).optimizer_state_bytes
             / memory_of(full).measure(plain, full_optimizer).optimizer_state_bytes)
    assert 0.25 < ratio < 0.3  # a byte a moment instead of four, plus maps and absmax
