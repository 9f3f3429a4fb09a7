"""liger's kernels on the device (`pytest -m gpu`; the GPU kit carries liger-kernel): a patched
llama_tiny computes the loss and gradients the unpatched one does, and liger's fused linear
cross-entropy (harness/modifiers/kernels.py `liger_linear_cross_entropy`) the summed loss the
logits give. Skipped without CUDA, its smoke form included: Triton needs a GPU.

Tolerance: everything runs in float32 (TF32 off, torch's default), so the kernels differ from
torch's only in the order they sum in. Float32's epsilon is 1.2e-7; sums over up to 1000
terms (the vocabulary) reordered move a result by about sqrt(1000) epsilons, 4e-6, and four
layers forward and back compound that to about 1e-5. 1e-4 (relative) leaves ten times that,
yet a wrong kernel (another activation, a norm without its weight, RoPE on the wrong half) moves
the loss by far more than 1e-3."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gpu_setup import CUDA

from harness.modifiers import kernels
from harness.train.build import build_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not CUDA, reason="needs a CUDA device with Triton: `pytest -m gpu` runs it there")]
RTOL = 1e-4  # the module's docstring says why
VOCAB, SEQ, BATCH = 1000, 128, 4


@pytest.fixture
def llama_module(monkeypatch: pytest.MonkeyPatch) -> None:
    """liger patches RoPE (and the norm and MLP classes) in transformers' llama module for the
    process: put back after the test, so the other device checks build torch's."""
    from transformers.models.llama import modeling_llama

    for name in ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP"):
        monkeypatch.setattr(modeling_llama, name, getattr(modeling_llama, name))


def loss_and_grads(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean next-token loss, and every gradient flattened into one vector."""
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    return loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.usefixtures("llama_module")
def test_liger_patched_llama_gives_torchs_loss_and_gradients():
    assert kernels.liger_available(), kernels.liger_missing()  # the kit must carry it
    torch.manual_seed(0)
    model = build_model("llama_tiny", VOCAB, SEQ, None).cuda()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), device="cuda")
    loss, grads = loss_and_grads(model, ids)  # before patching: RoPE's patch is module-wide
    kernels.use_liger(model)
    layer = model.model.layers[0]
    assert (layer.mlp._get_name(), layer.input_layernorm._get_name()) == (
        "LigerSwiGLUMLP", "LigerRMSNorm")
    fused_loss, fused_grads = loss_and_grads(model, ids)
    assert relative(fused_loss, loss) < RTOL
    assert relative(fused_grads, grads) < RTOL
    hidden = model.model(input_ids=ids).last_hidden_state
    summed = kernels.liger_linear_cross_entropy()(
        hidden[:, :-1].flatten(0, 1), model.lm_head.weight, ids[:, 1:].flatten())
    assert relative(summed, loss * BATCH * (SEQ - 1)) < RTOL
