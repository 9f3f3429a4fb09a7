"""APOLLO's optimizer (Zhu et al., 2024, Algorithm 1): Adam's moments live in a rank-r
projection of each gradient and serve only to measure how much Adam would rescale each channel
(or the whole tensor); the full gradient, rescaled by that, is the update.

For a targeted m×n gradient G (the smaller side projected, as GaLore's `std`): R = PᵀG (r×n,
m < n) or GQᵀ (m×r), Adam on R gives Ñ, and each channel j of the larger dimension gets
s_j = ‖Ñ_j‖ / (‖R_j‖ + 1e-8) (`scale_type: channel`; `tensor`: one s = ‖Ñ‖ / (‖R‖ + 1e-8)).
The update U = G·s passes Fira's norm-growth limiter (its norm may grow at most by `gamma` a
step) and W -= lr·√scale·U, in place: ‖U‖ is computed from per-channel norms, so no full-size
temporary exists. A random P (`proj: random`, entries N(0, 1/r)) is drawn again each step from
a seed kept in the state, never stored, and the seed advances every `update_proj_gap` steps as
the reference's does, so the same seed gives the reference's projections bit for bit; `svd`
keeps GaLore's SVD basis (stored), retried in float64 and otherwise kept when it fails.
Other parameters, and targets at a rank ≥ min(m, n), get plain AdamW. The elementwise Adam math
runs in methods/adam_kernel.py (fused, or 8-bit blockwise); under bf16-true with float32 states
or an update compensation, updates are added by modifiers/compensation.add_update.

Under fsdp each rank holds its rows of W and G (methods/apollo.py `check` names what is
not sharded). The random P is drawn whole from its seed on every rank; a right side's R = GQᵀ
is this rank's rows of R, a left side's PᵀG the sum over ranks of P's rows times G's (an
all-reduce of r×n), the same R on every rank, as GaLore's. A norm over a row-split tensor's
rows (a left side's channels of G, a tensor's whole norm, the limiter's ‖U‖) sums its squares
over ranks; a per-row norm stays local. Every state a rank keeps is its rows, but a left
side's moments, whole on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from harness.distributed.rows import Rows
from harness.methods.adam_kernel import AdamKernel
from harness.methods.projection import project, safe_basis, side_of
from harness.modifiers.compensation import add_update, kernel_steps, restore_dtypes
from harness.modifiers.multi_tensor import Views

TINY = 1e-8  # the reference's guard in the scaling factor's and the limiter's denominators
SEED_ADVANCE = 0xF  # draws the reference's next seed skips


def next_seed(seed: int) -> int:
    """The seed of the next projection: the reference's rule (the 15th int64 drawn from a CPU
    generator seeded with `seed`), so that its projections are ours after a refresh too."""
    gen = torch.Generator().manual_seed(seed)
    return int(torch.randint(0, torch.iinfo(torch.int64).max, (SEED_ADVANCE,), generator=gen)[-1])


def random_basis(grad: Tensor, side: str, rank: int, seed: int) -> dict[str, Tensor]:
    """P with N(0, 1/r) entries from `seed`, drawn on the gradient's device in float32 and
    cast to its dtype, as the reference draws it: m×r on the left, r×n on the right."""
    m, n = grad.shape
    gen = torch.Generator(grad.device).manual_seed(seed)
    size = (m, rank) if side == "left" else (rank, n)
    p = torch.randn(size, generator=gen, device=grad.device, dtype=torch.float32)
    return {side: (p / math.sqrt(rank)).to(grad.dtype)}


class APOLLOScaling:
    """APOLLO's rule for one group's gradients: each one's projection, Adam on it (the moments
    in the states given) and the factor its gradient is scaled by. Shared by APOLLOOptimizer
    (float weights) and APOLLOInt8Optimizer (INT8 weights updated in backward)."""

    def __init__(self, inner: str, min_8bit_size: int, limiter: bool, gamma: float,
                 state_dtype: torch.dtype | None) -> None:
        self.adam = AdamKernel(inner == "adam8bit", min_8bit_size)
        self.limiter, self.gamma, self.state_dtype = limiter, gamma, state_dtype
        self.refreshes = 0  # projections (re)made since the last `take_refreshes`
        self.svd_failures = 0  # SVDs that failed in float32 and float64: the basis was kept

    def take_refreshes(self) -> int:
        n, self.refreshes = self.refreshes, 0
        return n

    def inner_grads(self, grads: list[Tensor]) -> list[Tensor]:
        """What Adam sees, in the moments' dtype."""
        return grads if self.state_dtype is None else [g.to(self.state_dtype) for g in grads]

    def factors(self, group: dict[str, Any], grads: list[Tensor],
                states: list[dict[str, Any]]) -> list[Tensor | None]:
        """√scale · s / limiter of each gradient (under fsdp for this rank's rows); None where
        a first SVD failed (that weight waits a step)."""
        bases = [self._basis(group, st, g) for g, st in zip(grads, states, strict=True)]
        live = [i for i, b in enumerate(bases) if b is not None]
        sides = {i: next(iter(bases[i])) for i in live}
        lows = self.inner_grads([_projected(grads[i], bases[i], sides[i]) for i in live])
        updates = [torch.zeros_like(r) for r in lows]  # Adam leaves -Ñ there (lr 1, no decay)
        self.adam(group, updates, lows, [states[i] for i in live], 1.0, 0.0)
        out: list[Tensor | None] = [None] * len(grads)
        for i, r, u in zip(live, lows, updates, strict=True):
            out[i] = self._factor(group, grads[i], r, u, states[i], sides[i])
        return out

    def _basis(self, group: dict[str, Any], st: dict[str, Any],
               grad: Tensor) -> dict[str, Tensor] | None:
        """This step's projection. Due every `update_proj_gap` Adam steps from the first, as
        the reference's `step % gap == 0`: a random one's seed advances (the first uses the
        initial seed), an SVD one is recomputed from this gradient."""
        rank, side = group["rank"], _side(group, grad)
        step = st.get("step", 0)
        due = step % group["update_proj_gap"] == 0
        self.refreshes += due
        if group["proj"] == "random":
            if due and step:
                st["seed"] = next_seed(st["seed"])
            return random_basis(grad, side, rank, st["seed"])
        if due or side not in st:
            basis, _ = safe_basis(grad, side, rank)
            if basis is None:
                self.svd_failures += 1
            else:
                st.update(basis)
        return {side: st[side]} if side in st else None

    def _factor(self, group: dict[str, Any], grad: Tensor, low: Tensor, update: Tensor,
                st: dict[str, Any], side: str) -> Tensor:
        """√scale · s / limiter in float32: (1, n) or (m, 1) per channel, () per tensor; under
        fsdp (m, 1) is this rank's rows."""
        dim = 0 if side == "left" else 1  # the projected dimension: channels are the other one
        rows = Rows(grad)
        split = rows.sharded  # G is this rank's rows; a right side's R too
        low_split, grad = split and side == "right", rows.local
        if group["scale_type"] == "channel":
            s = _norm(update, low_split, dim) / (_norm(low, low_split, dim) + TINY)
            norm = _norm(s * _norm(grad, split, dim), low_split)  # ‖G·s‖ without G·s
        else:
            s = _norm(update, low_split) / (_norm(low, low_split) + TINY)
            norm = s * _norm(grad, split)
        if self.limiter:  # on ‖U‖ before Adam's bias correction, as the reference measures it
            (b1, b2), t = group["betas"], st["step"]
            norm = norm * ((1 - b1**t) / math.sqrt(1 - b2**t))
            prev = st.get("prev_norm")
            if prev is None:
                st["prev_norm"] = norm
            else:  # ‖U‖ may grow by gamma a step at most
                cut = torch.clamp(norm / (prev + TINY), min=self.gamma) / self.gamma
                s = s / cut
                prev.copy_(norm / cut)
        return s.mul_(math.sqrt(group["scale"]))


