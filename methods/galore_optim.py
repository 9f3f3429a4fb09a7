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
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim.adamw import adamw as fused_adamw

from harness.methods.adafactor import adafactor
from harness.methods.adam8bit import BLOCK

BASIS_KEYS = ("left", "right")  # projection matrices: extra bytes, not optimizer state
MOMENT_KEYS = ("exp_avg", "exp_avg_sq", "exp_avg_sq_row", "exp_avg_sq_col",
               "state1", "state2", "absmax1", "absmax2")
OVERSAMPLE, POWER_ITERS = 8, 2  # randomized SVD (Halko et al., 2011)


def side_of(shape: tuple[int, ...], proj_type: str, rank: int) -> str:
    """Which side is projected. A rank ≥ min(m, n) saves no memory, and rotating a full basis
    would only make Adam's elementwise normalization basis-dependent: such weights are updated
    unprojected ("none"), exactly as plain AdamW with the update scaled by α."""
    m, n = shape
    if rank >= min(m, n):
        return "none"
    if proj_type == "std":  # the smaller side, as the reference (square: right)
        return "left" if m < n else "right"
    if proj_type == "reverse_std":
        return "right" if m < n else "left"
    return proj_type


def lowrank_shape(shape: tuple[int, ...], side: str, rank: int) -> tuple[int, int]:
    m, n = shape
    return {"none": (m, n), "left": (rank, n), "right": (m, rank), "full": (rank, rank)}[side]


def _svd(a: Tensor, rank: int, randomized: bool, seed: int) -> tuple[Tensor, Tensor]:
    """U[:, :rank] and Vh[:rank]. The randomized range finder draws from its own seeded
    generator, so it never moves the trainer's RNG and a resumed run draws the same numbers."""
    if not randomized:
        u, _, vh = torch.linalg.svd(a, full_matrices=False)
        return u[:, :rank], vh[:rank]
    gen = torch.Generator(a.device).manual_seed(seed)
    q = min(rank + OVERSAMPLE, *a.shape)
    y = a @ torch.randn(a.shape[1], q, generator=gen, device=a.device, dtype=a.dtype)
    for _ in range(POWER_ITERS):
        y = a @ torch.linalg.qr(a.T @ torch.linalg.qr(y).Q).Q
    q_basis = torch.linalg.qr(y).Q
    u, _, vh = torch.linalg.svd(q_basis.T @ a, full_matrices=False)
    return (q_basis @ u)[:, :rank], vh[:rank]


def compute_basis(grad: Tensor, side: str, rank: int, randomized: bool, seed: int,
                  dtype: torch.dtype) -> dict[str, Tensor] | None:
    """The new basis for `side`, computed in `dtype`; None when the SVD raises."""
    try:
        u, vh = _svd(grad.to(dtype), rank, randomized, seed)
    except RuntimeError:  # torch.linalg.LinAlgError: no convergence, non-finite input
        return None
    out = {}
    if side in ("left", "full"):
        out["left"] = u.to(grad.dtype).contiguous()
    if side in ("right", "full"):
        out["right"] = vh.to(grad.dtype).contiguous()
    return out


def project(grad: Tensor, st: dict[str, Any], side: str) -> Tensor:
    if side == "left":
        return st["left"].T @ grad
    if side == "right":
        return grad @ st["right"].T
    if side == "full":
        return st["left"].T @ grad @ st["right"].T
    return grad


def project_back_(param: Tensor, update: Tensor, st: dict[str, Any], side: str,
                  alpha: float) -> None:
    """param += alpha · (update brought back to full size), fused into one matmul."""
    if side == "left":
        param.addmm_(st["left"], update, alpha=alpha)
    elif side == "right":
        param.addmm_(update, st["right"], alpha=alpha)
    elif side == "full":
        param.addmm_(st["left"] @ update, st["right"], alpha=alpha)
    else:
        param.add_(update, alpha=alpha)


def rotate(x: Tensor, left: Tensor | None, right: Tensor | None) -> Tensor:
    """Coordinates in the old basis → the new: C_L · x · C_Rᵀ."""
    if left is not None:
        x = left @ x
    if right is not None:
        x = x @ right.T
    return x


def _square(c: Tensor | None) -> Tensor | None:
    return None if c is None else c * c


def _step_tensors(steps: list[int], device: torch.device) -> list[Tensor]:
    """The fused kernel's step counters, made on the device without a host-to-device copy."""
    if len(set(steps)) == 1:
        return list(torch.full((len(steps),), float(steps[0]), device=device).unbind())
    return [torch.full((), float(s), device=device) for s in steps]


