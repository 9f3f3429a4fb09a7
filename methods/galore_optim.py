"""GaLore's optimizer (Zhao et al., 2024, Algorithm 2): the inner optimizer's states live in a
low-rank subspace of each gradient, refreshed by SVD every `update_proj_gap` steps.

For a targeted m×n weight with gradient G and orthonormal basis P (m×r, "left") or Q (r×n,
"right"), the inner optimizer sees R = PᵀG (or GQᵀ, or PᵀGQᵀ for "full"), keeps its moments
at R's size, and its update N comes back as W += α·lr·PN. The elementwise Adam math runs in
torch's fused AdamW kernel (or bitsandbytes' 8-bit one) on a zeroed scratch tensor with lr 1,
which leaves exactly -N there; back-projection, scale and learning rate are then one `addmm_`
into the weight, with no full-size temporaries. Fixes over the reference code: an SVD that
fails or returns non-finite values is retried in float64 and otherwise the previous basis kept
(GaLore#7, #26, #58); moments can be reset or rotated into the new basis (GaLore#54); the
8-bit inner optimizer runs on CPU; state_dict carries bases and counters for exact resume.
Layer-wise under gradient accumulation, `fold` keeps ΣR instead of ΣG between micro-batches
(projection is linear), except on the steps that refresh the basis (docs/methods.md#galore).
Under bf16-true with float32 states or an update compensation, the moments run in `state_dtype`
and each update comes back in float32 to be added by modifiers/compensation.add_update (one
full-size temporary per weight; the unprojected weights by multi-tensor chunks of whole
tensors, `update_chunk`, compensation.kernel_steps); with bfloat16 states and `none`, the
fused path above is the reference code's arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from harness.distributed.rows import Rows
from harness.errors import UserError
from harness.methods.adafactor import adafactor
from harness.methods.adam_kernel import BLOCK, AdamKernel
from harness.methods.galore_state import ABSMAX, BASIS_KEYS, LEFT_WHOLE, MOMENT_KEYS, QMAPS, SPLIT
from harness.methods.projection import (
    SVDCounts,
    back_projected,
    compute_basis,
    lowrank_shape,
    project,
    project_back_,
    rotate,
    side_of,
    spread_bases,
    square,
)
from harness.modifiers.compensation import add_update, kernel_steps, restore_dtypes
from harness.modifiers.multi_tensor import Views


class GaLoreOptimizer(SVDCounts, torch.optim.Optimizer):
    """Groups with a `rank` are projected; the others get the inner optimizer at full rank."""

    def __init__(self, params: Iterable[Any], *, lr: float,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, inner: str = "adamw",
                 proj_type: str = "std", update_proj_gap: int = 200, scale: float = 0.25,
                 moments: str = "keep", svd: str = "exact", min_8bit_size: int = 4096,
                 adafactor_beta1: float | None = None, state_dtype: torch.dtype | None = None,
                 compensation: str = "none", update_chunk: int = 0) -> None:
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
                    "rank": None, "proj_type": proj_type, "update_proj_gap": update_proj_gap,
                    "scale": scale, "moments": moments, "svd": svd}
        super().__init__(params, defaults)
        self.inner, self.min_8bit_size, self.beta1 = inner, min_8bit_size, adafactor_beta1
        self.adam = AdamKernel(inner == "adam8bit", min_8bit_size)
        # state_dtype: the moments' dtype when it is not the gradients' (None: theirs)
        self.state_dtype, self.compensation = state_dtype, compensation
        self.exact = state_dtype is not None or compensation != "none"
        # multi-tensor exact updates of unprojected weights (torch's fused kernel only)
        self.chunk, self.views = (update_chunk if inner == "adamw" else 0), Views()
        if inner == "adam8bit" and self.sharded:
            self._check_blocks()

    def _check_blocks(self) -> None:
        """fsdp: 8-bit moments kept by rows (an unprojected tensor's, a side's) must split
        into the same whole number of 256-value blocks on every rank, or the blocks are not
        the whole tensor's; one line naming the first that would not."""
        for p, side, rank in self._sides():
            shape = _moment_shape(p, side, rank)
            if side != "full" and math.prod(shape) >= self.min_8bit_size \
                    and not Rows.aligned(shape, BLOCK):
                layout, ranks = Rows.layout()
                raise UserError(
                    f"optimizer adam8bit with {layout}: the {shape} moments of a "
                    f"{tuple(p.shape)} weight do not split into equal whole numbers of "
                    f"{BLOCK}-value blocks, which 8-bit states quantize; use {ranks} that "
                    "divides their rows so, or train.parallel: ddp")

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"]
                      if p.grad is not None or "folded" in self.state.get(p, ())]
            if params and group["rank"]:
                self._galore_step(group, params)
            elif params:
                self._plain_step(group, params)
        self.views.done()
        return loss

    @torch.no_grad()
    def fold(self, p: Tensor, last: bool) -> Tensor | None:
        """Layer-wise accumulation (harness/modifiers/layerwise.py): this micro-batch's R = PᵀG
        joins p's low-rank sum and p.grad is freed. A sum opens before the last micro-batch only,
        and only for a projected p whose basis this step keeps; a refresh needs the whole G for
        its SVD, so p.grad then accumulates in full. Returns the sum (None: p.grad is kept).
        Under fsdp p.grad is this rank's reduced rows: R as `_low_rank` forms it."""
        group = next(g for g in self.param_groups if any(q is p for q in g["params"]))
        side = side_of(p.shape, group["proj_type"], group["rank"]) if group["rank"] else "none"
        st = self.state.get(p, {})  # a sum opens only where a basis (so a state) exists
        if "folded" not in st and (last or side == "none" or _due(st, group["update_proj_gap"])):
            return None
        r = project(Rows(p.grad).local, st, side)
        if side in ("left", "full"):
            Rows(p).sum(r)
        st["folded"] = st["folded"].add_(r) if "folded" in st else r
        p.grad = None
        return st["folded"]

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for st in self.state.values():
            st.pop("folded", None)

    @property
    def sharded(self) -> bool:
        """fsdp: the parameters are DTensor row shards (all of them, or none)."""
        return Rows(self.param_groups[0]["params"][0]).sharded

    def held_gradients(self) -> dict[Tensor, Tensor]:
        """The low-rank sums `fold` keeps between micro-batches (harness/cost/grad_peak.py)."""
        return {p: st["folded"] for p, st in self.state.items() if "folded" in st}

    # -- full-rank parameters -------------------------------------------------------------
    def _plain_step(self, group: dict[str, Any], params: list[Tensor]) -> None:
        lr, wd = group["lr"], group["weight_decay"]
        states = [self.state[p] for p in params]
        sizes = [p.numel() for p in params]  # whole: they choose 8-bit states (fsdp: rows)
        if self.exact and self.chunk:  # by chunks: a chunk's temporaries
            kernel_steps(self.adam, group, [Rows(p).local for p in params],
                         [Rows(p.grad).local for p in params], states, self.state_dtype,
                         self.compensation, self.chunk)
            return
        if self.exact and self.inner != "adafactor":  # one weight at a time: its temporaries
            for p, st, n in zip(params, states, sizes, strict=True):
                self._plain_exact(group, p, st, n)
            return
        grads = self._inner_grads([Rows(p.grad).local for p in params])
        params, sides = [Rows(p).local for p in params], ["none"] * len(params)
        if self.inner == "adafactor":
            updates = adafactor(group["lr"], self.beta1, states, grads)
            self._apply(group, params, updates, states, sides, -1.0)
        else:
            self.adam(group, params, grads, states, lr, wd, sizes)

    def _plain_exact(self, group: dict[str, Any], p: Tensor, st: dict[str, Any], n: int) -> None:
        """Adam leaves -N in a zeroed scratch tensor (lr 1, no decay there), which `_apply`
        hands to add_update: two float32 copies of one weight at most."""
        grads = self._inner_grads([Rows(p.grad).local])
        update = torch.zeros_like(grads[0])
        self.adam(group, [update], grads, [st], 1.0, 0.0, [n])
        del grads
        self._apply(group, [Rows(p).local], [update], [st], ["none"], group["lr"])

    def _inner_grads(self, grads: list[Tensor]) -> list[Tensor]:
        """What the inner optimizer sees, in the moments' dtype."""
        return grads if self.state_dtype is None else [g.to(self.state_dtype) for g in grads]

    def _apply(self, group: dict[str, Any], params: list[Tensor], updates: list[Tensor],
               states: list[dict[str, Any]], sides: list[str], alpha: float,
               bases: list[dict[str, Any]] | None = None,
               held: list[Tensor | None] | None = None) -> None:
        """W ← W - lr·wd·W + alpha·(update brought back); decoupled decay on the full weight.
        `params` are what this rank holds (its rows under fsdp), `bases` the projections cut
        to them (default: the states' own), `held` the gradients' rows (Fira's residual)."""
        lr, wd = group["lr"], group["weight_decay"]
        bases = bases or states
        if not self.exact:  # in place, in the weights' dtype: no full-size temporaries
            if wd:
                torch._foreach_mul_(params, 1 - lr * wd)
            for p, u, b, side in zip(params, updates, bases, sides, strict=True):
                project_back_(p, u, b, side, alpha)
            return
        for p, u, st, b, side in zip(params, updates, states, bases, sides, strict=True):
            add_update(p, back_projected(u, b, side).mul_(alpha), self.compensation, st, lr * wd)

    # -- projected parameters -------------------------------------------------------------
    def _galore_step(self, group: dict[str, Any], params: list[Tensor]) -> None:
        rank, gap = group["rank"], group["update_proj_gap"]
        sides = [side_of(p.shape, group["proj_type"], rank) for p in params]
        states = [self.state[p] for p in params]
        for st in states:
            st.setdefault("proj_step", 0)
        due = [i for i, (st, side) in enumerate(zip(states, sides, strict=True))
               if side != "none" and _due(st, gap)]
        if due:
            self._refresh(group, [params[i] for i in due], [states[i] for i in due],
                          [sides[i] for i in due])
        live = [i for i, st in enumerate(states) if sides[i] == "none" or _has_basis(st)]
        params = [params[i] for i in live]  # a weight whose first SVD failed waits a step
        states, sides = [states[i] for i in live], [sides[i] for i in live]
        split = [self.sharded and side == "left" for side in sides]  # R's rows, `_low_rank`
        held = [Rows(p.grad).local for p in params]  # G (this rank's rows), for Fira's residual
        sizes = [math.prod(_moment_shape(p, side, rank))  # whole: they choose 8-bit states
                 for p, side in zip(params, sides, strict=True)]
        grads = self._inner_grads([_low_rank(p, st, s, sp) for p, st, s, sp
                                   in zip(params, states, sides, split, strict=True)])
        params = [Rows(p).local for p in params]
        lr, scale = group["lr"], group["scale"]
        if self.inner == "adafactor":
            updates, alpha = adafactor(group["lr"], self.beta1, states, grads), -scale
        else:  # Adam leaves -N in a zeroed scratch tensor: lr 1, no decay there
            updates, alpha = [torch.zeros_like(g) for g in grads], lr * scale
            self.adam(group, updates, grads, states, 1.0, 0.0, sizes)
        # a left side's N whole: each rank's rows of W take all of it (an all-gather of r×n)
        updates = [Rows.joined(u, rank) if sp else u for u, sp in zip(updates, split, strict=True)]
        self._apply(group, params, updates, states, sides, alpha, states, held)
        for st in states:
            st["proj_step"] += 1

    def _refresh(self, group: dict[str, Any], params: list[Tensor],
                 states: list[dict[str, Any]], sides: list[str]) -> None:
        """New bases by SVD in float32; one host sync checks them all for non-finite values."""
        if params and Rows(params[0]).sharded:
            self._refresh_sharded(group, params, states, sides)
            return
        rank, randomized = group["rank"], group["svd"] == "randomized"
        self.svd_attempts += len(params)
        found = [compute_basis(p.grad, side, rank, randomized, st["proj_step"], torch.float32)
                 for p, st, side in zip(params, states, sides, strict=True)]
        checks = [torch.stack([t.isfinite().all() for t in b.values()]).all()
                  for b in found if b is not None]
        finite = iter(torch.stack(checks).tolist() if checks else [])
        for p, st, side, basis in zip(params, states, sides, found, strict=True):
            if basis is not None and not next(finite):
                basis = None
            if basis is None:
                basis = compute_basis(p.grad, side, rank, randomized, st["proj_step"],
                                      torch.float64)
                if basis is None or not all(t.isfinite().all() for t in basis.values()):
                    self.svd_failures += 1  # keep the previous basis (or wait for one)
                    continue
                self.svd_retries += 1
            self._switch(group["moments"], st, basis)

    def _refresh_sharded(self, group: dict[str, Any], params: list[Tensor],
                         states: list[dict[str, Any]], sides: list[str]) -> None:
        """fsdp: each SVD computed by one rank, the bases sent as tensors (`spread_bases`):
        a rank keeps its rows of a left basis P, and a right one Q whole."""
        self.svd_attempts += len(params)
        found = spread_bases([Rows(p.grad).local for p in params],
                             [tuple(p.shape) for p in params], sides, group["rank"],
                             group["svd"] == "randomized", [st["proj_step"] for st in states])
        for st, (basis, retried) in zip(states, found, strict=True):
            if basis is None:
                self.svd_failures += 1  # keep the previous basis (or wait for one)
                continue
            self.svd_retries += retried
            self._switch(group["moments"], st, basis)

    def _switch(self, policy: str, st: dict[str, Any], basis: dict[str, Tensor]) -> None:
        old = {k: st[k] for k in BASIS_KEYS if k in st}
        st.update(basis)
        if not old or "step" not in st or policy == "keep":  # keep: the paper
            return
        if policy == "reset":  # a fresh inner optimizer in the new subspace, bias correction too
            for k in MOMENT_KEYS:
                if k in st:
                    st[k].zero_()
            st["step"] = 0
            return
        cl = basis["left"].T @ old["left"] if "left" in old else None
        if cl is not None and self.sharded:  # each rank's rows of P: their part of PᵀP'
            Rows.total(cl)
        cr = basis["right"] @ old["right"].T if "right" in old else None
        self._reproject(st, cl, cr)

    def _reproject(self, st: dict[str, Any], cl: Tensor | None, cr: Tensor | None) -> None:
        """First moment: M ← C_L M C_Rᵀ. Second moment: V ← (C_L∘C_L) V (C_R∘C_R)ᵀ, the
        expectation of the rotated squares when coordinates are uncorrelated (as they are in
        the SVD basis the old moments were measured in); nonnegative by construction."""
        sl, sr = square(cl), square(cr)
        split = self.sharded and cr is None  # a left side's moments, by rows of r under fsdp

        def turned(x: Tensor, c_l: Tensor | None, c_r: Tensor | None) -> Tensor:
            if not split:
                return rotate(x, c_l, c_r)
            whole = rotate(Rows.joined(x, c_l.shape[0]), c_l, c_r)  # type: ignore[union-attr]
            return whole[Rows.mine_of(whole.shape[0])]

        if "exp_avg" in st:
            st["exp_avg"].copy_(turned(st["exp_avg"], cl, cr))
        if "exp_avg_sq" in st:
            st["exp_avg_sq"].copy_(turned(st["exp_avg_sq"], sl, sr))
        if "exp_avg_sq_row" in st:  # Adafactor: rotate its rank-1 estimate, factor it again
            row, col = st["exp_avg_sq_row"], st["exp_avg_sq_col"]
            v = rotate(torch.outer(row, col) / row.mean(), sl, sr)
            row.copy_(v.mean(-1))
            col.copy_(v.mean(-2))
        if "state1" in st:
            import bitsandbytes.functional as bnbf

            for i, (c_l, c_r) in ((1, (cl, cr)), (2, (sl, sr))):
                code, absmax = st[f"qmap{i}"], st[f"absmax{i}"]
                x = bnbf.dequantize_blockwise(st[f"state{i}"], absmax=absmax, code=code,
                                              blocksize=BLOCK)
                q, qs = bnbf.quantize_blockwise(turned(x, c_l, c_r).contiguous(), code=code,
                                                blocksize=BLOCK)
                st[f"state{i}"].copy_(q)
                absmax.copy_(qs.absmax)

    # -- checkpoints -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Under fsdp, states kept by rows (a right-side or unprojected weight's moments, P by
        W's rows, a left side's moments by their r rows) are placed as row shards, which a
        checkpoint writes shard by shard; Q is whole on every rank."""
        sd = super().state_dict()
        for index, (p, side, rank) in enumerate(self._sides()):
            if index not in sd["state"]:
                continue
            rows, state = Rows(p), sd["state"][index]
            if side in ("left", "full"):
                state = rows.save(state, LEFT_WHOLE)
                if side == "left":
                    state = rows.save_split(state, SPLIT, rank)
            else:
                state = rows.save(state, (*BASIS_KEYS, *QMAPS, *ABSMAX))
            if side != "full":
                blocks = -(-math.prod(_moment_shape(p, side, rank)) // BLOCK)
                state = rows.save_blocks(state, ABSMAX, blocks)
            sd["state"][index] = state
        sd["svd_counts"] = self.svd_counts()
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch casts every state tensor to its parameter's dtype: 8-bit states and float32
        moments of bf16 weights come back as saved. Under fsdp, `state_dict`'s by rows cut."""
        restore_dtypes(self, super().load_state_dict, state_dict)
        for p, side, rank in self._sides():
            if p not in self.state:
                continue
            rows, st = Rows(p), self.state[p]
            if side in ("left", "full"):
                rows.load(st, LEFT_WHOLE)
                if side == "left":
                    rows.load_split(st, SPLIT, rank)
            else:
                rows.load(st, (*BASIS_KEYS, *QMAPS, *ABSMAX))
            if side != "full":
                rows.load_blocks(st, ABSMAX)
        self.load_svd_counts(state_dict)

    def _sides(self) -> list[tuple[Tensor, str, int | None]]:
        """Every parameter with its projected side and its group's rank, in state_dict's
        order."""
        return [(p, side_of(p.shape, g["proj_type"], g["rank"]) if g["rank"] else "none",
                 g["rank"]) for g in self.param_groups for p in g["params"]]


