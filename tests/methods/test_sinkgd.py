"""SinkGD: the hidden matrices' update against the algorithm written out from the paper
(arXiv 2502.06742, Algorithms 3 and 4: no package provides it) and the rest against torch's
AdamW, through the method's own construction; exact state bytes (none for a hidden matrix),
plain and layer-wise; the groups' LRs; bf16-true; paged AdamW states; resume (the memory
modifiers and precisions: tests/method_matrix.py; ddp and fsdp: tests/train/test_equality.py)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from conftest import (
    SAMPLE_VOCAB,
    assert_estimate_matches,
    assert_resumes_exactly,
    micro_model,
    micro_run,
    train_losses,
)
from package_steps import feed

from harness.methods import build_method, memory_of, optimizer_for
from harness.methods.resolve import load_run
from harness.models import param_shapes
from harness.modifiers.compensation import KAHAN
from harness.train import train

# llama_micro: 2 layers of q, k, v, o (64x64) and gate, up (176x64), down (64x176): the hidden
# matrices; embeddings and head 2 x SAMPLE_VOCAB x 64; 5 norms of 64.
HIDDEN = 2 * (4 * 64 * 64 + 3 * 176 * 64)
OTHER = 2 * SAMPLE_VOCAB * 64 + 5 * 64


def sinkgd_run(steps: int = 4, method: dict[str, Any] | None = None,
               memory: dict | None = None, **train_keys: Any) -> dict[str, Any]:
    data = micro_run(steps=steps, grad_clip=None, **train_keys)
    data["eval"] = {"every": 0, "tokens": 256}
    return {**data, "method": {"name": "sinkgd", **(method or {})}, "memory": memory or {}}


def paper_sr_sinkhorn(g: torch.Tensor, iterations: int) -> torch.Tensor:
    """Algorithm 3 as the paper writes it, in matrices: X ← √n·Q(X)⁻¹X, then X ← √m·XR(X)⁻¹,
    Q and R the diagonal matrices of X's row and column l2 norms."""
    m, n = g.shape
    x = g
    for _ in range(iterations):
        x = math.sqrt(n) * torch.diag(1 / torch.linalg.norm(x, dim=1)) @ x
        x = math.sqrt(m) * x @ torch.diag(1 / torch.linalg.norm(x, dim=0))
    return x


@pytest.mark.parametrize("iterations", [5, 2])
def test_hidden_matrices_step_as_the_papers_algorithm_and_the_rest_as_torch_adamw(iterations):
    """Six steps at lr 1e-2, scale 0.05, decay 0.1: each hidden matrix W ← (1 − ηλ)W − η·
    SR-Sinkhorn(G), η = 0.05·lr (Algorithm 4, AdamW's decoupled decay); embeddings, head and
    norms bitwise torch's fused AdamW at lr (matrices decayed, norms not). The matrices are
    not bitwise: the paper's diagonal matmuls round otherwise than our in-place scaling.
    Measured, the difference's norm over the motion's: 5.2e-7 at most (L = 5); bound 2e-6.
    The iteration converges fast: one fewer (L = 4 against 5) is 9.1e-6; rows alone 9.1e-2."""
    model, ref = micro_model(), micro_model()
    run = load_run(sinkgd_run(method={"iterations": iterations, "scale": 0.05}, lr=1e-2,
                              weight_decay=0.1))
    ours = optimizer_for(build_method(run), model, run)
    named = dict(ref.named_parameters())
    names = {n for n, p in named.items()
             if p.dim() == 2 and "embed" not in n and "lm_head" not in n}
    hidden = [named[n] for n in names]
    rest = [p for p in named.values() if all(p is not h for h in hidden)]
    adamw = torch.optim.AdamW([{"params": [p for p in rest if p.dim() == 2], "weight_decay": 0.1},
                               {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}],
                              lr=1e-2, fused=True)
    eta = 0.05 * 1e-2
    start = [p.detach().clone() for p in model.parameters()]

    def step() -> None:
        ours.step()
        adamw.step()
        with torch.no_grad():
            for p in hidden:
                p.mul_(1 - eta * 0.1).sub_(eta * paper_sr_sinkhorn(p.grad, iterations))

    feed([model, ref], 6, step)
    for (name, p), q, p0 in zip(model.named_parameters(), ref.parameters(), start, strict=True):
        assert (p - p0).abs().max() > 3e-3, name
        if name in names:
            assert (p - q).norm() < 2e-6 * (q - p0).norm(), name
        else:
            assert torch.equal(p, q), name


