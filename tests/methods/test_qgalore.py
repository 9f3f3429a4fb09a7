"""Q-GaLore: trains INT8 weights and every other parameter, updates once per optimizer step under
accumulation, grows the SVD gap lazily, counts its memory exactly, and resumes step for step."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import SAMPLE_VOCAB, micro_model, micro_run
from test_galore import rows
from torch import nn

from harness.cost.grad_peak import GradPeak
from harness.methods import build_memory, build_method, memory_of, optimizer_for
from harness.methods.qgalore_optim import QGaLoreOptimizer
from harness.methods.quant import Int8Linear, dequantize_int8, quantize_int8
from harness.methods.resolve import load_run
from harness.models import param_shapes
from harness.train import Trainer, train
from harness.trials import Records

VOCAB = SAMPLE_VOCAB  # the sample tokenizer's
TARGETS = 2 * 7  # llama_micro: 2 blocks × 7 linears


def qgalore_run(steps: int, **method) -> dict:
    data = micro_run(steps=steps, lr=0.01)
    data["eval"] = {"every": 0, "tokens": 256}
    return {**data, "method": {"name": "qgalore", "rank": 8, "update_proj_gap": 5, **method}}


def fit(run, out: Path) -> Trainer:
    trainer = Trainer(run, Records(out, run), lambda step: False)
    assert trainer.fit() == "ok"
    trainer.close()
    return trainer


def check_estimate(run, costs: dict) -> None:
    estimate = build_memory(run).estimate(param_shapes(run.model, VOCAB), run)
    assert (estimate.weight_bytes, estimate.grad_bytes, estimate.optimizer_state_bytes,
            estimate.extra_bytes) == (costs["param_bytes"], costs["grad_bytes"],
                                      costs["optimizer_state_bytes"], costs["extra_bytes"])


def test_trains_int8_weights_and_every_other_parameter(tmp_path):
    run = load_run(qgalore_run(24))  # accumulation 2: two micro-batches per step
    trainer = Trainer(run, Records(tmp_path, run), lambda step: False)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    assert trainer.fit() == "ok"
    trainer.close()
    after, model, opt = trainer.model.state_dict(), trainer.model, trainer.optimizer
    loss = [r["loss"] for r in rows(tmp_path, "train")]
    assert sum(loss[-4:]) / 4 < sum(loss[:4]) / 4 - 0.5  # GaLore at rank 8: 8.70 → 7.89
    assert trainer.last_eval["eval_loss"] < loss[0] - 0.5
    layers = [m for m in model.modules() if isinstance(m, Int8Linear)]
    assert len(layers) == TARGETS and not any("proj" in n for n, _ in model.named_parameters())
    for key, value in after.items():  # embeddings, norms, lm_head train too (Q-GaLore#12)
        if key.endswith(".codes"):
            assert value.dtype == torch.uint8
            assert (value != before[key]).float().mean() > 0.2, key
        elif not key.endswith((".scale", ".zero")):
            assert not torch.equal(value, before[key]), key
    assert isinstance(opt, QGaLoreOptimizer)
    assert all(opt.layer_state[m]["updates"] == 24 for m in layers)  # once per step, not 48
    events = rows(tmp_path, "event")
    assert events[0]["step"] == 1 and events[0]["qgalore_svd"] == TARGETS
    assert sum(e["qgalore_svd"] for e in events) == events[-1]["svd_total"] <= 5 * TARGETS
    last = events[-1]  # with GaLore's fixed gap: an SVD at steps 1, 6, 11, ...
    assert last["svd_total"] + last["svd_skipped"] == TARGETS * math.ceil(last["step"] / 5)
    check_estimate(run, trainer.costs)
    assert trainer.costs["extra_bytes"] < trainer.costs["param_bytes"]


def tiny(rank: int = 4, gap: int = 2, grad_clip: float | None = None, **method) -> tuple:
    """A single q_proj (32×64) made INT8 (or float, simulate), its method and optimizer."""
    run = load_run({**micro_run(grad_clip=grad_clip), "method": {
        "name": "qgalore", "rank": rank, "update_proj_gap": gap, **method}})
    method_ = build_method(run)
    torch.manual_seed(0)
    model = method_.prepare(nn.ModuleDict({"q_proj": nn.Linear(64, 32, bias=False)}), run)
    return model, method_, optimizer_for(method_, model, run)


def backward(model, opt, x: torch.Tensor, c: torch.Tensor, sync: bool = True) -> None:
    opt.sync = sync
    (model.q_proj(x) * c).sum().backward()


def test_accumulates_the_projected_gradient_and_updates_once():
    """Two micro-batches equal one batch of both: full G summed on an SVD step, the r×n
    projection otherwise; the weight moves only on the last micro-batch."""
    torch.manual_seed(1)
    xs, cs = torch.randn(3, 4, 64), torch.randn(3, 4, 32)
    model, _, opt = tiny(optimizer="adamw")
    whole, _, opt_w = tiny(optimizer="adamw")  # the same initial weights and generator
    layer, ref = model.q_proj, whole.q_proj
    for step, (x, c) in enumerate(zip(xs, cs, strict=True)):  # SVDs at steps 0 and 2
        codes, basis = layer.codes.clone(), opt.dequantized_basis(layer).get("left")
        first = opt.layer_state[layer]["moments"].get("exp_avg", torch.zeros(())).clone()
        backward(model, opt, x[:2], c[:2], sync=False)
        assert torch.equal(layer.codes, codes)
        assert opt.pending[layer].shape == ((32, 64) if step != 1 else (4, 64))
        backward(model, opt, x[2:], c[2:])
        assert not opt.pending and not torch.equal(layer.codes, codes)
        backward(whole, opt_w, x, c)
        a, b = opt.layer_state[layer], opt_w.layer_state[ref]
        assert a["updates"] == b["updates"] == step + 1
        if step == 1:  # the projected step: M = β1·M + (1 - β1)·Pᵀ(G1 + G2), G = cᵀx
            expected = 0.9 * first + 0.1 * basis.T @ (c.T @ x)
            torch.testing.assert_close(a["moments"]["exp_avg"], expected, rtol=1e-4, atol=1e-5)
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(a["moments"][k], b["moments"][k], rtol=1e-4, atol=1e-5)
        # same generator draws: codes agree except where a float-level difference crosses
        # a stochastic rounding threshold
        assert (layer.codes != ref.codes).float().mean() < 0.01
    assert opt.svd_stats()["svd_total"] == 2


def test_int4_basis_and_projection_match_q_galore_torch():
    from q_galore_torch.q_galore_projector import GaLoreProjector

    model, _, opt = tiny(rank=8)
    torch.manual_seed(2)
    x, c = torch.randn(5, 64), torch.randn(5, 32)
    backward(model, opt, x, c)
    reference = GaLoreProjector(8, update_proj_gap=2, proj_type="std", quant=True,
                                group_size=256, n_bit=4)
    low = reference.project(c.T @ x, 0)
    ref_basis = (reference.ortho_matrix_scales * (reference.ortho_matrix.float()
                 - reference.ortho_matrix_zeros)).reshape(32, 8)
    ours = opt.dequantized_basis(model.q_proj)["left"]
    torch.testing.assert_close(ours, ref_basis, rtol=0, atol=1e-7)
    torch.testing.assert_close(ours.T @ (c.T @ x), low, rtol=1e-5, atol=1e-5)


def test_a_failed_svd_waits_for_the_next_step(monkeypatch):
    model, method, opt = tiny()
    x, c, codes = torch.randn(2, 64), torch.randn(2, 32), model.q_proj.codes.clone()
    real_svd = torch.linalg.svd

    def broken(a, *args, **kwargs):
        raise torch.linalg.LinAlgError("failed to converge")

    monkeypatch.setattr(torch.linalg, "svd", broken)
    backward(model, opt, x, c)
    assert torch.equal(model.q_proj.codes, codes) and not opt.pending
    assert method.on_step(1, model, opt)["svd_failures"] == 1
    monkeypatch.setattr(torch.linalg, "svd", real_svd)
    backward(model, opt, x, c)  # due again: it runs and the weight moves
    assert not torch.equal(model.q_proj.codes, codes)
    assert opt.layer_state[model.q_proj]["updates"] == 1
    assert method.on_step(2, model, opt)["svd_total"] == 1


def test_accumulation_equals_one_batch_of_twice_the_size(tmp_path):
    losses = []
    for batch in (2, 4):
        data = qgalore_run(4, update_proj_gap=2, min_8bit_size=1)
        data["train"].update(batch_size=batch, total_batch_size=4)
        fit(load_run(data), tmp_path / str(batch))
        losses.append([r["loss"] for r in rows(tmp_path / str(batch), "train")])
    assert losses[0] == pytest.approx(losses[1], rel=1e-4, abs=0)
    assert losses[0][-1] < losses[0][0] - 0.5


@pytest.mark.parametrize("aligned", [True, False])
def test_lazy_gap_doubles_while_the_subspace_stays(aligned):
    """A rank-1 gradient of constant direction keeps the first singular vector: with queue 5
    and γ 2 the gap goes 2 → 4 (after the SVDs at 0..10) → 8 (14..30): 12 SVDs in 40 steps,
    not 20. Random directions never reach the threshold: the gap stays."""
    model, method, opt = tiny()
    torch.manual_seed(0)
    x, c = torch.randn(1, 64), torch.randn(1, 32)
    events = []
    for step in range(40):
        if not aligned:
            x, c = torch.randn(1, 64), torch.randn(1, 32)
        backward(model, opt, x, c)
        opt.step()
        opt.zero_grad()
        event = method.on_step(step + 1, model, opt)
        if event:
            events.append((step, event))
    last = events[-1][1]
    if aligned:
        assert [s for s, _ in events] == [0, 2, 4, 6, 8, 10, 14, 18, 22, 26, 30, 38]
        assert (last["svd_total"], last["svd_skipped"], last["gap_mean"]) == (12, 8, 8)
    else:
        assert (last["svd_total"], last["svd_skipped"], last["gap_mean"]) == (20, 0, 2)
    basis = opt.dequantized_basis(model.q_proj)["left"]  # packed INT4: 16 levels a group
    assert opt.layer_state[model.q_proj]["basis"]["left"]["packed"].numel() == 32 * 4 // 2
    assert basis.unique().numel() <= 16 and basis.shape == (32, 4)
    assert (basis.T @ basis - torch.eye(4)).abs().max() < 0.2


@pytest.mark.parametrize("reference", [False, True])
def test_resume_gives_the_same_losses_step_for_step(tmp_path, reference):
    # the gap grows 1 → 2 at step 3 and 2 → 4 at step 5: resuming at 3 needs LazyGap's state;
    # reference: its schedule and unclipped INT8 gradients (grad_clip 1.0 clips them otherwise)
    keys = {"lazy_schedule": "reference", "clip_int8": False} if reference else {}
    run = load_run(qgalore_run(6, update_proj_gap=1, queue_size=2, threshold=0.0,
                               min_8bit_size=1, **keys))
    train(run, tmp_path / "straight")
    first = train(run, tmp_path / "resumed", should_stop=lambda step: step == 3)
    assert (first["status"], first["step"]) == ("interrupted", 3)
    second = train(run, tmp_path / "resumed")
    assert second["status"] == "ok" and second["step"] == 6
    for kind in ("train", "event"):
        straight, resumed = (rows(tmp_path / d, kind) for d in ("straight", "resumed"))
        drop = ("tokens_per_s", "step_time_s", "memory_bytes")
        assert [{k: v for k, v in r.items() if k not in drop} for r in straight] == [
            {k: v for k, v in r.items() if k not in drop} for r in resumed]
    events = rows(tmp_path / "straight", "event")
    if reference:  # signed cosines: only the layers whose mean stays >= 0 grow their gap
        assert events[2]["step"] == 3 and events[-1]["svd_skipped"] > 0
    else:
        assert [e["step"] for e in events] == [1, 2, 3, 5]
    assert second["eval_loss"] == train(run, tmp_path / "straight")["eval_loss"]


def test_simulate_trains_float_weights_fake_quantized_in_forward(tmp_path):
    run = load_run(qgalore_run(24, simulate=True))
    trainer = fit(run, tmp_path)
    loss = [r["loss"] for r in rows(tmp_path, "train")]
    assert sum(loss[-4:]) / 4 < sum(loss[:4]) / 4 - 0.5
    q = trainer.model.model.layers[0].self_attn.q_proj
    original = q.parametrizations.weight.original
    assert original.dtype == torch.float32 and original.requires_grad
    rounded = dequantize_int8(*quantize_int8(original))
    assert torch.equal(q.weight, rounded) and not torch.equal(q.weight, original)
    basis = trainer.optimizer.state[original]["right"]  # square: right; INT4-rounded floats
    assert basis.shape == (8, 64) and all(g.unique().numel() <= 16 for g in basis.view(-1, 256))
    assert rows(tmp_path, "event")[0]["qgalore_svd"] == TARGETS
    check_estimate(run, trainer.costs)


def test_estimate_equals_measure_on_llama_60m():
    base = micro_model(0, "llama_60m", seq_len=8)
    shapes = {n: p.shape for n, p in base.named_parameters()}
    data = {**micro_run(batch_size=1, total_batch_size=1), "model": "llama_60m"}
    run = load_run({**data, "method": {"name": "qgalore"}})  # rank 128, 8-bit inner
    method = build_method(run)
    model = method.prepare(base, run)
    opt = optimizer_for(method, model, run)
    ids = torch.randint(0, VOCAB, (1, 8))
    watch = GradPeak(model, opt)  # G is dropped in backward: counted while it is alive
    model(input_ids=ids, labels=ids).loss.backward()
    counted = replace(memory_of(method).measure(model, opt), grad_bytes=watch.close())
    assert counted == memory_of(method).estimate(shapes, run)
    codes = sum(m.codes.numel() for m in model.modules() if isinstance(m, Int8Linear))
    assert counted.weight_bytes == codes + 4 * sum(p.numel() for p in model.parameters())
