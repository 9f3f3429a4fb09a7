"""FRUGAL against its algorithm written out from the paper (arXiv 2411.07837, Algorithm 1 with
FRUGAL(Adam, signSGD); no package provides it), through the method's own construction, across
subspace refreshes, with SVD and random subspaces; exact state bytes plain and layer-wise;
bf16-true; resume (the modifiers and precisions: tests/method_matrix.py; ddp and fsdp:
tests/train/test_equality.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import SAMPLE_VOCAB, assert_resumes_exactly, micro_model, micro_run
from package_steps import feed

from harness.methods import build_method, memory_of, optimizer_for
from harness.methods.resolve import load_run
from harness.methods.surgery import TARGETS
from harness.models import param_shapes

LR, WD, BETAS, EPS = 1e-2, 0.1, (0.9, 0.999), 1e-8


def frugal_run(steps: int = 6, **method: Any) -> dict[str, Any]:
    data = micro_run(steps=steps, lr=LR, grad_clip=None, weight_decay=WD)
    data["eval"] = {"every": 0, "tokens": 256}
    return {**data, "method": {"name": "frugal", "update_proj_gap": 2, **method}}


def svd_basis(g: torch.Tensor, rank: int) -> tuple[torch.Tensor, bool]:
    """The top-r singular vectors of G on its smaller side (m < n: left, U[:, :r])."""
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    left = g.shape[0] < g.shape[1]
    return (u[:, :rank] if left else vh[:rank]), left


@pytest.mark.parametrize("projection", ["svd", "random"])
def test_steps_as_the_papers_algorithm_across_refreshes(projection):
    """6 steps, T = 2, ρ = 0.25 (r = 16 of 64), decay 0.1: each split matrix
    W ← (1 − lr·wd)W − lr·P·Adam(PᵀG) − lr·sign(G − PPᵀG), Adam fresh at every refresh;
    svd: P the refresh gradient's top singular vectors, computed here (the update does not
    depend on their signs, the state being fresh); random: the optimizer's own draw, checked
    orthonormal and new at each refresh. Embeddings, head and norms: torch's fused AdamW.
    Measured, the gap over the motion: 1.2e-7 at most (no sign flipped); bound 2e-6."""
    model, ref = micro_model(), micro_model()
    run = load_run(frugal_run(projection=projection))
    ours = optimizer_for(build_method(run), model, run)
    named = list(ref.named_parameters())
    split = {i for i, (n, p) in enumerate(named) if p.dim() == 2 and any(t in n for t in TARGETS)}
    rest = [p for i, (_, p) in enumerate(named) if i not in split]
    adamw = torch.optim.AdamW([{"params": [p for p in rest if p.dim() == 2], "weight_decay": WD},
                               {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}],
                              lr=LR, fused=True)
    mine = list(model.parameters())
    states: dict[int, dict[str, Any]] = {}
    drawn: dict[int, list[torch.Tensor]] = {i: [] for i in split}
    t = 0

    def step() -> None:
        nonlocal t
        ours.step()
        adamw.step()
        with torch.no_grad():
            for i in split:
                p, g = named[i][1], named[i][1].grad
                if t % 2 == 0:
                    basis, left = svd_basis(g, 16)
                    if projection == "random":
                        st = ours.state[mine[i]]
                        basis = st["left"] if left else st["right"]
                        drawn[i].append(basis.clone())
                    states[i] = {"b": basis, "left": left, "m": 0.0, "v": 0.0, "k": 0}
                s = states[i]
                b, left = s["b"], s["left"]
                r = b.T @ g if left else g @ b.T
                s["k"] += 1
                s["m"] = BETAS[0] * s["m"] + (1 - BETAS[0]) * r
                s["v"] = BETAS[1] * s["v"] + (1 - BETAS[1]) * r * r
                n = (s["m"] / (1 - BETAS[0] ** s["k"])) / (
                    (s["v"] / (1 - BETAS[1] ** s["k"])).sqrt() + EPS)
                back = (lambda x: b @ x) if left else (lambda x: x @ b)  # noqa: B023
                p.mul_(1 - LR * WD).sub_(LR * back(n)).sub_(LR * torch.sign(g - back(r)))
        t += 1

    start = [p.detach().clone() for p in model.parameters()]
    feed([model, ref], 6, step)
    for i, (p, q, p0) in enumerate(zip(model.parameters(), ref.parameters(), start,
                                       strict=True)):
        motion = (q - p0).norm()
        assert motion > 1e-3, named[i][0]
        assert (p - q).norm() < 2e-6 * motion, named[i][0]
    for i in split if projection == "random" else ():
        first, second, third = drawn[i]
        for b in (first, second, third):
            gram = b.T @ b if b.shape[0] > b.shape[1] else b @ b.T
            assert torch.allclose(gram, torch.eye(16), atol=1e-5)
        assert (first - second).abs().max() > 0.1 and (second - third).abs().max() > 0.1


def test_every_split_matrix_gets_its_own_rank_from_the_density():
    """ρ = 0.25 of min(m, n): 16 for each llama_micro matrix (64, 176 sides); ρ = 0.1: 6."""
    for density, rank in ((0.25, 16), (0.1, 6)):
        run = load_run(frugal_run(density=density))
        groups = build_method(run).groups(micro_model(), run)
        ranks = [g.get("rank") for g in groups]
        assert ranks == [rank] * 14 + [None, None], density


# llama_micro at ρ = 0.25 (r = 16): per layer q, k, v, o 64×64 (right: Q 16×64, moments
# 64×16), gate, up 176×64 (Q 16×64, moments 176×16), down 64×176 (left: P 64×16, moments
# 16×176); embeddings, head 2×SAMPLE_VOCAB×64 and 5 norms of 64: AdamW at full rank.
BASES = 2 * 7 * 16 * 64
LOW = 2 * (4 * 64 * 16 + 2 * 176 * 16 + 16 * 176)
FULL = 2 * SAMPLE_VOCAB * 64 + 5 * 64


def test_state_bytes_of_llama_micro_counted_and_estimated():
    model = micro_model()
    run = load_run(frugal_run())
    method = build_method(run)
    optimizer = optimizer_for(method, model, run)
    feed([model], 1, optimizer.step)
    measured = memory_of(method).measure(model, optimizer)
    assert measured.optimizer_state_bytes == 8 * (LOW + FULL)
    assert measured.extra_bytes == 4 * BASES
    assert memory_of(method).estimate(param_shapes("llama_micro", SAMPLE_VOCAB), run) == measured


def test_bench_memory_counts_what_it_estimates_plain_and_layerwise(monkeypatch):
    from harness.bench import memory

    monkeypatch.setattr(memory, "METHODS",
                        {"frugal": {}, "frugal_layerwise": {"method": "frugal"}})
    records = memory.bench_memory("llama_micro", 3, 32, 2)
    assert all(memory.met(r) for r in records), [r for r in records if not memory.met(r)]
    states = {r["name"].split("/")[2]: r["value"] for r in records
              if r["name"].endswith("optimizer_state_bytes")}
    assert states == {"frugal": 8 * (LOW + FULL), "frugal_layerwise": 8 * (LOW + FULL)}


def test_resume_is_exact(tmp_path):
    data = frugal_run(steps=5, projection="random")
    data["train"].update(precision="bf16-true", update_compensation="kahan")
    assert_resumes_exactly(load_run(data), tmp_path, stop=3)


def test_fsdp_estimate_counts_what_a_rank_keeps():
    """fsdp over 2 at ρ 0.25 (r = 16), by hand: a right side's moments by W's rows (q, k, v,
    o: 32×16; gate, up: 88×16), a left side's by rows of r (down: 8×176), each ×2; Q whole
    (16×64), P by rows (32×16); embeddings and head 4096×64, norms 32, AdamW's two moments."""
    from harness.cost.estimate import estimate_run

    run = load_run({**micro_run(total_batch_size=4, parallel="fsdp"),
                    "method": {"name": "frugal"}})
    record = estimate_run(run, 2)
    low = 2 * 2 * (4 * 32 * 16 + 2 * 88 * 16 + 8 * 176)
    rest = 2 * (2 * (SAMPLE_VOCAB // 2) * 64 + 5 * 32)
    assert record["optimizer_state_bytes"] == 4 * (low + rest)
    assert record["extra_bytes"] == 4 * 2 * (6 * 16 * 64 + 32 * 16)