def test_normalized_rows_and_columns_have_the_papers_norms():
    """The fixed point Algorithm 3 approaches: every column of norm √m (the last pass's, exact
    to rounding), every row of norm about √n, from a gradient whose rows differ 1000-fold."""
    torch.manual_seed(0)
    g = torch.randn(48, 80) * torch.logspace(-3, 0, 48).unsqueeze(1)
    model = torch.nn.Linear(80, 48, bias=False)
    model.weight.grad = g.clone()
    run = load_run(sinkgd_run(method={"scale": 1.0}, lr=1.0, weight_decay=0.0))
    before = model.weight.detach().clone()
    build_method(run).optimizer([{"params": [model.weight], "sinkgd": True, "lr": 1.0,
                                  "weight_decay": 0.0}], run).step()
    x = before - model.weight.detach()
    assert torch.allclose(x.norm(dim=0), torch.full((80,), math.sqrt(48)), rtol=1e-5)
    assert torch.allclose(x.norm(dim=1), torch.full((48,), math.sqrt(80)), rtol=2e-2)


def test_split_lrs_and_state_bytes_of_llama_micro():
    """Hidden matrices no state at all; the 7 other tensors two AdamW moments and torch's
    float32 step each; the hidden group at scale·lr. Counted from the real tensors after a
    step and predicted from shapes alone."""
    model = micro_model()
    run = load_run(sinkgd_run(method={"scale": 0.1}, lr=0.02, weight_decay=0.3))
    method = build_method(run)
    groups = method.groups(model, run)
    assert [(g["sinkgd"], len(g["params"]), g["lr"], g["weight_decay"]) for g in groups] == [
        (True, 14, pytest.approx(0.002), 0.3), (False, 2, 0.02, 0.3), (False, 5, 0.02, 0.0)]
    optimizer = optimizer_for(method, model, run)
    ids = torch.randint(0, SAMPLE_VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    assert sum(p.numel() for p in model.parameters()) == HIDDEN + OTHER
    assert not optimizer.state.get(model.model.layers[0].self_attn.q_proj.weight)
    measured = memory_of(method).measure(model, optimizer)
    assert measured.optimizer_state_bytes == 4 * (2 * OTHER + 7)
    assert memory_of(method).estimate(param_shapes("llama_micro", SAMPLE_VOCAB), run) == measured


def test_bench_memory_counts_what_it_estimates_plain_and_layerwise(monkeypatch):
    """`harness bench memory`'s comparison for sinkgd plain and layer-wise: every part met, the
    counted state bytes the hand count above in both."""
    from harness.bench import memory

    monkeypatch.setattr(memory, "METHODS",
                        {"sinkgd": {}, "sinkgd_layerwise": {"method": "sinkgd"}})
    records = memory.bench_memory("llama_micro", 3, 32, 2)
    assert all(memory.met(r) for r in records), [r for r in records if not memory.met(r)]
    states = {r["name"].split("/")[2]: r["value"] for r in records
              if r["name"].endswith("optimizer_state_bytes")}
    assert states == {"sinkgd": 4 * (2 * OTHER + 7), "sinkgd_layerwise": 4 * (2 * OTHER + 7)}


def test_bf16_true_kahan_keeps_only_the_compensation_of_a_hidden_matrix(tmp_path):
    run = load_run(sinkgd_run(steps=2, precision="bf16-true", update_compensation="kahan"))
    method = build_method(run)
    model = micro_model().to(torch.bfloat16)
    optimizer = optimizer_for(method, model, run)
    ids = torch.randint(0, SAMPLE_VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    assert set(optimizer.state[model.model.layers[0].self_attn.q_proj.weight]) == {KAHAN}
    summary = train(run, tmp_path / "t")
    assert summary["status"] == "ok", summary["error"]
    shapes = param_shapes("llama_micro", SAMPLE_VOCAB)
    assert_estimate_matches(memory_of(method).estimate(shapes, run), summary)


def test_paged_adamw_states_train_like_the_plain_ones(tmp_path):
    """The hidden matrices keep nothing to page; the AdamW part's states are bitsandbytes'
    paged ones (on a CPU its fallback: the same update), so the losses are the plain run's."""
    plain = sinkgd_run()
    paged = sinkgd_run(memory={"optimizer_offload": "paged"})
    assert train(load_run(plain), tmp_path / "plain")["status"] == "ok"
    assert train(load_run(paged), tmp_path / "paged")["status"] == "ok"
    assert train_losses(tmp_path / "paged") == train_losses(tmp_path / "plain")


def test_resume_is_exact(tmp_path):
    data = sinkgd_run(steps=4, precision="bf16-true", update_compensation="kahan")
    assert_resumes_exactly(load_run(data), tmp_path, stop=2)