class AdamKernel:
    """AdamW on lists of tensors: torch's fused kernel, or bitsandbytes' 8-bit blockwise one for
    states of at least `min_8bit_size` elements. GaLore and Q-GaLore run their low-rank moments
    through it."""

    def __init__(self, eight_bit: bool, min_8bit_size: int) -> None:
        self.eight_bit, self.min_8bit_size = eight_bit, min_8bit_size
        self._qmaps: dict[torch.device, tuple[Tensor, Tensor]] = {}

    def __call__(self, group: dict[str, Any], targets: list[Tensor], grads: list[Tensor],
              states: list[dict[str, Any]], lr: float, wd: float) -> None:
        """AdamW on `targets`; 8-bit blockwise states for the large ones when asked."""
        fused: list[int] = []
        for i, (g, st) in enumerate(zip(grads, states, strict=True)):
            if self.eight_bit and g.numel() >= self.min_8bit_size:
                self._adam8bit(group, targets[i], g, st, lr, wd)
                continue
            if "exp_avg" not in st:
                st.update(step=0, exp_avg=torch.zeros_like(g), exp_avg_sq=torch.zeros_like(g))
            fused.append(i)
        if not fused:
            return
        b1, b2 = group["betas"]
        sts = [states[i] for i in fused]
        fused_adamw([targets[i] for i in fused], [grads[i] for i in fused],
                    [st["exp_avg"] for st in sts], [st["exp_avg_sq"] for st in sts], [],
                    _step_tensors([st["step"] for st in sts], sts[0]["exp_avg"].device), fused=True,
                    amsgrad=False, beta1=b1, beta2=b2, lr=lr, weight_decay=wd,
                    eps=group["eps"], maximize=False)
        for st in sts:
            st["step"] += 1

    def _adam8bit(self, group: dict[str, Any], target: Tensor, grad: Tensor,
                  st: dict[str, Any], lr: float, wd: float) -> None:
        """bitsandbytes' blockwise 8-bit Adam update (it has CPU and CUDA kernels)."""
        import bitsandbytes.functional as bnbf

        if "state1" not in st:
            if grad.device not in self._qmaps:
                self._qmaps[grad.device] = tuple(  # type: ignore[assignment]
                    bnbf.create_dynamic_map(signed=s).to(grad.device) for s in (True, False))
            blocks = math.ceil(grad.numel() / BLOCK)
            q1, q2 = self._qmaps[grad.device]
            st.update(step=0, qmap1=q1, qmap2=q2,
                      state1=torch.zeros_like(grad, dtype=torch.uint8),
                      state2=torch.zeros_like(grad, dtype=torch.uint8),
                      absmax1=torch.zeros(blocks, device=grad.device),
                      absmax2=torch.zeros(blocks, device=grad.device))
        st["step"] += 1
        b1, b2 = group["betas"]
        bnbf.optimizer_update_8bit_blockwise(
            "adam", grad, target, st["state1"], st["state2"], b1, b2, 0.0, 0.0, group["eps"],
            st["step"], lr, st["qmap1"], st["qmap2"], st["absmax1"], st["absmax2"],
            weight_decay=wd)


