"""NorMuon: the update of pytorch-optimizer's `NorMuon` on the same gradients, in both
rescalings, through the method's own construction; exact state bytes (plain and layer-wise);
bf16-true's state dtype; the paged refusal (the modifiers and precisions:
tests/method_matrix.py; ddp and fsdp: tests/train/test_equality.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import SAMPLE_VOCAB, assert_resumes_exactly, micro_model, micro_run
from package_steps import adamw_on_the_rest, feed
from pytorch_optimizer import NorMuon as PackageNorMuon

from harness.errors import UserError
from harness.methods import build_method, memory_of, optimizer_for
from harness.methods.resolve import load_run
from harness.models import param_shapes

# llama_micro: 2 layers of q, k, v, o (64x64) and gate, up (176x64), down (64x176): the hidden
# matrices, their rows; embeddings and head 2 x SAMPLE_VOCAB x 64; 5 norms of 64.
HIDDEN = 2 * (4 * 64 * 64 + 3 * 176 * 64)
ROWS = 2 * (4 * 64 + 2 * 176 + 64)
OTHER = 2 * SAMPLE_VOCAB * 64 + 5 * 64


def normuon_run(method: dict[str, Any] | None = None, memory: dict | None = None,
                **train_keys: Any) -> dict[str, Any]:
    data = micro_run(steps=4, grad_clip=None, **train_keys)
    data["eval"] = {"every": 0, "tokens": 256}
    return {**data, "method": {"name": "normuon", **(method or {})}, "memory": memory or {}}


def hidden_of(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for n, p in model.named_parameters()
            if p.dim() == 2 and "embed" not in n and "lm_head" not in n]


@pytest.mark.parametrize(("scale", "adjust", "nesterov"), [
    ("match_rms", "match_rms_adamw", True), ("preserve_norm", "original", True),
    ("preserve_norm", "match_rms_adamw", False)])
def test_hidden_matrices_step_as_the_package_and_the_rest_as_torch_adamw(scale, adjust,
                                                                         nesterov):
    """Five steps at lr 0.02, decay 0.1, β₂ 0.9: every hidden matrix as pytorch-optimizer's
    NorMuon (its per-tensor path, foreach off; adjust_lr_fn original is its
    use_adjusted_lr=False, match_rms_adamw its True); embeddings, head and norms bitwise torch's
    fused AdamW's. Not bitwise on the hidden matrices: the package's Newton–Schulz is its own
    (the same bfloat16 arithmetic in fused calls) and it takes norms where we sum squares.
    Measured over 5 steps, the largest difference over the matrix's largest motion: 1.6e-6;
    bound 1e-5. Muon's update (no row normalization) is 59% away, the other update_scale 15%."""
    model, ref = micro_model(), micro_model()
    settings = {"update_scale": scale, "adjust_lr_fn": adjust, "nesterov": nesterov,
                "beta2": 0.9}
    run = load_run(normuon_run(method=settings, lr=0.02, weight_decay=0.1))
    ours = optimizer_for(build_method(run), model, run)
    hidden = hidden_of(ref)
    package = PackageNorMuon(
        [{"params": hidden, "use_muon": True, "lr": 0.02, "weight_decay": 0.1}], beta2=0.9,
        nesterov=nesterov, update_scale=scale, use_adjusted_lr=adjust == "match_rms_adamw",
        foreach=False)
    adamw = adamw_on_the_rest(ref, hidden, lr=0.02, weight_decay=0.1)
    start = [p.detach().clone() for p in model.parameters()]

    def step() -> None:
        ours.step()
        package.step()
        adamw.step()

    feed([model, ref], 5, step)
    mine = hidden_of(model)
    for (name, p), q, p0 in zip(model.named_parameters(), ref.parameters(), start, strict=True):
        moved = (q - p0).abs().max()
        assert moved > 1e-3, name
        if any(p is h for h in mine):
            assert (p - q).abs().max() < 1e-5 * moved, name
        else:
            assert torch.equal(p, q), name


def test_state_bytes_plain_and_layerwise():
    """Hidden matrices one float32 momentum an element and one second moment a row; the 7
    other tensors two AdamW moments and torch's float32 step each: counted from the real
    tensors after a step and predicted from shapes alone, plain and layer-wise."""
    shapes = param_shapes("llama_micro", SAMPLE_VOCAB)
    for layerwise in (False, True):
        model = micro_model()
        run = load_run(normuon_run(memory={"layerwise": layerwise}))
        method = build_method(run)
        optimizer = optimizer_for(method, model, run)
        ids = torch.randint(0, SAMPLE_VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        q = model.model.layers[0].self_attn.q_proj.weight
        assert set(optimizer.state[q]) == {"momentum_buffer", "second_momentum_buffer"}
        measured = memory_of(method).measure(model, optimizer)
        assert measured.optimizer_state_bytes == 4 * (HIDDEN + ROWS + 2 * OTHER + 7)
        assert memory_of(method).estimate(shapes, run).optimizer_state_bytes == \
            measured.optimizer_state_bytes


@pytest.mark.parametrize(("state_dtype", "dtype"), [("float32", torch.float32),
                                                    ("bfloat16", torch.bfloat16)])
def test_bf16_true_keeps_the_row_moments_in_the_state_dtype(state_dtype, dtype):
    run = load_run(normuon_run(precision="bf16-true", state_dtype=state_dtype))
    model = micro_model().to(torch.bfloat16)
    optimizer = optimizer_for(build_method(run), model, run)
    ids = torch.randint(0, SAMPLE_VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    st = optimizer.state[model.model.layers[0].mlp.gate_proj.weight]
    assert st["second_momentum_buffer"].shape == (176, 1)
    assert st["second_momentum_buffer"].dtype == st["momentum_buffer"].dtype == dtype
    assert bool(st["second_momentum_buffer"].gt(0).all())


def test_paged_states_are_refused_with_the_reason():
    with pytest.raises(UserError, match=r"^method normuon: its momentum and row second "):
        load_run(normuon_run(memory={"optimizer_offload": "paged"}))


def test_resume_is_exact(tmp_path):
    """bf16-true with Kahan: the row moments and the momentum come back in their dtypes."""
    data = normuon_run(precision="bf16-true", update_compensation="kahan")
    assert_resumes_exactly(load_run(data), tmp_path, stop=2)
