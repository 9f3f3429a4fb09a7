"""Q-GaLore's optimizers (Zhang et al., 2024): GaLore on INT8 weights with INT4 projections and
lazy, similarity-driven subspace updates.

`QGaLoreOptimizer` is the fused, layer-wise form of the paper, on methods/int8_optim.py's base.
Each INT8 layer's weight gradient G reaches `_receive` inside backward (quant.Int8Linear's grad
hook) and is dropped after it.
Under gradient accumulation it is summed until the last micro-batch (the trainer's `sync`,
fixing Q-GaLore#13): in projected form (r×n or m×r) when no SVD is due, since projection is
linear, and in full only when the step needs an SVD. On the last micro-batch: the SVD (with
GaLore's float64 retry and keep-previous fallback), the LazyGap check, the basis stored as packed
INT4, the low-rank Adam step (GaLore's kernels, 32- or 8-bit), and the back-projected, α- and
lr-scaled update applied to the INT8 codes by stochastic rounding from a seeded generator whose
state is checkpointed. Embeddings, norms and lm_head train too (fixing Q-GaLore#12), each
parameter with the same inner optimizer at full rank, stepped in its own post-accumulate-grad
hook by the LayerwiseOptimizer this class extends; the scheduler drives every group's LR.
Gradient clipping, which cannot be global here, clips each other parameter's gradient on its own
and, with `clip_int8` (the default), each layer's low-rank gradient (what Adam sees): an INT8
layer's update is as exposed to a gradient spike as any other's. The reference never clips them
(its clip_grad_norm_ sees only parameters that require grad; its INT8 weights do not):
`clip_int8: false`.

`QGaLoreSimOptimizer` is the simulated form: float weights with ordinary `.grad` (so data
parallelism works), GaLore's optimizer with the same INT4 round trip on each basis and the same
lazy SVD schedule. With `snap` (simulate_mode: snap, the reference's simulation) every targeted
weight with a gradient is then rounded stochastically onto its fresh INT8 grid, drawing from a
seeded generator that is checkpointed (and the same on every rank, so replicas stay equal).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

from harness.methods.adam_kernel import AdamKernel
from harness.methods.galore_optim import GaLoreOptimizer
from harness.methods.int8_optim import Int8LayerwiseOptimizer, on_device, per_parameter
from harness.methods.projection import SVDCounts, project, project_back_, safe_basis, side_of
from harness.methods.quant import (
    Int8Linear,
    LazyGap,
    dequantize_int4_packed,
    quantize_int4_packed,
    snap_int8_,
)

INT4_KEYS = ("packed", "scale", "zero")


def basis_shapes(shape: tuple[int, ...], side: str, rank: int) -> dict[str, tuple[int, int]]:
    m, n = shape
    return {k: s for k, s in (("left", (m, rank)), ("right", (rank, n)))
            if side in (k, "full")}


def first_vector(basis: dict[str, Tensor]) -> Tensor:
    """The first singular vector of the projected side, which LazyGap compares across SVDs."""
    return basis["left"][:, 0] if "left" in basis else basis["right"][0]


class LazySVDCounts(SVDCounts):
    """The SVD counts Q-GaLore's event reports, for its fused and its simulated form."""

    def lazy_schedule(self) -> tuple[list[LazyGap], list[int], int]:
        """Each projected weight's LazyGap, its updates so far, and the base gap."""
        raise NotImplementedError

    def svd_stats(self) -> dict[str, Any]:
        """SVDs done, those the lazy gap skipped against GaLore's fixed schedule (an SVD at every
        multiple of the base gap: ceil(steps / gap) of them), the mean current gap, and the
        retries and failures so far."""
        gaps, steps, base_gap = self.lazy_schedule()
        total = sum(g.svd_count for g in gaps)
        fixed = sum(math.ceil(s / base_gap) for s in steps)
        return {"svd_total": total, "svd_skipped": fixed - total,
                "gap_mean": sum(g.gap for g in gaps) / max(1, len(gaps)),
                "svd_retries": self.svd_retries, "svd_failures": self.svd_failures}


