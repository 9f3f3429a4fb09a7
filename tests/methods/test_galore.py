"""GaLore: trains, matches galore-torch, degrades to AdamW at full rank, survives SVD failures,
reprojects moments correctly, counts its memory exactly, and resumes step for step."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import SAMPLE_VOCAB, micro_model, micro_run

from harness.methods import build_memory, build_method, memory_of, optimizer_for
from harness.methods.galore_optim import GaLoreOptimizer
from harness.methods.projection import compute_basis
from harness.methods.resolve import load_run
from harness.models import param_shapes
from harness.train import train
from harness.trials import read_jsonl

VOCAB = SAMPLE_VOCAB  # the sample tokenizer's
TARGETS = 2 * 7  # llama_micro: 2 blocks × 7 linears


def galore_run(steps: int, **method) -> dict:
    data = micro_run(steps=steps, lr=0.01)
    data["eval"] = {"every": 0, "tokens": 256}
    return {**data, "method": {"name": "galore", "rank": 8, "update_proj_gap": 8, **method}}


def rows(out: Path, kind: str) -> list[dict]:
    return [r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == kind]


def steps_of(params: list[torch.Tensor], opt: torch.optim.Optimizer, grads: list[list]) -> None:
    for gs in grads:
        for p, g in zip(params, gs, strict=True):
            p.grad = g.clone()
        opt.step()


def assert_steps_like_adamw(
    shapes: list[tuple[int, ...]], steps: int,
    make: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
) -> torch.optim.Optimizer:
    """`make`'s optimizer on random weights of `shapes` takes the steps torch's AdamW (lr 1e-2,
    decay 0.1) takes on the same gradients; returned for what else the test checks."""
    torch.manual_seed(0)
    ours = [torch.randn(s, requires_grad=True) for s in shapes]
    ref = [p.detach().clone().requires_grad_() for p in ours]
    opt = make(ours)
    adamw = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1)
    grads = [[torch.randn(s) for s in shapes] for _ in range(steps)]
    steps_of(ours, opt, grads)
    steps_of(ref, adamw, grads)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    return opt


def check_estimate(run, summary: dict, model: str = "llama_micro") -> None:
    estimate = build_memory(run).estimate(param_shapes(model, VOCAB), run)
    assert (estimate.weight_bytes, estimate.grad_bytes, estimate.optimizer_state_bytes,
            estimate.extra_bytes) == (summary["param_bytes"], summary["grad_bytes"],
                                      summary["optimizer_state_bytes"], summary["extra_bytes"])


@pytest.mark.parametrize(("inner", "moments"),
                         [("adamw", "keep"), ("adam8bit", "reset"), ("adafactor", "reproject")])
def test_trains_every_weight_logs_svd_events_and_counts_memory_exactly(tmp_path, inner, moments):
    run = load_run(galore_run(24, optimizer=inner, moments=moments))
    summary = train(run, tmp_path / "t")
    assert summary["status"] == "ok", summary["error"]
    loss = [r["loss"] for r in rows(tmp_path / "t", "train")]
    assert sum(loss[-4:]) / 4 < sum(loss[:4]) / 4 - 0.5  # full AdamW: 8.68 → 7.72
    assert summary["eval_loss"] < loss[0] - 0.5
    assert summary["trainable_params"] == summary["total_params"]
    events = rows(tmp_path / "t", "event")
    assert [e["step"] for e in events] == [1, 9, 17]  # only steps that recomputed projections
    assert all(e["galore_svd"] == TARGETS and e["svd_failures"] == 0 for e in events)
    check_estimate(run, summary)
    assert 0 < summary["extra_bytes"] < summary["optimizer_state_bytes"]


def test_std_projects_the_smaller_side():
    wide, tall = torch.zeros(12, 40, requires_grad=True), torch.zeros(40, 12, requires_grad=True)
    opt = GaLoreOptimizer([{"params": [wide, tall], "rank": 4}], lr=1e-3)
    steps_of([wide, tall], opt, [[torch.randn(12, 40), torch.randn(40, 12)]])
    w, t = opt.state[wide], opt.state[tall]
    assert w["left"].shape == (12, 4) and "right" not in w and w["exp_avg"].shape == (4, 40)
    assert t["right"].shape == (4, 12) and "left" not in t and t["exp_avg"].shape == (40, 4)
    torch.testing.assert_close(w["left"].T @ w["left"], torch.eye(4), atol=1e-5, rtol=0)


@pytest.mark.parametrize("rank", [12, 64])
def test_full_projection_at_full_rank_is_plain_adamw(rank):
    opt = assert_steps_like_adamw(
        [(12, 40), (40, 12), (12, 12)], 5,
        lambda ours: GaLoreOptimizer([{"params": ours, "rank": rank}], lr=1e-2, weight_decay=0.1,
                                     proj_type="full", scale=1.0, update_proj_gap=2))
    assert opt.take_svd_attempts() == 0 and not any("left" in s for s in opt.state.values())


@pytest.mark.parametrize(("inner", "proj_type"), [("adamw", "std"), ("adamw", "reverse_std"),
                                                  ("adamw", "left"), ("adamw", "right"),
                                                  ("adamw", "full"), ("adafactor", "std")])
def test_matches_galore_torch_across_projection_updates(inner, proj_type):
    from galore_torch import GaLoreAdafactor, GaLoreAdamW

    # "full" makes R = diag(s) at each SVD: its off-diagonal rounding noise, which differs
    # with memory layout, is what Adam would normalize to ±1. β2 = 0 and a large eps damp it
    # the same way in both (their eps conventions coincide when β2 = 0).
    betas, eps = ((0.9, 0.0), 1e-1) if proj_type == "full" else ((0.9, 0.999), 1e-12)
    torch.manual_seed(0)
    shapes = [(24, 40), (40, 24), (32, 32), (24,)]
    ours = [torch.randn(s, requires_grad=True) for s in shapes]
    ref = [p.detach().clone().requires_grad_() for p in ours]
    start = [p.detach().clone() for p in ours]
    galore = {"rank": 6, "update_proj_gap": 3, "scale": 0.25, "proj_type": proj_type}
    opt = GaLoreOptimizer([{"params": ours[:3], "rank": 6}, {"params": ours[3:]}], lr=1e-2,
                          betas=betas, eps=eps, inner=inner, update_proj_gap=3,
                          proj_type=proj_type)
    groups = [{"params": ref[:3], **galore}, {"params": ref[3:]}]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = (GaLoreAdamW(groups, lr=1e-2, betas=betas, eps=eps,
                                 no_deprecation_warning=True)
                     if inner == "adamw" else
                     GaLoreAdafactor(groups, lr=1e-2, relative_step=False,
                                     scale_parameter=False, warmup_init=False))
    grads = [[torch.randn(s) for s in shapes] for _ in range(8)]  # SVDs at steps 0, 3, 6
    steps_of(ours, opt, grads)
    steps_of(ref, reference, grads)
    for a, b, a0 in zip(ours, ref, start, strict=True):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5)
        assert (a - a0).abs().max() > 1e-3


@pytest.mark.parametrize("moments", ["keep", "reset", "reproject"])
def test_moments_policy_on_a_subspace_change(moments):
    """After a refresh from basis P1 to P2, M2 = β1·f(M1) + (1-β1)·P2ᵀG2 where f is the
    policy: identity, zero, or the rotation C = P2ᵀP1 (and C∘C for the second moment)."""
    torch.manual_seed(0)
    w = torch.zeros(10, 30, requires_grad=True)
    opt = GaLoreOptimizer([{"params": [w], "rank": 4}], lr=1e-3, update_proj_gap=1,
                          moments=moments)
    g1, g2 = torch.randn(10, 30), torch.randn(10, 30)
    steps_of([w], opt, [[g1]])
    st = opt.state[w]
    p1, m1, v1 = st["left"].clone(), st["exp_avg"].clone(), st["exp_avg_sq"].clone()
    steps_of([w], opt, [[g2]])
    p2, r2 = st["left"], st["left"].T @ g2
    assert not torch.allclose(p1, p2, atol=1e-3)
    c = p2.T @ p1
    m, v = {"keep": (m1, v1), "reset": (0 * m1, 0 * v1),
            "reproject": (c @ m1, (c * c) @ v1)}[moments]
    torch.testing.assert_close(st["exp_avg"], 0.9 * m + 0.1 * r2, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(st["exp_avg_sq"], 0.999 * v + 0.001 * r2**2, atol=1e-7, rtol=1e-5)
    assert st["step"] == (1 if moments == "reset" else 2)


def test_reproject_keeps_a_moment_inside_the_same_subspace():
    """A new basis spanning the old subspace must carry the first moment over exactly, also
    through 8-bit states (to quantization error)."""
    torch.manual_seed(0)
    w = torch.zeros(64, 300, requires_grad=True)
    opt = GaLoreOptimizer([{"params": [w], "rank": 16}], lr=1e-3, update_proj_gap=1,
                          moments="reproject", inner="adam8bit", min_8bit_size=1)
    low = torch.linalg.qr(torch.randn(64, 16)).Q
    g1, mix = low @ torch.randn(16, 300), torch.linalg.qr(torch.randn(16, 16)).Q
    steps_of([w], opt, [[g1]])
    st = opt.state[w]
    full_before = st["left"] @ dequantized(st, 1)
    opt._switch("reproject", st, {"left": st["left"] @ mix})  # same span, rotated basis
    error = st["left"] @ dequantized(st, 1) - full_before
    assert error.norm() < 0.02 * full_before.norm()
    assert (dequantized(st, 2) >= 0).all()


def dequantized(st: dict, i: int) -> torch.Tensor:
    import bitsandbytes.functional as bnbf

    return bnbf.dequantize_blockwise(st[f"state{i}"], absmax=st[f"absmax{i}"],
                                     code=st[f"qmap{i}"], blocksize=256)


def test_svd_failures_never_crash_and_are_counted(monkeypatch):
    run = load_run(galore_run(4, update_proj_gap=1))
    method = build_method(run)
    model = torch.nn.ModuleDict({"q_proj": torch.nn.Linear(30, 10)})
    w, b = model.q_proj.weight, model.q_proj.bias
    with torch.no_grad():
        w.zero_()
        b.zero_()
    opt = optimizer_for(method, model, run)
    real_svd = torch.linalg.svd

    def broken(a, *args, **kwargs):
        raise torch.linalg.LinAlgError("failed to converge")

    monkeypatch.setattr(torch.linalg, "svd", broken)
    steps_of([w, b], opt, [[torch.randn(10, 30), torch.randn(10)]])
    assert torch.equal(w, torch.zeros(10, 30)) and not torch.equal(b, torch.zeros(10))
    assert method.on_step(1, model, opt) == {"galore_svd": 1, "svd_retries": 0, "svd_failures": 1}

    def float32_fails(a, *args, **kwargs):  # the float64 retry must rescue it
        if a.dtype == torch.float32:
            raise torch.linalg.LinAlgError("failed to converge")
        return real_svd(a, *args, **kwargs)

    monkeypatch.setattr(torch.linalg, "svd", float32_fails)
    steps_of([w, b], opt, [[torch.randn(10, 30), torch.randn(10)]])
    assert not torch.equal(w, torch.zeros(10, 30))
    assert method.on_step(2, model, opt)["svd_retries"] == 1
    monkeypatch.setattr(torch.linalg, "svd", real_svd)
    basis = opt.state[w]["left"].clone()
    nan = torch.full((10, 30), float("nan"))
    steps_of([w, b], opt, [[nan, torch.randn(10)]])  # a NaN gradient keeps the old basis
    assert torch.equal(opt.state[w]["left"], basis)
    assert method.on_step(3, model, opt) == {"galore_svd": 1, "svd_retries": 1, "svd_failures": 2}
    assert method.on_step(4, model, opt) is None  # nothing happened since


def test_layerwise_with_accumulation_equals_the_plain_step(tmp_path):
    base = galore_run(6, update_proj_gap=3)
    base["train"].update(grad_clip=None, total_batch_size=4, batch_size=2)
    plain = train(load_run(base), tmp_path / "plain")
    lw_run = load_run({**base, "memory": {"layerwise": True}})
    layerwise = train(lw_run, tmp_path / "layerwise")
    assert plain["status"] == layerwise["status"] == "ok"
    a, b = (rows(tmp_path / d, "train") for d in ("plain", "layerwise"))
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in a] == pytest.approx([r["loss"] for r in b], rel=1e-5, abs=0)
    assert layerwise["eval_loss"] == pytest.approx(plain["eval_loss"], rel=1e-5)
    assert [e["step"] for e in rows(tmp_path / "layerwise", "event")] == [1, 4]
    check_estimate(lw_run, layerwise)


def test_resume_gives_the_same_losses_step_for_step(tmp_path):
    run = load_run(galore_run(6, update_proj_gap=2, optimizer="adam8bit", moments="reproject",
                              svd="randomized"))
    train(run, tmp_path / "straight")
    first = train(run, tmp_path / "resumed", should_stop=lambda step: step == 3)
    assert (first["status"], first["step"]) == ("interrupted", 3)
    second = train(run, tmp_path / "resumed")
    assert second["status"] == "ok" and second["step"] == 6
    losses = [[(r["step"], r["loss"]) for r in rows(tmp_path / d, "train")]
              for d in ("straight", "resumed")]
    assert losses[0] == losses[1] and len(losses[0]) == 6
    assert second["eval_loss"] == train(run, tmp_path / "straight")["eval_loss"]


def test_estimate_equals_measure_on_llama_60m():
    model = micro_model(0, "llama_60m", seq_len=8)
    ids = torch.randint(0, VOCAB, (1, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    shapes = {n: p.shape for n, p in model.named_parameters()}
    for inner in ("adamw", "adam8bit", "adafactor"):
        run = load_run({**micro_run(), "model": "llama_60m", "method": {
            "name": "galore", "optimizer": inner, "svd": "randomized"}})
        method = build_method(run)
        opt = optimizer_for(method, model, run)
        opt.step()
        memory = memory_of(method)
        assert memory.measure(model, opt) == memory.estimate(shapes, run), inner


def test_bench_optim_records_are_sane():
    from harness.bench.optim import bench_optim

    records = bench_optim("llama_micro", gap=4, steps=2, rank=8, e2e_preset="llama_micro")
    by_name = {r["name"]: r for r in records}
    e2e = "e2e_galore/llama_micro/rank8/512tok"
    assert list(by_name) == ["adamw", "galore", "galore_rsvd", "galore_torch", e2e]
    assert by_name["galore"]["target"] == by_name["galore_rsvd"]["target"] == 0.8
    assert by_name[e2e]["target"] == 1.05 and by_name[e2e]["tokens_per_update"] == 512
    for r in records:
        assert r["ms_svd"] > 0 and r["ms_normal"] > 0 and 0.01 < r["ratio_to_adamw"] < 100
        assert r["ms_per_step"] == pytest.approx((3 * r["ms_normal"] + r["ms_svd"]) / 4)
    assert by_name["adamw"]["ratio_to_adamw"] == 1.0
    ref = by_name["galore_torch"]
    for ours in (by_name["galore"], by_name["galore_rsvd"]):
        assert ours["ratio_to_galore_torch"] == pytest.approx(ours["ms_per_step"]
                                                              / ref["ms_per_step"])


@pytest.mark.parametrize("randomized", [False, True])
def test_a_basis_owns_only_its_rank_rows_whatever_the_svd_layout(monkeypatch, randomized):
    """cuSOLVER returns Vh row-major (LAPACK column-major): its first `rank` rows are then a
    contiguous view of all k × n, which must not stay alive as the basis (on CUDA it left the
    estimate's GaLore peak low by the leak)."""
    real_svd = torch.linalg.svd

    def row_major(a, *args, **kwargs):  # as cuSOLVER lays them out
        return tuple(t.contiguous() for t in real_svd(a, *args, **kwargs))

    monkeypatch.setattr(torch.linalg, "svd", row_major)
    grad = torch.randn(48, 32)  # tall: GaLore projects on the right, with Vh
    basis = compute_basis(grad, "full", 4, randomized, 0, torch.float32)
    assert basis is not None
    for t in basis.values():
        assert t.is_contiguous()
        assert t.untyped_storage().nbytes() == t.numel() * 4  # 4 x 32 or 48 x 4 floats
