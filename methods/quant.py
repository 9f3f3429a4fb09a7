"""Q-GaLore's quantization building blocks (Zhang et al., 2024): INT8 weights, INT4 projections.

Conventions (shared by INT8 and INT4; codes match q-galore-torch wherever a group spans zero):
- Groups are `group` consecutive elements of the row-major flattened tensor; the last group may
  be short (any size works, unlike the reference, which asserts numel % group == 0).
- Asymmetric min-max, as in the reference: per group `scale = (hi - lo) / qmax` (float32, at
  least 1e-5 / qmax) and an integer zero point `zero = -round(lo / scale)` stored as uint8;
  codes are unsigned (uint8, 0..qmax) and `x ≈ (code - zero) * scale`. Unlike the reference,
  the range is widened to contain 0 (`lo <= 0 <= hi`): the reference clamps a group that lies
  entirely above or below 0 (zero point clamped to 0 or qmax) and then saturates its codes.
- INT4 codes are packed two per byte over the flattened stream: byte i holds code 2i in its
  low nibble and code 2i+1 in its high nibble (0 when the count is odd): ceil(numel / 2) bytes.
- Stochastic rounding draws from a caller's torch.Generator, so a run is reproducible and
  resumes exactly when the generator state (`get_state()`) is checkpointed. It rounds up with
  probability frac(x / scale), the reference's rule: with the same seed on the CPU both give
  the same codes. It is unbiased for values inside the group's grid, [-zero, qmax - zero] *
  scale; a group's extremes can sit up to scale / 2 outside it (the zero point is rounded), and
  there the clamp biases the code by less than one step, as in the reference.
- A weight update requantizes the updated float weight with a fresh per-group range (as the
  reference does), so weights may grow; stochastic rounding keeps E[new weight] = old + delta.
  `snap_int8_` does the same to a float weight in place (`simulate_mode: snap`).

Int8Linear and the fused backward update: the module keeps the INT8 codes, scales and zero
points as buffers (no float weight parameter, so `model.parameters()` skips it) and runs a
custom autograd Function. Its backward computes the input gradient with the weight as it was
in forward, then the weight gradient G (out x in, float32) and hands G to `grad_hook(module,
G)`; without a hook G is summed into `module.weight_grad`. A layer-wise qgalore method sets the
hook: project G with GaLore, step Adam, `module.apply_update(delta, generator)`, and drop G, all
inside backward, so one layer's G exists at a time. Under gradient accumulation the hook runs on
every micro-batch: the method must accumulate (G, or the projected G when no SVD falls in the
step) and update on the last one only (Q-GaLore#13). The hook fires even when neither the input
nor a bias needs a gradient (a zero-size anchor input requires grad). Forward and backward
dequantize into a transient matrix of the input's dtype (computed in float32, CHUNK groups at a
time); `apply_update` rebinds new buffers, never writes in place, so a forward's saved codes
stay valid.

LazyGap has two schedules (`lazy_schedule`). `ours` (the default) differs from the reference's
projector in three ways: an SVD is due `gap` steps after the last one (the reference tests
`step % gap == 0`, which after a growth can fire one old gap later); the cosine is taken in
absolute value (singular vectors have an arbitrary sign, which the reference reads as
dissimilarity); and the queue restarts after each growth, so every growth needs `queue_size`
fresh checks, the paper's "over k checks" (the reference keeps a rolling queue and grows at every
SVD while its mean stays high: 200 → 400 → 800 …). `reference` is q-galore-torch's rule
(q_galore_projector.py, GaLoreProjector.project): signed cosine, rolling queue, `step % gap`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

GROUP = 256
INT8_MAX = 255
INT4_MAX = 15
PARAM_BYTES = 5  # per group: a float32 scale and a uint8 zero point
CHUNK = 4096  # groups (de)quantized at a time: 1 Mi values, 4 MiB per float32 temporary


def _groups(x: torch.Tensor, group: int) -> torch.Tensor:
    """The flattened tensor as float32 rows of `group`, the last padded with zeros (which are
    inside every group's range, so padding never moves it)."""
    flat = x.detach().reshape(-1).float()
    return F.pad(flat, (0, -flat.numel() % group)).view(-1, group)


def _params(rows: torch.Tensor, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    lo = rows.amin(dim=1).clamp(max=0)
    hi = rows.amax(dim=1).clamp(min=0)
    scale = (hi - lo).clamp(min=1e-5) / qmax
    return scale, -torch.round(lo / scale)


def _codes(
    rows: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, qmax: int,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """Nearest (no generator) or stochastic rounding of `rows / scale`, shifted by the zero."""
    t = rows / scale[:, None]
    if generator is None:
        q = torch.round(t)
    else:
        q = torch.floor(t)
        u = torch.rand(t.shape, generator=generator, device=generator.device).to(t.device)
        q += (u < t - q).float()
    return (q + zero[:, None].float()).clamp_(0, qmax).to(torch.uint8)


def _trim(codes: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The first numel(shape) codes, copied when padded so no padding stays allocated."""
    n = math.prod(shape)
    flat = codes.reshape(-1)
    return (flat if flat.numel() == n else flat[:n].clone()).reshape(shape)


def _expand(v: torch.Tensor, group: int, n: int) -> torch.Tensor:
    return v.float().repeat_interleave(group)[:n]


def quantize_int8(
    w: torch.Tensor, group: int = GROUP, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes uint8 shaped like w, scale float32 [groups], zero uint8 [groups]); stochastic
    rounding when a generator is given, else nearest."""
    rows = _groups(w, group)
    scale, zero = _params(rows, INT8_MAX)
    codes = _codes(rows, scale, zero, INT8_MAX, generator)
    return _trim(codes, w.shape), scale, zero.to(torch.uint8)


def dequantize_int8(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int = GROUP,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """`(code - zero) * scale` computed in float32, in `dtype`, shaped like the codes; CHUNK
    groups at a time, so beside the result only a few float32 chunks are ever allocated."""
    flat, out = codes.reshape(-1), torch.empty(codes.numel(), dtype=dtype, device=codes.device)
    for g, a, b in _chunks(scale.numel(), group, flat.numel()):
        out[a:b] = (flat[a:b].float() - _expand(zero[g], group, b - a)) \
            * _expand(scale[g], group, b - a)
    return out.view(codes.shape)


def _chunks(groups: int, group: int, n: int) -> Iterator[tuple[slice, int, int]]:
    """(groups, first element, end element) of each run of CHUNK whole groups."""
    for g0 in range(0, groups, CHUNK):
        g1 = min(g0 + CHUNK, groups)
        yield slice(g0, g1), g0 * group, min(g1 * group, n)


@torch.no_grad()
def requantize_int8(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, delta: torch.Tensor,
    group: int, generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SR(deq(codes) + delta) on fresh per-group grids, CHUNK groups at a time, without the ~7
    float32 matrices the whole-matrix form allocates at once (over a GB above the estimate at
    LLaMA-7B, 11008 x 4096 each). Groups never span chunks, and a CPU
    generator draws in the same order: there the codes equal `quantize_int8(dequantize_int8(
    ...) + delta)`'s. CUDA's Philox advances per draw, so there they differ, still seeded."""
    flat, step = codes.reshape(-1), delta.reshape(-1)
    new_codes, new_scale, new_zero = (torch.empty_like(flat), torch.empty_like(scale),
                                      torch.empty_like(zero))
    for g, a, b in _chunks(scale.numel(), group, flat.numel()):
        w = dequantize_int8(flat[a:b], scale[g], zero[g], group).add_(step[a:b])
        new_codes[a:b], new_scale[g], new_zero[g] = quantize_int8(w, group, generator)
    return new_codes.view(codes.shape), new_scale, new_zero


@torch.no_grad()
def snap_int8_(
    w: torch.Tensor, group: int, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w ← its stochastic rounding (nearest without a generator) onto a fresh per-group INT8
    grid, in place (in w's dtype): the reference's `simulate` keeps float weights on the INT8
    grid this way after each step.
    Returns the grid (codes, scale, zero) it snapped to."""
    q = quantize_int8(w, group, generator)
    w.copy_(dequantize_int8(*q, group))
    return q


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Flattened 4-bit codes (uint8, 0..15), two per byte, low nibble first."""
    flat = codes.reshape(-1).to(torch.uint8)
    flat = F.pad(flat, (0, flat.numel() % 2))
    return flat[0::2] | (flat[1::2] << 4)


def unpack_int4(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The first `n` codes of `pack_int4`'s output, flattened."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=1).reshape(-1)[:n]


def quantize_int4_packed(
    x: torch.Tensor, group: int = GROUP
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed uint8 [ceil(numel / 2)], scale float32 [groups], zero uint8 [groups]), nearest
    rounding: a projection is recomputed from an SVD, never accumulated, so it needs no SR."""
    rows = _groups(x, group)
    scale, zero = _params(rows, INT4_MAX)
    codes = _codes(rows, scale, zero, INT4_MAX, None).view(-1)[: x.numel()]
    return pack_int4(codes), scale, zero.to(torch.uint8)


def dequantize_int4_packed(
    packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
    shape: torch.Size | tuple[int, ...], group: int = GROUP,
) -> torch.Tensor:
    """float32 tensor of `shape` from `quantize_int4_packed`'s output."""
    return dequantize_int8(unpack_int4(packed, math.prod(shape)), scale, zero, group).reshape(shape)


def int8_bytes(shape: torch.Size | tuple[int, ...], group: int = GROUP) -> int:
    """Exact bytes `quantize_int8` allocates: one per value, plus a scale and zero per group."""
    n = math.prod(shape)
    return n + PARAM_BYTES * math.ceil(n / group)


def int4_packed_bytes(shape: torch.Size | tuple[int, ...], group: int = GROUP) -> int:
    """Exact bytes `quantize_int4_packed` allocates: half a byte per value, rounded up."""
    n = math.prod(shape)
    return math.ceil(n / 2) + PARAM_BYTES * math.ceil(n / group)


Schedule = Literal["ours", "reference"]


class LazyGap:
    """Q-GaLore's lazy subspace updates for one matrix: the SVD interval grows by `gamma` once
    the first singular vectors of `queue_size` consecutive SVDs keep a mean cosine similarity
    with their predecessor of at least `threshold` (the subspace has converged); `schedule` as
    the module docstring says."""

    def __init__(self, base_gap: int, queue_size: int = 5, threshold: float = 0.4,
                 gamma: float = 2.0, schedule: Schedule = "ours") -> None:
        self.gap = base_gap
        self.queue_size = queue_size
        self.threshold = threshold
        self.gamma = gamma
        self.reference = schedule == "reference"
        self.queue: list[float] = []
        self.svd_count = 0
        self.last_step: int | None = None
        self.prev: torch.Tensor | None = None

    def due(self, step: int) -> bool:
        """An SVD is due at the first step, then `gap` steps after the last one (reference:
        at every multiple of `gap`)."""
        if self.last_step is None:
            return True
        return step % self.gap == 0 if self.reference else step - self.last_step >= self.gap

    def observe(self, step: int, vector: torch.Tensor) -> float | None:
        """Records an SVD at `step` with first singular vector `vector`; returns its cosine
        with the previous one (None at the first SVD): in absolute value for `ours`, because an
        SVD's singular vectors are only defined up to sign; signed for `reference`."""
        self.svd_count += 1
        self.last_step = step
        v = vector.detach().reshape(-1).float().clone()
        cos = None
        if self.prev is not None:
            cos = F.cosine_similarity(self.prev, v, dim=0).item()
            cos = cos if self.reference else abs(cos)
            self.queue = [*self.queue, cos][-self.queue_size:]
            full = len(self.queue) == self.queue_size
            if full and sum(self.queue) / self.queue_size >= self.threshold:
                self.gap = int(self.gap * self.gamma)
                if not self.reference:
                    self.queue = []
        self.prev = v
        return cos

    def state_dict(self) -> dict[str, Any]:
        return {"gap": self.gap, "queue": list(self.queue), "svd_count": self.svd_count,
                "last_step": self.last_step, "prev": self.prev}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.gap, self.svd_count, self.prev = state["gap"], state["svd_count"], state["prev"]
        self.last_step, self.queue = state["last_step"], list(state["queue"])


GradHook = Callable[["Int8Linear", torch.Tensor], None]


class _Int8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                zero: torch.Tensor, bias: torch.Tensor | None, anchor: torch.Tensor,
                module: Int8Linear) -> torch.Tensor:
        ctx.save_for_backward(x, codes, scale, zero)
        ctx.module, ctx.has_bias = module, bias is not None
        return F.linear(x, dequantize_int8(codes, scale, zero, module.group, x.dtype), bias)

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, codes, scale, zero = ctx.saved_tensors
        module: Int8Linear = ctx.module
        gx = gb = None
        if ctx.needs_input_grad[0]:
            gx = gy @ dequantize_int8(codes, scale, zero, module.group, gy.dtype)
        gy2 = gy.reshape(-1, gy.shape[-1]).float()
        if ctx.has_bias and ctx.needs_input_grad[4]:
            gb = gy2.sum(0).to(gy.dtype)
        module._receive(gy2.T @ x.reshape(-1, x.shape[-1]).float())
        return gx, None, None, None, gb, None, None


class Int8Linear(nn.Module):
    """nn.Linear with an INT8 weight: see the module docstring for the fused-update design."""

    FLOAT32_BUFFERS = ("scale",)  # bf16-true keeps it: apply_update recomputes it in float32
    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 group: int = GROUP, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features, self.group = in_features, out_features, group
        groups = math.ceil(in_features * out_features / group)
        kw = {"dtype": torch.uint8, "device": device}
        self.register_buffer("codes", torch.zeros(out_features, in_features, **kw))
        self.register_buffer("scale", torch.ones(groups, device=device))
        self.register_buffer("zero", torch.zeros(groups, **kw))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device)) if bias else None
        self.grad_hook: GradHook | None = None
        self.weight_grad: torch.Tensor | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: int = GROUP) -> Int8Linear:
        """Quantizes a linear layer's weight with nearest rounding; keeps its bias."""
        out = cls(linear.in_features, linear.out_features, linear.bias is not None, group,
                  linear.weight.device)
        out.codes, out.scale, out.zero = quantize_int8(linear.weight, group)
        if linear.bias is not None:
            out.bias.data.copy_(linear.bias.detach())
        return out

    def dequantized(self) -> torch.Tensor:
        return dequantize_int8(self.codes, self.scale, self.zero, self.group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        anchor = torch.empty(0, device=x.device, requires_grad=True)  # backward always runs
        return _Int8Matmul.apply(x, self.codes, self.scale, self.zero, self.bias, anchor, self)

    @torch.no_grad()
    def apply_update(self, delta: torch.Tensor, generator: torch.Generator) -> None:
        """w ← SR(deq(w) + delta) on a fresh per-group grid: unbiased, so small updates add up."""
        self.codes, self.scale, self.zero = requantize_int8(
            self.codes, self.scale, self.zero, delta, self.group, generator)

    def _receive(self, g: torch.Tensor) -> None:
        if self.grad_hook is not None:
            self.grad_hook(self, g)
        elif self.weight_grad is None:
            self.weight_grad = g
        else:
            self.weight_grad += g

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, group={self.group}")