class QGaLoreOptimizer(LazySVDCounts, Int8LayerwiseOptimizer):
    """INT8 layers updated in their backward; the other parameters layer-wise at full rank."""

    def __init__(self, layers: list[Int8Linear], params: list[nn.Parameter], *, lr: float,
                 betas: tuple[float, float], eps: float, weight_decay: float, inner: str,
                 min_8bit_size: int, rank: int, proj_type: str, scale: float, proj_group: int,
                 lazy: dict[str, Any], clip: float | None, clip_int8: bool, seed: int,
                 state_dtype: torch.dtype | None = None, compensation: str = "none") -> None:
        make = per_parameter(GaLoreOptimizer, weight_decay, lr=lr, betas=betas, eps=eps,
                             inner=inner, min_8bit_size=min_8bit_size, state_dtype=state_dtype,
                             compensation=compensation)
        group = {"params": [], "lr": lr, "betas": betas, "eps": eps,
                 "weight_decay": weight_decay, "rank": rank, "scale": scale}
        super().__init__(layers, {m: {"updates": 0, "moments": {}} for m in layers}, params,
                         make, group=group, clip=clip, seed=seed, state_dtype=state_dtype)
        self.adam = AdamKernel(inner == "adam8bit", min_8bit_size)  # the low-rank moments' update
        self.proj_group, self.base_gap = proj_group, lazy["base_gap"]
        self.int8_clip = clip if clip_int8 else None  # the reference's: None
        self.sides = {m: side_of((m.out_features, m.in_features), proj_type, rank)
                      for m in layers}
        self.gaps = {m: LazyGap(**lazy) for m in layers}

    def _needs_svd(self, m: Int8Linear) -> bool:
        return self.sides[m] != "none" and self.gaps[m].due(self.layer_state[m]["updates"])

    def _part(self, m: Int8Linear, g: Tensor) -> Tensor:
        """G in full when an SVD is due or nothing is projected, else projected (r×n or m×r):
        neither changes until the step's update."""
        side = self.sides[m]
        if side == "none" or self._needs_svd(m):
            return g
        return project(g, self.dequantized_basis(m), side)

    def dequantized_basis(self, m: Int8Linear) -> dict[str, Tensor]:
        """The INT4 basis, dequantized for this use only."""
        st, shapes = self.layer_state[m], basis_shapes(
            (m.out_features, m.in_features), self.sides[m], self.group["rank"])
        return {k: dequantize_int4_packed(*(q[i] for i in INT4_KEYS), shapes[k], self.proj_group)
                for k, q in st.get("basis", {}).items()}

    @torch.no_grad()
    def _step_layer(self, m: Int8Linear, g: Tensor) -> None:
        side, st, group, full = self.sides[m], self.layer_state[m], self.group, self._needs_svd(m)
        if full:
            self._refresh(m, g)
            if "basis" not in st:
                return  # the first SVD failed: this layer waits for the next step
        basis = self.dequantized_basis(m)
        low = project(g, basis, side) if full else g
        if self.state_dtype is not None:
            low = low.to(self.state_dtype)
        if self.int8_clip:
            low.mul_((self.int8_clip / (low.norm() + 1e-6)).clamp(max=1.0))
        scratch = torch.zeros_like(low)  # Adam with lr 1 and no decay leaves -N here
        self.adam(group, [scratch], [low], [st["moments"]], 1.0, 0.0)
        lr, wd = group["lr"], group["weight_decay"]
        delta = torch.zeros(m.out_features, m.in_features, device=low.device)
        project_back_(delta, scratch.float(), basis, side, lr * group["scale"])
        if wd:  # decoupled, on the full weight
            delta.add_(m.dequantized(), alpha=-lr * wd)
        m.apply_update(delta, self.generator)
        st["updates"] += 1

    def _refresh(self, m: Int8Linear, g: Tensor) -> None:
        st = self.layer_state[m]
        self.svd_attempts += 1
        basis, retried = safe_basis(g, self.sides[m], self.group["rank"])
        if basis is None:  # keep the previous basis; the SVD is due again next step
            self.svd_failures += 1
            return
        self.svd_retries += retried
        self.gaps[m].observe(st["updates"], first_vector(basis))
        st["basis"] = {k: dict(zip(INT4_KEYS, quantize_int4_packed(v, self.proj_group),
                                   strict=True)) for k, v in basis.items()}

    def lazy_schedule(self) -> tuple[list[LazyGap], list[int], int]:
        projected = [m for m in self.layers if self.sides[m] != "none"]
        return ([self.gaps[m] for m in projected],
                [self.layer_state[m]["updates"] for m in projected], self.base_gap)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(),
                "lazy": [self.gaps[m].state_dict() for m in self.layers],
                "svd_counts": self.svd_counts()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        for m, lazy in zip(self.layers, state_dict["lazy"], strict=True):
            self.gaps[m].load_state_dict(on_device(lazy, m.codes.device))
        self.load_svd_counts(state_dict)