def _moment_shape(p: Tensor, side: str, rank: int | None) -> tuple[int, ...]:
    """The whole shape of p's moments: its own, or the low-rank one of its side."""
    return tuple(p.shape) if side == "none" else lowrank_shape(p.shape, side, rank)


def _has_basis(st: dict[str, Any]) -> bool:
    return any(k in st for k in BASIS_KEYS)


def _due(st: dict[str, Any], gap: int) -> bool:
    """Whether a projected weight's basis is (re)computed at this step."""
    return st.get("proj_step", 0) % gap == 0 or not _has_basis(st)


def _low_rank(p: Tensor, st: dict[str, Any], side: str, split: bool) -> Tensor:
    """What the inner optimizer sees: R = PᵀG, plus the sum `fold` kept of earlier micro-batches.
    Under fsdp a right side's R = GQᵀ is this rank's rows of it; a left side's PᵀG is the sum
    over ranks of P's rows times G's, reduce-scattered (`split`): this rank's rows of R (of its
    r), its moments' rows. A full side's all-reduced: the same R on every rank."""
    acc = st.pop("folded", None)
    if split and acc is not None:  # `fold` keeps the whole sum
        acc = acc[Rows.mine_of(acc.shape[0])]
    if p.grad is None:
        return acc
    r = project(Rows(p.grad).local, st, side)
    if split:
        r = Rows.split_sum(r)
    elif side in ("left", "full"):
        Rows(p).sum(r)
    return r if acc is None else acc.add_(r)