def _projected(grad: Tensor, basis: dict[str, Tensor], side: str) -> Tensor:
    """R of `grad`: under fsdp a right side's rows of it, a left side's PᵀG summed over ranks
    from P's rows times this rank's rows of G."""
    rows = Rows(grad)
    if not rows.sharded:
        return project(grad, basis, side)
    if side == "left":
        return rows.sum(project(rows.local, {"left": rows.mine(basis["left"])}, side))
    return project(rows.local, basis, side)


def _norm(t: Tensor, split: bool, dim: int | None = None) -> Tensor:
    """‖t‖ in float32, over `dim` (kept) or all of it. `split`: t is this rank's rows of a
    row-sharded whole, so a norm over its rows sums the squares over ranks."""
    kept = {"dim": dim, "keepdim": True} if dim is not None else {}
    if not split or dim == 1:
        return torch.linalg.vector_norm(t, dtype=torch.float32, **kept)
    squares = torch.linalg.vector_norm(t, dtype=torch.float32, **kept).square()
    return Rows.total(squares).sqrt()


class APOLLOOptimizer(torch.optim.Optimizer):
    """Groups with a `rank` are scaled APOLLO's way; the others get AdamW. A group's `seed` is
    its first parameter's first projection seed (the next ones count up); None: the
    reference's numbering, 1, 2, … over every parameter of every group."""

    def __init__(self, params: Iterable[Any], *, lr: float,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, inner: str = "adamw", update_proj_gap: int = 200,
                 scale: float = 1.0, proj: str = "random", scale_type: str = "channel",
                 limiter: bool = True, gamma: float = 1.01, min_8bit_size: int = 4096,
                 state_dtype: torch.dtype | None = None, compensation: str = "none",
                 update_chunk: int = 0) -> None:
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
                    "rank": None, "seed": None, "update_proj_gap": update_proj_gap,
                    "scale": scale, "proj": proj, "scale_type": scale_type}
        super().__init__(params, defaults)
        self.scaling = APOLLOScaling(inner, min_8bit_size, limiter, gamma, state_dtype)
        self.compensation = compensation
        self.exact = state_dtype is not None or compensation != "none"
        # multi-tensor exact updates of unprojected weights (torch's fused kernel only)
        self.chunk, self.views = (update_chunk if inner == "adamw" else 0), Views()
        index = 0
        for group in self.param_groups:
            for i, p in enumerate(group["params"]):
                index += 1
                self.state[p]["seed"] = index if group["seed"] is None else group["seed"] + i

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            low = [p for p in params if _side(group, p) != "none"]
            plain = [p for p in params if _side(group, p) == "none"]
            if plain:
                self._plain_step(group, plain)
            if low:
                self._apollo_step(group, low)
        self.views.done()
        return loss

    def _plain_step(self, group: dict[str, Any], params: list[Tensor]) -> None:
        lr, wd = group["lr"], group["weight_decay"]
        states = [self.state[p] for p in params]
        if self.exact and self.chunk:  # by chunks: a chunk's float32 temporaries
            kernel_steps(self.scaling.adam, group, [Rows(p).local for p in params],
                         [Rows(p.grad).local for p in params], states,
                         self.scaling.state_dtype, self.compensation, self.chunk)
            return
        if self.exact:  # one weight at a time: one weight's float32 temporaries, not all
            for p, st in zip(params, states, strict=True):
                self._plain_exact(group, p, st)
            return
        grads = self.scaling.inner_grads([Rows(p.grad).local for p in params])
        self.scaling.adam(group, [Rows(p).local for p in params], grads, states, lr, wd)

    def _plain_exact(self, group: dict[str, Any], p: Tensor, st: dict[str, Any]) -> None:
        grads = self.scaling.inner_grads([Rows(p.grad).local])
        update = torch.zeros_like(grads[0])  # Adam leaves -N there (lr 1, no decay)
        self.scaling.adam(group, [update], grads, [st], 1.0, 0.0)
        del grads
        self._add(group, Rows(p).local, update.float().mul_(group["lr"]), st)

    def _add(self, group: dict[str, Any], p: Tensor, update: Tensor, st: dict[str, Any]) -> None:
        """W ← W - lr·wd·W + update, the float32 sum rounded by the run's compensation."""
        add_update(p, update, self.compensation, st, group["lr"] * group["weight_decay"])

    def _apollo_step(self, group: dict[str, Any], params: list[Tensor]) -> None:
        states = [self.state[p] for p in params]
        factors = self.scaling.factors(group, [p.grad for p in params], states)
        lr, wd = group["lr"], group["weight_decay"]
        for p, factor, st in zip(params, factors, states, strict=True):
            if factor is None:
                continue
            p, grad = Rows(p).local, Rows(p.grad).local
            if self.exact:
                self._add(group, p, grad.float().mul_(factor).mul_(-lr), st)
                continue
            if wd:
                p.mul_(1 - lr * wd)
            p.addcmul_(grad, factor.to(p.dtype), value=-lr)

    def state_dict(self) -> dict[str, Any]:
        """Under fsdp, states of this rank's rows (all but a left side's moments) are placed as
        row shards, which a checkpoint writes shard by shard."""
        sd = super().state_dict()
        for index, p in enumerate(self._rowwise()):
            if index in sd["state"] and p is not None:
                sd["state"][index] = Rows(p).save(sd["state"][index], ())
        sd["svd_failures"] = self.scaling.svd_failures
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Float32 moments of bf16 weights and 8-bit states come back as saved; under fsdp
        whole row states are cut to this rank's rows."""
        restore_dtypes(self, super().load_state_dict, state_dict)
        for p in self._rowwise():
            if p is not None and p in self.state:
                Rows(p).load(self.state[p], ())
        self.scaling.svd_failures = state_dict.get("svd_failures", 0)

    def _rowwise(self) -> list[Tensor | None]:
        """Each parameter in state_dict's order, None where its states are whole (a left
        side's moments are the same r×n on every rank)."""
        return [None if _side(g, p) == "left" else p
                for g in self.param_groups for p in g["params"]]


def _side(group: dict[str, Any], p: Tensor) -> str:
    """The projected side of a matrix in a `rank` group ("none": updated by plain AdamW)."""
    if not group["rank"] or p.dim() != 2:
        return "none"
    return side_of(tuple(p.shape), "std", group["rank"])