class QGaLoreSimOptimizer(LazySVDCounts, GaLoreOptimizer):
    """GaLore with INT4-rounded bases and the lazy schedule, on float weights (`simulate`);
    `snap`: the INT8 group size to which targeted weights are snapped after each step,
    `stochastic`ally (from a generator seeded by `seed`) or to the nearest code."""

    def __init__(self, params: Iterable[Any], *, lazy: dict[str, Any], proj_group: int,
                 snap: int | None, seed: int, stochastic: bool = True, **kwargs: Any) -> None:
        super().__init__(params, update_proj_gap=1, moments="keep", **kwargs)  # LazyGap decides
        self.lazy, self.proj_group, self.snap = lazy, proj_group, snap
        targets = self.targets()
        device = targets[0].device if targets else torch.device("cpu")
        self.generator = torch.Generator(device).manual_seed(seed) \
            if snap is not None and stochastic else None

    def targets(self) -> list[Tensor]:
        return [p for g in self.param_groups if g["rank"] for p in g["params"]]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """GaLore's step, then (snap) each targeted weight that has a gradient, as the
        reference does, onto its INT8 grid."""
        loss = super().step(closure)
        if self.snap is not None:  # no generator: to the nearest code
            for p in self.targets():
                if p.grad is not None:
                    snap_int8_(p, self.snap, self.generator)
        return loss

    def _gap(self, st: dict[str, Any]) -> LazyGap:
        gap = LazyGap(**self.lazy)
        if "lazy" in st:
            gap.load_state_dict(st["lazy"])
        return gap

    def _refresh(self, group: dict[str, Any], params: list[Tensor],
                 states: list[dict[str, Any]], sides: list[str]) -> None:
        due = [i for i, st in enumerate(states) if self._gap(st).due(st["proj_step"])]
        super()._refresh(group, [params[i] for i in due], [states[i] for i in due],
                         [sides[i] for i in due])

    def _switch(self, policy: str, st: dict[str, Any], basis: dict[str, Tensor]) -> None:
        gap = self._gap(st)
        gap.observe(st["proj_step"], first_vector(basis))
        st["lazy"] = gap.state_dict()
        rounded = {k: dequantize_int4_packed(*quantize_int4_packed(v, self.proj_group), v.shape,
                                             self.proj_group).to(v.dtype)  # GaLore's dtype
                   for k, v in basis.items()}
        super()._switch(policy, st, rounded)

    def lazy_schedule(self) -> tuple[list[LazyGap], list[int], int]:
        states = [st for st in self.state.values() if "lazy" in st]
        return ([self._gap(st) for st in states], [st["proj_step"] for st in states],
                self.lazy["base_gap"])

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        if self.generator is not None:
            sd["snap_generator"] = self.generator.get_state()
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        if self.generator is not None:
            self.generator.set_state(state_dict["snap_generator"])
