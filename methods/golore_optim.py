"""GoLore (He et al., 2024, "Subspace Optimization for Large Language Models with Convergence
Guarantees", arXiv 2410.11289): GaLore whose refreshes from a switch step on draw the basis at
random, uniformly on the Stiefel manifold, instead of from the gradient's SVD; the subspace
then no longer follows the noise of a small batch, which is what the paper's convergence
guarantee needs. The paper runs GaLore first and GoLore for the last phase of training.

A random basis is the Q factor of a Gaussian matrix's QR, its columns' signs fixed by R's
diagonal, which makes it Haar-distributed (Mezzadri, 2007). It is drawn from a generator seeded
by the weight's own seed (its place among the projected weights, a group setting) and its
projection step, so a resumed run draws the same bases and the trainer's RNG never moves.
Under fsdp every rank draws the same whole basis and keeps what GaLore keeps of an SVD's
(methods/galore_optim.py): its rows of a left basis P, a right one Q whole; no communication.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from harness.distributed.rows import Rows
from harness.methods.galore_optim import GaLoreOptimizer

SEED_STRIDE = 1_000_003  # a prime above any projection step count: seeds never collide


def stiefel(k: int, rank: int, generator: torch.Generator, device: torch.device) -> Tensor:
    """A k×rank matrix with orthonormal columns, uniform on the Stiefel manifold (float32)."""
    q, r = torch.linalg.qr(torch.randn(k, rank, generator=generator, device=device))
    return q * torch.sign(torch.diagonal(r)).unsqueeze(0)


def random_basis(shape: tuple[int, ...], side: str, rank: int, seed: int,
                 dtype: torch.dtype, device: torch.device) -> dict[str, Tensor]:
    """A side's whole random basis: P (m×r) on the left, Q (r×n) on the right."""
    m, n = shape
    gen = torch.Generator(device).manual_seed(seed)
    out = {}
    if side in ("left", "full"):
        out["left"] = stiefel(m, rank, gen, device).to(dtype)
    if side in ("right", "full"):
        out["right"] = stiefel(n, rank, gen, device).T.to(dtype).contiguous()
    return out


class GoLoreOptimizer(GaLoreOptimizer):
    """GaLore's optimizer; a refresh at a projection step ≥ `switch_step` draws its basis at
    random (a group's `seed` tells its weight's draws apart)."""

    def __init__(self, params: Any, *, switch_step: int, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.switch_step = switch_step

    def _refresh(self, group: dict[str, Any], params: list[Tensor],
                 states: list[dict[str, Any]], sides: list[str]) -> None:
        late = [st["proj_step"] >= self.switch_step for st in states]
        svd = [i for i, flag in enumerate(late) if not flag]
        if svd:  # before the switch: GaLore's SVD (sharded or not)
            super()._refresh(group, [params[i] for i in svd], [states[i] for i in svd],
                             [sides[i] for i in svd])
        for p, st, side, flag in zip(params, states, sides, late, strict=True):
            if not flag:
                continue
            local = Rows(p).local
            seed = group.get("seed", 0) * SEED_STRIDE + st["proj_step"]
            basis = random_basis(tuple(p.shape), side, group["rank"], seed, local.dtype,
                                 local.device)
            if "left" in basis and self.sharded:  # this rank's rows of P
                basis["left"] = basis["left"][Rows.mine_of(basis["left"].shape[0])].clone()
            self._switch(group["moments"], st, basis)