class GaLoreOptimizer(torch.optim.Optimizer):
    """Groups with a `rank` are projected; the others get the inner optimizer at full rank."""

    def __init__(self, params: Iterable[Any], *, lr: float,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, inner: str = "adamw",
                 proj_type: str = "std", update_proj_gap: int = 200, scale: float = 0.25,
                 moments: str = "keep", svd: str = "exact", min_8bit_size: int = 4096,
                 adafactor_beta1: float | None = None) -> None:
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
                    "rank": None, "proj_type": proj_type, "update_proj_gap": update_proj_gap,
                    "scale": scale, "moments": moments, "svd": svd}
        super().__init__(params, defaults)
        self.inner, self.min_8bit_size, self.beta1 = inner, min_8bit_size, adafactor_beta1
        self.svd_attempts = 0  # since the last `take_svd_attempts`
        self.svd_retries = 0  # float32 failed, float64 worked
        self.svd_failures = 0  # both failed: the previous basis was kept
        self.adam = AdamKernel(inner == "adam8bit", min_8bit_size)

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
        return loss

    def take_svd_attempts(self) -> int:
        n, self.svd_attempts = self.svd_attempts, 0
        return n

    @torch.no_grad()
    def fold(self, p: Tensor, last: bool) -> Tensor | None:
        """Layer-wise accumulation (harness/modifiers/layerwise.py): this micro-batch's R = PᵀG
        joins p's low-rank sum and p.grad is freed. A sum opens before the last micro-batch only,
        and only for a projected p whose basis this step keeps; a refresh needs the whole G for
        its SVD, so p.grad then accumulates in full. Returns the sum (None: p.grad is kept)."""
        group = next(g for g in self.param_groups if any(q is p for q in g["params"]))
        side = side_of(p.shape, group["proj_type"], group["rank"]) if group["rank"] else "none"
        st = self.state.get(p, {})  # a sum opens only where a basis (so a state) exists
        if "folded" not in st and (last or side == "none" or _due(st, group["update_proj_gap"])):
            return None
        r = project(p.grad, st, side)
        st["folded"] = st["folded"].add_(r) if "folded" in st else r
        p.grad = None
        return st["folded"]

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for st in self.state.values():
            st.pop("folded", None)

    # -- full-rank parameters -------------------------------------------------------------
    def _plain_step(self, group: dict[str, Any], params: list[Tensor]) -> None:
        lr, wd = group["lr"], group["weight_decay"]
        states = [self.state[p] for p in params]
        grads = [p.grad for p in params]
        if self.inner == "adafactor":
            updates = adafactor(group["lr"], self.beta1, states, grads)
            if wd:
                torch._foreach_mul_(params, 1 - lr * wd)
            torch._foreach_sub_(params, updates)
            return
        self.adam(group, params, grads, states, lr, wd)

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
        grads = [_low_rank(p, st, s) for p, st, s in zip(params, states, sides, strict=True)]
        lr, wd, scale = group["lr"], group["weight_decay"], group["scale"]
        if self.inner == "adafactor":
            updates, alpha = adafactor(group["lr"], self.beta1, states, grads), -scale
        else:  # Adam leaves -N in a zeroed scratch tensor: lr 1, no decay there
            updates, alpha = [torch.zeros_like(g) for g in grads], lr * scale
            self.adam(group, updates, grads, states, 1.0, 0.0)
        if wd:  # decoupled, on the full weight
            torch._foreach_mul_(params, 1 - lr * wd)
        for p, u, st, side in zip(params, updates, states, sides, strict=True):
            project_back_(p, u, st, side, alpha)
            st["proj_step"] += 1

    def _refresh(self, group: dict[str, Any], params: list[Tensor],
                 states: list[dict[str, Any]], sides: list[str]) -> None:
        """New bases by SVD in float32; one host sync checks them all for non-finite values."""
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
        cr = basis["right"] @ old["right"].T if "right" in old else None
        self._reproject(st, cl, cr)

    def _reproject(self, st: dict[str, Any], cl: Tensor | None, cr: Tensor | None) -> None:
        """First moment: M ← C_L M C_Rᵀ. Second moment: V ← (C_L∘C_L) V (C_R∘C_R)ᵀ, the
        expectation of the rotated squares when coordinates are uncorrelated (as they are in
        the SVD basis the old moments were measured in); nonnegative by construction."""
        sl, sr = _square(cl), _square(cr)
        if "exp_avg" in st:
            st["exp_avg"].copy_(rotate(st["exp_avg"], cl, cr))
        if "exp_avg_sq" in st:
            st["exp_avg_sq"].copy_(rotate(st["exp_avg_sq"], sl, sr))
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
                q, qs = bnbf.quantize_blockwise(rotate(x, c_l, c_r).contiguous(), code=code,
                                                blocksize=BLOCK)
                st[f"state{i}"].copy_(q)
                absmax.copy_(qs.absmax)

    # -- checkpoints -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["svd_counts"] = {"retries": self.svd_retries, "failures": self.svd_failures}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch casts every state tensor to its parameter's dtype: 8-bit states get theirs back."""
        dtypes = {i: {k: v.dtype for k, v in s.items() if isinstance(v, Tensor)}
                  for i, s in state_dict["state"].items()}
        super().load_state_dict(state_dict)
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(ids, params, strict=True):
            st = self.state[p]
            for k, dtype in dtypes.get(i, {}).items():
                st[k] = st[k].to(dtype)
        counts = state_dict.get("svd_counts", {})
        self.svd_retries = counts.get("retries", 0)
        self.svd_failures = counts.get("failures", 0)


def _has_basis(st: dict[str, Any]) -> bool:
    return any(k in st for k in BASIS_KEYS)


def _due(st: dict[str, Any], gap: int) -> bool:
    """Whether a projected weight's basis is (re)computed at this step."""
    return st.get("proj_step", 0) % gap == 0 or not _has_basis(st)


def _low_rank(p: Tensor, st: dict[str, Any], side: str) -> Tensor:
    """What the inner optimizer sees: R = PᵀG, plus the sum `fold` kept of earlier micro-batches."""
    acc = st.pop("folded", None)
    if p.grad is None:
        return acc
    r = project(p.grad, st, side)
    return r if acc is None else acc.add_(r)
