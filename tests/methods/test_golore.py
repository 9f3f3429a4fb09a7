"""GoLore, GaLore's `projection_after` setting (He et al., 2024, arXiv 2410.11289): before the
switch step bitwise GaLore; after it, every refresh a random orthonormal basis, seeded per
weight and step, and the update the paper's low-rank Adam on that basis (written out here);
the draws the same in a fresh optimizer and across a resume."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import assert_resumes_exactly, micro_model, micro_run
from package_steps import feed

from harness.errors import UserError
from harness.methods import build_method, optimizer_for
from harness.methods.resolve import load_run
from harness.methods.surgery import TARGETS

LR, SCALE, BETAS, EPS = 1e-2, 0.25, (0.9, 0.999), 1e-8


def golore_run(switch: int | None, steps: int = 6, **train: Any) -> dict[str, Any]:
    data = micro_run(steps=steps, lr=LR, grad_clip=None, weight_decay=0.0, **train)
    data["eval"] = {"every": 0, "tokens": 256}
    after = {} if switch is None else {"projection_after": {"step": switch, "kind": "random"}}
    return {**data, "method": {"name": "galore", "rank": 8, "update_proj_gap": 2,
                               "scale": SCALE, **after}}


def built(switch: int | None) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model, run = micro_model(), load_run(golore_run(switch))
    return model, optimizer_for(build_method(run), model, run)


def projected(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(n, p) for n, p in model.named_parameters()
            if p.dim() == 2 and any(t in n for t in TARGETS)]


def test_before_the_switch_it_is_galore_bitwise():
    """Switch at 6, gap 2: the refreshes at 0, 2, 4 are SVDs, so 6 steps are GaLore's."""
    (model, ours), (ref, galore) = built(6), built(None)

    def step() -> None:
        ours.step()
        galore.step()

    feed([model, ref], 6, step)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_after_the_switch_random_orthonormal_bases_and_the_papers_update():
    """Switch at 2, gap 2, 6 steps: an SVD basis at 0, random ones at 2 and 4. Each projected
    weight steps W ← W − lr·α·P·N, N = m̂/(√v̂ + ε) of R = PᵀG (GQᵀ on the right), its moments
    kept across the refreshes, P the basis the optimizer holds at that step. Measured over the
    motion: 4.1e-7 at most; bound 2e-6."""
    model, ours = built(2)
    names = projected(model)
    ref = {n: p.detach().clone() for n, p in names}
    moments = {n: (0.0, 0.0) for n, _ in names}
    start = {n: p.clone() for n, p in ref.items()}
    bases: dict[str, list[torch.Tensor]] = {n: [] for n, _ in names}
    t = 0

    def step() -> None:
        nonlocal t
        ours.step()
        t += 1
        for n, p in names:
            st = ours.state[p]
            left = "left" in st
            b = st["left"] if left else st["right"]
            bases[n].append(b.clone())
            r = b.T @ p.grad if left else p.grad @ b.T
            m, v = moments[n]
            m, v = BETAS[0] * m + (1 - BETAS[0]) * r, BETAS[1] * v + (1 - BETAS[1]) * r * r
            moments[n] = (m, v)
            nn = (m / (1 - BETAS[0] ** t)) / ((v / (1 - BETAS[1] ** t)).sqrt() + EPS)
            ref[n] -= LR * SCALE * (b @ nn if left else nn @ b)

    feed([model], 6, step)
    for n, p in names:
        motion = (ref[n] - start[n]).norm()
        assert motion > 1e-3, n
        assert (p - ref[n]).norm() < 2e-6 * motion, n
        seen = bases[n]  # the basis of each step: refreshes at 0, 2, 4
        assert torch.equal(seen[0], seen[1]) and torch.equal(seen[2], seen[3]), n
        for b in (seen[2], seen[4]):
            gram = b.T @ b if b.shape[0] > b.shape[1] else b @ b.T
            assert torch.allclose(gram, torch.eye(8), atol=1e-5), n
        assert (seen[2] - seen[4]).abs().max() > 0.1, n  # a new draw each refresh
    q0 = bases[names[0][0]][4]
    q1 = bases[names[1][0]][4]  # k_proj: the same shape as q_proj, another seed
    assert q0.shape == q1.shape and (q0 - q1).abs().max() > 0.1


def test_a_random_basis_is_not_the_gradients_svd_and_is_drawn_again_alike():
    """At the switch the basis leaves the gradient's top subspace (the SVD's captures far
    more of G); a second optimizer on other gradients draws the very same bases."""
    model, ours = built(0)
    other, again = built(0)
    feed([model], 1, ours.step)
    gen = torch.Generator().manual_seed(7)
    for p in other.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
    again.step()
    for (n, p), (_, q) in zip(projected(model), projected(other), strict=True):
        st, key = ours.state[p], "left" if "left" in ours.state[p] else "right"
        assert torch.equal(st[key], again.state[q][key]), n
        g = p.grad
        u, _, vh = torch.linalg.svd(g, full_matrices=False)
        svd = u[:, :8] if key == "left" else vh[:8]
        assert kept(g, st[key], key) < 0.8 * kept(g, svd, key), n


def kept(g: torch.Tensor, basis: torch.Tensor, side: str) -> torch.Tensor:
    """The norm of G's projection on a basis: PᵀG, or GQᵀ on the right."""
    return (basis.T @ g if side == "left" else g @ basis.T).norm()


def test_an_unknown_projection_kind_is_refused_in_one_line():
    data = golore_run(None)
    data["method"]["projection_after"] = {"step": 2, "kind": "svd"}
    with pytest.raises(UserError, match="projection_after"):
        load_run(data)


def test_resume_across_the_switch_is_exact(tmp_path):
    """Stopped after step 3 (a random basis drawn at 2), resumed: every loss the same."""
    run = load_run({**golore_run(2, steps=5), "eval": {"every": 0, "tokens": 256}})
    assert_resumes_exactly(run, tmp_path, stop=3)
