"""The projection maths GaLore and Q-GaLore share: which side of a weight is projected, its
basis by (randomized) SVD (under fsdp, each SVD on one rank: `spread_bases`), a gradient brought
into the subspace and an update brought back, and the counts of SVDs that were retried or
failed."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from harness.distributed.rows import Rows

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
        out["left"] = _own(u, grad.dtype)
    if side in ("right", "full"):
        out["right"] = _own(vh, grad.dtype)
    return out


def _own(t: Tensor, dtype: torch.dtype) -> Tensor:
    """A basis with storage of its own size. `U[:, :rank]` and `Vh[:rank]` are views of the
    whole SVD: LAPACK (CPU) returns Vh column-major, so a contiguous copy was made anyway, but
    cuSOLVER returns it row-major, where `Vh[:rank]` is already contiguous and `.contiguous()`
    kept all k × n of it alive, a leak of k × n − rank × n floats a layer."""
    return t.to(dtype=dtype, memory_format=torch.contiguous_format, copy=True)


def safe_basis(grad: Tensor, side: str, rank: int, randomized: bool = False,
               seed: int = 0) -> tuple[dict[str, Tensor] | None, bool]:
    """(basis, retried): the SVD in float32, else in float64 (GaLore#7, #26, #58), else
    None, and the caller keeps its previous basis."""
    for dtype in (torch.float32, torch.float64):
        basis = compute_basis(grad, side, rank, randomized, seed, dtype)
        if basis is not None and all(bool(t.isfinite().all()) for t in basis.values()):
            return basis, dtype == torch.float64
    return None, False


def spread_bases(grads: list[Tensor], shapes: list[tuple[int, ...]], sides: list[str],
                 rank: int, randomized: bool,
                 seeds: list[int]) -> list[tuple[dict[str, Tensor] | None, bool]]:
    """`safe_basis` of each whole gradient under fsdp (`grads`: this rank's rows), each SVD
    computed by one rank (owners.py: balanced by m·n·min(m, n)): the gradients go whole to
    their owners in one all-to-all, and the bases come back as tensors in another, a left
    basis P by rows (this rank's rows of P: all it projects with), a right one Q whole (every
    rank's rows of G take all of it), each with two flags: found, retried."""
    world, _ = Rows.workers()
    who = Rows.share("svd", [m * n * min(m, n) for m, n in shapes], world)
    wholes = Rows.to_owners(grads, [Rows.Part(s, o) for s, o in zip(shapes, who, strict=True)])
    dtype, device = grads[0].dtype, grads[0].device
    parts, sent = [], []
    for shape, side, owner, whole, seed in zip(shapes, sides, who, wholes, seeds, strict=True):
        basis, retried = (None, False) if whole is None else \
            safe_basis(whole, side, rank, randomized, seed)
        parts.append(Rows.Part((2,), owner, rows=False))
        sent.append(None if whole is None else
                    torch.tensor([basis is not None, retried], dtype=dtype, device=device))
        for key, part_shape, by_rows in _basis_parts(shape, side, rank):
            parts.append(Rows.Part(part_shape, owner, by_rows))
            sent.append(None if whole is None else basis[key] if basis is not None
                        else whole.new_zeros(part_shape))
    del wholes
    got = iter(Rows.from_owners(sent, parts, dtype, device))
    found = []
    for shape, side in zip(shapes, sides, strict=True):
        ok, retried = next(got).tolist()
        basis = {key: next(got).clone()  # storage of its own, not the trip's buffer
                 for key, _, _ in _basis_parts(shape, side, rank)}
        found.append((basis if ok else None, bool(retried)))
    return found


def _basis_parts(shape: tuple[int, ...], side: str,
                 rank: int) -> list[tuple[str, tuple[int, int], bool]]:
    """A side's bases: key, whole shape, and whether a rank keeps its rows of it (P: the rows
    of W's it holds) or the whole (Q)."""
    m, n = shape
    parts = [("left", (m, rank), True)] if side in ("left", "full") else []
    return parts + ([("right", (rank, n), False)] if side in ("right", "full") else [])


class SVDCounts:
    """An optimizer's SVD counters: attempts since the last `take_svd_attempts` (what a step's
    event reports), and retries in float64 and failures since the trial began, checkpointed so
    that a resumed trial's events go on counting."""

    svd_attempts = 0
    svd_retries = 0  # float32 failed, float64 worked
    svd_failures = 0  # both failed: the previous basis was kept

    def take_svd_attempts(self) -> int:
        n, self.svd_attempts = self.svd_attempts, 0
        return n

    def svd_counts(self) -> dict[str, int]:
        """The counters a checkpoint keeps, under its "svd_counts" key."""
        return {"retries": self.svd_retries, "failures": self.svd_failures}

    def load_svd_counts(self, state_dict: dict[str, Any]) -> None:
        counts = state_dict.get("svd_counts", {})
        self.svd_retries = counts.get("retries", 0)
        self.svd_failures = counts.get("failures", 0)


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


def back_projected(update: Tensor, st: dict[str, Any], side: str) -> Tensor:
    """The update brought back to full size in float32: what `add_update` adds (and consumes)
    when a bf16 weight's sum must be rounded with care. Unprojected, a float32 `update` is
    returned itself, not copied: a caller hands over its scratch tensor."""
    u = update.float()
    left, right = (st[k].float() if k in st else None for k in ("left", "right"))
    if side == "left":
        return left @ u
    if side == "right":
        return u @ right
    if side == "full":
        return left @ u @ right
    return u


def rotate(x: Tensor, left: Tensor | None, right: Tensor | None) -> Tensor:
    """Coordinates in the old basis → the new: C_L · x · C_Rᵀ."""
    if left is not None:
        x = left @ x
    if right is not None:
        x = x @ right.T
    return x


def square(c: Tensor | None) -> Tensor | None:
    return None if c is None else c * c
