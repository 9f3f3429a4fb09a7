"""The pretraining loss on the device (`pytest -m gpu`): liger's fused linear cross-entropy
(`model_options.kernels: liger`) gives the loss and gradients harness/train/lm_loss.py gives
on the logits and by chunks, through a whole llama_tiny. Skipped without CUDA, its smoke form
included: Triton needs a GPU.

Tolerance: in float32 (TF32 off, torch's default) the three differ only in the order they sum
in: float32's epsilon 1.2e-7 times about sqrt(1000) for sums over the 1000-entry vocabulary,
compounded through four layers back, is about 1e-5; 1e-4 leaves ten times that, and a wrong
target shift or a dropped token moves the loss by over 1e-3 (one token of 512 is 2e-3). Under
bf16 autocast each per-token loss (lse - logit, about log 1000 = 6.9 at initialisation, with
logits near 0) comes from bfloat16 logits that the chunked matmuls may round differently by
one bfloat16 epsilon (2^-8): at most about 2^-7 of the summed loss."""

from __future__ import annotations

import pytest
import torch
from gpu_setup import CUDA

from harness.modifiers import kernels
from harness.train import lm_loss
from harness.train.build import build_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not CUDA, reason="needs a CUDA device with Triton: `pytest -m gpu` runs it there")]
RTOL, BF16_RTOL = 1e-4, 2**-7  # the module's docstring says why
VOCAB, SEQ, BATCH = 1000, 128, 4


def loss_and_grads(model, ids, labels, chunk, kernel, autocast):
    model.zero_grad(set_to_none=True)
    loss, from_hidden = lm_loss.head_loss(chunk, kernel)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        value = lm_loss.next_token_loss(model, ids, labels, loss, from_hidden)
    value.backward()
    return value.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("autocast", [False, True], ids=["32-true", "bf16-mixed"])
def test_ligers_fused_loss_gives_ours_on_the_logits_and_by_chunks(autocast):
    assert kernels.liger_available(), kernels.liger_missing()  # the kit must carry it
    torch.manual_seed(0)
    model = build_model("llama_tiny", VOCAB, SEQ, None).cuda()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), device="cuda")
    labels = ids.clone()
    labels[1, 100:] = -100  # an ignored tail
    ours, grads = loss_and_grads(model, ids, labels, 0, "torch", autocast)
    chunked, chunked_grads = loss_and_grads(model, ids, labels, 96, "torch", autocast)
    fused, fused_grads = loss_and_grads(model, ids, labels, 0, "liger", autocast)
    if autocast:
        assert relative(fused, ours) < BF16_RTOL and relative(chunked, ours) < BF16_RTOL
        return
    assert relative(fused, ours) < RTOL and relative(fused_grads, grads) < RTOL
    assert relative(chunked, ours) < RTOL and relative(chunked_grads, grads) < RTOL
