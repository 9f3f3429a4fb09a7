"""GaLore's optimizer under bf16-true (methods/galore_optim.py): moments in `state_dtype`, the
update brought back in float32 and added by the shared `add_update`; with float32 weights that
path is the fused one's arithmetic; an update below bf16's resolution is kept by Kahan."""

from __future__ import annotations

import pytest
import torch

from harness.methods.galore_optim import GaLoreOptimizer
from harness.modifiers.compensation import KAHAN

BF16 = torch.bfloat16


def weights_and_grads(dtype: torch.dtype, steps: int) -> tuple[list[torch.Tensor], list]:
    torch.manual_seed(0)
    params = [torch.randn(48, 64, dtype=dtype), torch.randn(64, dtype=dtype)]
    grads = [[torch.randn_like(p) for p in params] for _ in range(steps)]
    return params, grads


def groups(params: list[torch.Tensor]) -> list[dict]:
    return [{"params": [params[0]], "rank": 8, "weight_decay": 0.1},
            {"params": [params[1]], "weight_decay": 0.0}]


def run_steps(params: list[torch.Tensor], grads: list, **kwargs) -> GaLoreOptimizer:
    opt = GaLoreOptimizer(groups(params), lr=0.01, update_proj_gap=2, min_8bit_size=64, **kwargs)
    for gs in grads:
        for p, g in zip(params, gs, strict=True):
            p.grad = g.clone()
        opt.step()
    return opt


@pytest.mark.parametrize("inner", ["adamw", "adam8bit", "adafactor"])
@pytest.mark.parametrize("proj_type", ["std", "full"])
def test_float32_path_equals_the_fused_one_on_float32_weights(inner, proj_type):
    """Decay, back-projection, scale and lr through `_apply` give what the in-place matmul
    does, across a projection refresh, for every inner optimizer."""
    fused, grads = weights_and_grads(torch.float32, 5)
    exact = [p.clone() for p in fused]
    run_steps(fused, grads, inner=inner, proj_type=proj_type)
    opt = run_steps(exact, grads, inner=inner, proj_type=proj_type, state_dtype=torch.float32)
    assert opt.exact
    for a, b in zip(fused, exact, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("inner", ["adamw", "adafactor"])
def test_moments_follow_state_dtype_on_bf16_weights(inner):
    params, grads = weights_and_grads(BF16, 3)
    opt = run_steps(params, grads, inner=inner, state_dtype=torch.float32, compensation="kahan")
    moments = {k: v.dtype for st in opt.state.values() for k, v in st.items()
               if k.startswith("exp_avg")}
    assert moments and set(moments.values()) == {torch.float32}
    assert all(st[KAHAN].dtype == BF16 for st in opt.state.values())
    assert {p.dtype for p in params} == {BF16}
    bases = [st["left" if "left" in st else "right"] for st in opt.state.values()
             if "proj_step" in st]
    assert bases and {b.dtype for b in bases} == {BF16}  # the basis in the weights' dtype


def test_tiny_updates_are_lost_by_round_to_nearest_and_kept_by_kahan():
    """Steps of lr·α = 1e-3 on weights of 1 (bf16's spacing there: 2^-7), the same bf16
    gradients and float32 moments: round to nearest never moves the weights; with Kahan
    summation the weight plus its buffer follows float32 weights (up to the bf16 basis)."""
    torch.manual_seed(0)
    grads = [torch.randn(48, 64, dtype=BF16) for _ in range(30)]
    moved = {}
    for mode, dtype in (("none", BF16), ("kahan", BF16), ("float32", torch.float32)):
        w = torch.ones(48, 64, dtype=dtype)
        opt = GaLoreOptimizer([{"params": [w], "rank": 8}], lr=4e-3, update_proj_gap=10,
                              state_dtype=torch.float32,
                              compensation="none" if mode == "float32" else mode)
        for g in grads:
            w.grad = g.to(dtype)
            opt.step()
        comp = opt.state[w].get(KAHAN, torch.zeros(()))
        moved[mode], moved[f"{mode} weight"] = w.float() + comp.float() - 1, w.float() - 1
    assert moved["none"].abs().max() == 0
    assert moved["kahan weight"].abs().max() >= 2**-7
    error = (moved["kahan"] - moved["float32"]).norm() / moved["float32"].norm()
    assert error < 0.05
